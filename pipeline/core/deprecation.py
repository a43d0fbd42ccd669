"""Old spellings of a call kept working, with a ``DeprecationWarning`` naming the new one.

Two decorators, for the two ways an API changes without breaking its callers:

- :func:`renamed`: a keyword argument got a new name (``workers=`` is now
  ``num_workers=``); the old name is still accepted.
- :func:`keyword_only`: options became keyword-only; a call that still passes
  them positionally is still accepted.

Both change nothing for a call in the new form, and the function's signature
(``inspect.signature``, IDE hovers) is the new one.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["keyword_only", "renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed(**old_to_new: str) -> Callable[[F], F]:
    """Decorator: accept each old keyword argument under its new name, with a ``DeprecationWarning``.

    Args:
        **old_to_new: the old name of each renamed parameter, mapped to its new name.

    Returns:
        A decorator that wraps a function so that ``f(old=v)`` calls ``f(new=v)``
        after warning; passing both names raises ``TypeError``.

    Example:
        >>> import warnings
        >>> @renamed(workers="num_workers")
        ... def run(path, *, num_workers=0):
        ...     return num_workers
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     run("x", workers=4)
        4
        >>> print(caught[0].message)
        run(): workers= is deprecated; use num_workers=
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__qualname__}() got both {old}= (deprecated) and {new}=")
                    warnings.warn(
                        f"{fn.__qualname__}(): {old}= is deprecated; use {new}=", DeprecationWarning, stacklevel=2
                    )
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


def keyword_only(*names: str) -> Callable[[F], F]:
    """Decorator: options that became keyword-only are still taken positionally, with a ``DeprecationWarning``.

    Args:
        *names: the keyword-only parameters, in the order they used to be positional.

    Returns:
        A decorator that wraps a function so that positional values beyond its
        positional parameters are passed as ``names``, in order, after warning.

    Example:
        >>> import warnings
        >>> @keyword_only("cache_dir")
        ... def scan(path, *, cache_dir=None):
        ...     return cache_dir
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     scan("x", "/tmp")
        '/tmp'
        >>> print(caught[0].message)
        scan(): pass cache_dir as a keyword argument (cache_dir=...)
    """

    def decorate(fn: F) -> F:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = sum(p.kind in kinds for p in inspect.signature(fn).parameters.values())

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            extra = args[positional:]
            if extra:
                if len(extra) > len(names):
                    raise TypeError(f"{fn.__qualname__}() takes {positional + len(names)} positional arguments")
                moved = names[: len(extra)]
                if any(n in kwargs for n in moved):
                    raise TypeError(f"{fn.__qualname__}() got {moved} both positionally and as keywords")
                warnings.warn(
                    f"{fn.__qualname__}(): pass {', '.join(moved)} as a keyword argument "
                    f"({', '.join(f'{n}=...' for n in moved)})",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs.update(zip(moved, extra))
                args = args[:positional]
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate
