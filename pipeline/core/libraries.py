"""Loading the C libraries the wheel builds (``pipeline/native/``, ``.build/hatch_build.py``): one rule for each.

A library is used only where it is installed, loads, has its functions' expected version (a stale build is
refused), gives the results of its Python twin on a few inputs (:func:`checked`), and ``QUERN_NATIVE=0`` is
not in the environment; otherwise the caller uses its Python or NumPy path (the same results, slower) and
says why. ``ctypes.CDLL`` releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["checked", "load"]


def load(path: Path, typed: Callable[[Any], str]) -> tuple[Any, str]:
    """The library at ``path``, its functions typed, or ``None`` and why it is not used.

    Args:
        path: the compiled library.
        typed: sets the library's functions' ``argtypes`` and ``restype`` and returns why its version is not
            the expected one (``""``: it is).
    """
    if os.environ.get("QUERN_NATIVE", "1") == "0":
        return None, "QUERN_NATIVE=0 in the environment"
    if not path.is_file():
        return None, f"{path} is not installed (the wheel was built without a C compiler)"
    try:
        lib = ctypes.CDLL(str(path))
        stale = typed(lib)
    except (OSError, AttributeError) as e:
        return None, f"{path} does not load: {e}"
    return (None, f"{path} {stale} (a stale build)") if stale else (lib, "")


def checked(loaded: tuple[Any, str], self_test: Callable[[Any], str]) -> tuple[Any, str]:
    """``loaded`` (:func:`load`'s result), unless its library fails ``self_test``.

    ``self_test(lib)`` says how the library's results differ from the Python path's on a few inputs
    (``""``: they do not); where they differ, ``None`` and that difference.
    """
    lib, why = loaded
    if lib is not None and (why := self_test(lib)):
        lib = None
    return lib, why
