"""Bilinear resizing of ``uint8`` images: Pillow's filter and arithmetic, one pass order, the same pixels everywhere.

:func:`resize_u8` resizes an image (or a box of it) with the weights and fixed-point arithmetic of
Pillow's ``Image.resize(..., BILINEAR)``: a triangle filter widened by the scale when it shrinks
(antialiased, as torchvision's ``antialias=True``), its weights normalised in double precision and
rounded to 22-bit integers, each pass rounded to 8 bits. Unlike Pillow, whose pass order depends
on its version and the sizes (Pillow 13 runs the vertical pass first only when the height shrinks
much more than the width), the vertical pass always comes first here, so the pixels depend only on
the arguments: the same on every machine, Pillow version and worker. They are within 1 level of
Pillow's own (the rounding between the passes), and equal to it where one pass is left out.

The work is a C library built with the wheel (``native/resample.c`` in ``libimage.so``,
:mod:`~quern.transforms.image.native`: the vertical pass along whole
rows, vectorised, with an AVX2 clone on x86-64; the GIL released during the call, so threads
resize in parallel), 1.3-3.9x faster than Pillow here (``benchmarks/resize.py``), or, without it,
the same arithmetic in NumPy (7-12x slower than the C loop, the same pixels;
``benchmarks/resize.py``). The library is used only when it loads,
reports the expected ABI and resizes a few test images exactly as the NumPy path does; otherwise
(no C compiler at install, ``QUERN_NATIVE=0`` in the environment) the NumPy path is used and
:func:`native_why` says why.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ...pipeline.core.libraries import checked
from . import native

__all__ = ["is_native", "native_why", "resize_u8"]

_BITS = 22  # Pillow's PRECISION_BITS for 8-bit images


def _coeffs(in_size: int, in0: float, in1: float, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's ``precompute_coeffs`` (bilinear) and ``normalize_coeffs_8bpc`` of one axis.

    Per output pixel: its first input pixel and tap count (``bounds``, ``(out_size, 2)``) and its
    fixed-point weights (``(out_size, ksize)``, zero past its tap count).
    ``in0`` and ``in1`` are taken as 32-bit floats, as Pillow takes the box; every other step is in double
    precision with Pillow's operations in Pillow's order (the weights' total summed tap by tap, as its loop
    does), so the weights are its weights.
    """
    lo, hi = np.float32(in0), np.float32(in1)
    scale = float(np.float32(hi - lo)) / out_size
    filterscale = max(scale, 1.0)
    support, inv = filterscale, 1.0 / filterscale
    ksize = math.ceil(support) * 2 + 1
    center = float(lo) + (np.arange(out_size) + 0.5) * scale
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # int(): toward zero, as C's cast
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    x = np.arange(ksize)
    weights = np.maximum(0.0, 1.0 - np.abs((x + xmin[:, None] - center[:, None] + 0.5) * inv))
    weights[x >= xmax[:, None]] = 0.0
    total = np.cumsum(weights, axis=1)[:, -1]  # sequential, as Pillow's loop (np.sum adds pairwise)
    np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0.0)
    kk = (0.5 + weights * (1 << _BITS)).astype(np.int64)  # bilinear weights are never negative
    return np.stack([xmin, xmax], axis=1), kk


def _pass(image: np.ndarray, bounds: np.ndarray, kk: np.ndarray) -> np.ndarray:
    """One pass along the first axis: each output row the rounded, clipped weighted sum of its input rows.

    Vectorised over the output rows, one tap at a time: ``kk`` must be zero past each row's tap count
    (as :func:`_coeffs` makes it; ``bounds[:, 1]`` is not read). The sums are exact integers: in 32
    bits where no sum can reach ``2**31`` (``255 x`` a row's weights, about ``2**30``), as Pillow's
    own, else in 64.
    """
    bound = 255 * int(np.abs(kk).sum(axis=1).max(initial=0)) + (1 << (_BITS - 1))
    wide = np.int32 if bound < 1 << 31 else np.int64
    acc = np.full((len(bounds), *image.shape[1:]), 1 << (_BITS - 1), wide)
    if len(image):
        taps = np.minimum(bounds[:, :1] + np.arange(kk.shape[1]), len(image) - 1)
        weights = kk.astype(wide).reshape(*kk.shape, *(1,) * (image.ndim - 1))
        term = np.empty_like(acc)
        for t in range(kk.shape[1]):
            np.multiply(image[taps[:, t]], weights[:, t], out=term)
            acc += term
    acc >>= _BITS
    out = np.empty(acc.shape, np.uint8)
    np.clip(acc, 0, 255, out=out, casting="unsafe")
    return out


def _needs(size: int, out: int, lo: float, hi: float) -> bool:
    """Whether an axis needs its pass: Pillow leaves it out when the size and the box's span keep it."""
    return out != size or np.float32(lo) != 0 or np.float32(hi) != out


def _numpy_resize(image: np.ndarray, size: tuple[int, int], box: tuple[float, float, float, float]) -> np.ndarray:
    """:func:`resize_u8` in NumPy: the vertical pass, then the horizontal pass over the transposed image."""
    h, w = image.shape[:2]
    x0, y0, x1, y1 = box
    out = image
    if _needs(h, size[0], y0, y1):
        out = _pass(out, *_coeffs(h, y0, y1, size[0]))
    if _needs(w, size[1], x0, x1):
        out = _pass(out.transpose(1, 0, 2), *_coeffs(w, x0, x1, size[1])).transpose(1, 0, 2)
    return np.array(out, order="C")  # a copy where no pass ran, as the C path's


def _check(image: np.ndarray, size: tuple[int, int], box: tuple[float, float, float, float]) -> None:
    """Refuse what neither path can resize, as Pillow's ``resize`` refuses it."""
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"resize_u8: a uint8 image of height x width x channels, got {image.dtype} {image.shape}")
    if len(size) != 2 or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in size):
        raise ValueError(f"resize_u8: size must be two ints of at least 1, got {size!r}")
    x0, y0, x1, y1 = (np.float32(v) for v in box)
    if x0 < 0 or y0 < 0:
        raise ValueError(f"resize_u8: box {box} starts outside the image (negative offset)")
    if x1 > image.shape[1] or y1 > image.shape[0]:
        raise ValueError(f"resize_u8: box {box} ends outside the {image.shape[1]}x{image.shape[0]} image")
    if x1 < x0 or y1 < y0:
        raise ValueError(f"resize_u8: box {box} has a negative width or height")


def _native_resize(lib: Any, image: np.ndarray, size: tuple[int, int], box: tuple[float, ...]) -> np.ndarray:
    h, w, c = image.shape
    out = np.empty((size[0], size[1], c), np.uint8)
    x0, y0, x1, y1 = box
    if lib.quern_resize_bilinear_u8(
        image.ctypes.data, h, w, c, image.strides[0], x0, y0, x1, y1, out.ctypes.data, size[0], size[1]
    ):
        raise MemoryError(f"resizing a {w}x{h} image to {size[1]}x{size[0]}: out of memory")
    return out


def _self_test(lib: Any) -> str:
    """Why the library's pixels differ from the NumPy path's on a few images (``""``: they agree)."""
    rng = np.random.default_rng(0)
    cases = [
        ((37, 53, 3), (11, 29), (0.0, 0.0, 53.0, 37.0)),  # shrinks
        ((20, 9, 1), (47, 31), (1.5, 2.25, 8.0, 19.5)),  # grows, a fractional box
        ((64, 40, 4), (64, 17), (0.0, 0.0, 40.0, 64.0)),  # the horizontal pass alone
        ((30, 30, 2), (8, 30), (0.0, 3.0, 30.0, 27.0)),  # the vertical pass alone
    ]
    for shape, size, box in cases:
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        if not np.array_equal(_native_resize(lib, image, size, box), _numpy_resize(image, size, box)):
            return f"{native.LIBRARY} resizes {shape} to {size} unlike the NumPy path (a bad build)"
    return ""


@functools.cache
def _library() -> tuple[Any, str]:
    """The checked library (loaded on the first call), or ``None`` and why it is not used."""
    return checked(native.library(), _self_test)


def is_native() -> bool:
    """Whether the C resize is used (:func:`native_why` says why not)."""
    return _library()[0] is not None


def native_why() -> str:
    """Why the C resize is not used (``""`` when it is)."""
    return _library()[1]


def resize_u8(
    image: np.ndarray, size: tuple[int, int], box: tuple[float, float, float, float] | None = None
) -> np.ndarray:
    """``image``, or its ``box``, resized to ``size`` with Pillow's bilinear filter (see the module docstring).

    Args:
        image: ``uint8``, height x width x channels (any number of channels, each resized alone).
        size: ``(height, width)`` of the output, each at least 1.
        box: ``(left, top, right, bottom)`` in pixels (floats allowed) of the region resized, as
            Pillow's ``box``; the whole image by default.

    Returns:
        A new C-contiguous ``uint8`` array of ``size`` and the image's channels; it depends only on the
        arguments (the same with or without the C library).

    Raises:
        ValueError: not a ``uint8`` image of 3 dimensions, a size under 1, or a box outside the image
            or of negative width or height (Pillow's checks, on the box as 32-bit floats).
    """
    h, w = image.shape[:2]
    box = (0.0, 0.0, float(w), float(h)) if box is None else tuple(float(v) for v in box)  # type: ignore[assignment]
    _check(image, size, box)  # type: ignore[arg-type]
    if image.strides[1:] != (image.shape[2], 1):  # each row's pixels packed, as the C loop reads them
        image = np.ascontiguousarray(image)
    lib = _library()[0]
    return _numpy_resize(image, size, box) if lib is None else _native_resize(lib, image, size, box)  # type: ignore[arg-type]
