"""Pipelines as configuration: YAML, JSON or a dict <-> :class:`~quern.Pipeline`.

:func:`load_config` builds a pipeline from a config (:mod:`.load`), and
:func:`to_config` writes a pipeline's config. The format is the schema's
(:mod:`.schema`, one pydantic model per section, a description per key); the
checks and their messages are :mod:`.validate`'s, and what a config may import
is :mod:`.trust`'s rule. The limits on what a config file can make quern do are
:mod:`quern.pipeline.config.limits`'.
"""

from ..core.errors import ConfigError
from ..core.registry import REGISTRY, register
from ..streams.config_form import to_config
from .load import load_config

__all__ = ["REGISTRY", "ConfigError", "load_config", "register", "to_config"]
