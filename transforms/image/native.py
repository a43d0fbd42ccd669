"""The image kernels' C library (``libimage.so``: ``native/resample.c`` and ``native/normalize.c``), loaded once.

The wheel compiles it (``.build/hatch_build.py``); :func:`library` loads it on first use with ctypes
(``CDLL``: the GIL is released during each call, so threads resize and normalize in parallel),
types its functions and checks its ABI. Each caller (:mod:`~quern.transforms.image.resampling`,
:mod:`~quern.transforms.image.normalizing`) then checks the results of its own function against its
NumPy path before using it, and falls back to NumPy (the same values, slower) where the library is
missing, stale or wrong, or ``QUERN_NATIVE=0`` is in the environment.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from ...pipeline.core import libraries

__all__ = ["LIBRARY", "library"]

LIBRARY = Path(__file__).resolve().parents[2] / "pipeline" / "native" / "libimage.so"
"""Where the wheel puts the compiled image kernels."""

_ABI = 1  # quern_image_abi() of the library this module was written for


def _typed(lib: Any) -> str:
    """Type the library's functions; why its ABI is not this module's (``""``: it is)."""
    lib.quern_image_abi.restype = ctypes.c_int
    f, i, ptr, size = ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    lib.quern_resize_bilinear_u8.argtypes = [ptr, i, i, i, ctypes.c_ssize_t, f, f, f, f, ptr, i, i]
    lib.quern_resize_bilinear_u8.restype = i
    lib.quern_normalize_u8_f32.argtypes = [ptr, size, i, ptr, ptr, ptr]
    lib.quern_normalize_u8_f32.restype = i
    abi = lib.quern_image_abi()
    return "" if abi == _ABI else f"has ABI {abi}, not {_ABI}"


@functools.cache
def library() -> tuple[Any, str]:
    """The library with its functions typed, or ``None`` and why it is not used (:func:`quern.pipeline.core.libraries.load`)."""
    return libraries.load(LIBRARY, _typed)
