"""``(image - mean) / std`` per channel of a ``uint8`` image or batch, as float32, in one pass.

:func:`normalize_u8_f32` gives exactly NumPy's ``image.astype(float32)``, minus the channels'
float32 means, divided by their float32 stds (each step rounded to float32), which costs three passes
over a float32 array four times the image's size (about 16 ms for a batch of 32 images of 224x224x3
here). The C library (``native/normalize.c`` in ``libimage.so``, :mod:`~quern.transforms.image.native`)
does the same steps in one pass with the GIL released; without it (or where it does not give NumPy's
values on a test image), NumPy does them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...pipeline.core.libraries import checked
from . import native

__all__ = ["normalize_u8_f32"]

_MAX_CHANNELS = 16  # what the C loop takes (its period is 8 pixels of every channel)


def _numpy(image: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    out = image.astype(np.float32)
    out -= mean
    out /= std
    return out


def _native(lib: Any, image: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    out = np.empty(image.shape, np.float32)
    c = image.shape[-1]
    if lib.quern_normalize_u8_f32(image.ctypes.data, image.size, c, mean.ctypes.data, std.ctypes.data, out.ctypes.data):
        raise ValueError(f"normalize: {c} channels, over the C loop's {_MAX_CHANNELS}")  # checked before the call
    return out


def _self_test(lib: Any) -> str:
    """Why the C loop's values differ from NumPy's on a test image of each channel count tried (``""``: they do not)."""
    rng = np.random.default_rng(0)
    for c in (1, 3, 4):
        image = rng.integers(0, 256, (3, 7, 5, c), dtype=np.uint8)
        mean = rng.uniform(0, 255, c).astype(np.float32)
        std = rng.uniform(0.5, 80, c).astype(np.float32)
        if not np.array_equal(_native(lib, image, mean, std), _numpy(image, mean, std)):
            return f"{native.LIBRARY} normalizes {c} channels unlike NumPy (a bad build)"
    return ""


@functools.cache
def _library() -> tuple[Any, str]:
    """The C loop's library, checked against NumPy on first use, or ``None`` and why it is not used."""
    return checked(native.library(), _self_test)


def normalize_u8_f32(image: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(image - mean) / std`` over the last axis (the channels), as float32: NumPy's values exactly.

    Args:
        image: ``uint8``, channels last (an image or a batch of them).
        mean: float32, one value per channel or one for all.
        std: float32, likewise.

    Returns:
        A new float32 array of ``image``'s shape.
    """
    c = image.shape[-1] if image.ndim else 1
    lib = _library()[0]
    plain = image.ndim >= 1 and mean.ndim <= 1 and std.ndim <= 1 and mean.dtype == std.dtype == np.float32
    if lib is None or not plain or not 1 <= c <= _MAX_CHANNELS:  # NumPy broadcasts the rest
        return _numpy(image, mean, std)
    return _native(
        lib,
        np.ascontiguousarray(image),
        np.ascontiguousarray(np.broadcast_to(mean, (c,))),
        np.ascontiguousarray(np.broadcast_to(std, (c,))),
    )
