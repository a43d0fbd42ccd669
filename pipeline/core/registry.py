"""Transforms that configs may name: ``{name: NAME, kwargs: {...}}``.

:func:`register` adds a factory under a name; the built-in transforms
(``decode``, ``pad``, ``metadata_range``) register themselves when
:mod:`quern.transforms` is imported (which ``import quern`` does). A config can
name only what is here or a function it is allowed to import (see
:mod:`quern.pipeline.config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["REGISTRY", "register", "builtin_name"]

REGISTRY: dict[str, Callable[..., Any]] = {}
"""Name -> transform factory (a class whose instances are dataclasses, or a function)."""

_PACKAGE = __name__.split(".")[0]  # quern: the built-in transforms are the ones registered from its own modules

F = TypeVar("F", bound=Callable[..., Any])


def register(name: str) -> Callable[[F], F]:
    """Decorator: make a transform factory available to configs as ``{name: NAME, kwargs: {...}}``.

    For :func:`quern.pipeline.streams.config_form.to_config` to write a transform back, the
    factory must be a class whose instances are dataclasses (their fields become
    ``kwargs``).

    Args:
        name: the name configs use.

    Returns:
        A decorator that registers its argument and returns it unchanged.

    Raises:
        TypeError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register() needs a non-empty name, got {name!r}")

    def add(factory: F) -> F:
        REGISTRY[name] = factory
        return factory

    return add


def builtin_name(fn: object) -> str | None:
    """The registered name of ``fn`` if it is one of quern's own registered transforms, else ``None``.

    Quern's own transforms are instances of classes defined in quern's modules,
    registered, with an ``int`` ``VERSION``. Such a transform is described in the
    fingerprint by this name, its ``VERSION`` and its arguments, not by its code
    (see :mod:`quern.pipeline.identity.fingerprint`).

    Args:
        fn: any object.

    Returns:
        The name it is registered under, or ``None``.
    """
    cls = type(fn)
    if cls.__module__.split(".")[0] != _PACKAGE or not isinstance(getattr(cls, "VERSION", None), int):
        return None
    for name, factory in REGISTRY.items():
        if factory is cls:
            return name
    return None
