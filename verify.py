"""Checking determinism: step digests across topologies, ledgers against the data: see :mod:`quern.pipeline.integrity.checks`."""

from .pipeline.integrity.checks import *  # noqa: F403
from .pipeline.integrity.checks import __all__, __doc__  # noqa: F401
