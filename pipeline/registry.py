"""Transforms that configs may name: ``{name: NAME, kwargs: {...}}``.

:func:`register` adds a factory under a name; the built-in transforms
(``decode``, ``pad``) register themselves when :mod:`quern.transforms` is
imported (which ``import quern`` does). A config can name only what is here or
a function it is allowed to import (see :mod:`quern.pipeline.config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["REGISTRY", "register"]

REGISTRY: dict[str, Callable[..., Any]] = {}
"""Name -> transform factory (a class whose instances are dataclasses, or a function)."""

F = TypeVar("F", bound=Callable[..., Any])


def register(name: str) -> Callable[[F], F]:
    """Decorator: make a transform factory available to configs as ``{name: NAME, kwargs: {...}}``.

    For :func:`quern.pipeline.dump.to_config` to write a transform back, the
    factory must be a class whose instances are dataclasses (their fields become
    ``kwargs``)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register() needs a non-empty name, got {name!r}")

    def add(factory: F) -> F:
        REGISTRY[name] = factory
        return factory

    return add
