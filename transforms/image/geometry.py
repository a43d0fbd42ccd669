"""Pure functions on image arrays (height x width x channels): crop boxes and resizing.

Resizing is Pillow's bilinear filter, antialiased when it shrinks (the filter
widens with the scale, as torchvision's ``antialias=True``): for ``uint8`` images
:func:`quern.transforms.image.resampling.resize_u8` (Pillow's arithmetic with one
pass order, the same pixels on every machine), for others Pillow itself, channel by
channel; the crop boxes follow torchvision's
``RandomResizedCrop`` and ``CenterCrop``. Every output depends only on the
arguments (and, for :func:`resized_crop_box`, the numbers drawn from ``rng``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .resampling import resize_u8

__all__ = ["Box", "center_box", "resize", "resized_crop_box", "shorter_side_size", "check_size"]

Box = tuple[float, float, float, float]
"""``(top, left, height, width)`` of a region of an image (whole pixels, except for a box scaled to a
reduced decode)."""


def check_size(size: int | Sequence[int], name: str) -> tuple[int, int]:
    """``size`` (an int, or ``(height, width)``) as ``(height, width)`` of positive ints.

    Raises:
        ValueError: not positive, or not one or two ints (``name`` says which argument).
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer, Sequence, np.ndarray)):
        raise ValueError(f"{name}: size must be an int or a (height, width) pair of ints, got {size!r}")
    pair = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in pair):
        raise ValueError(f"{name}: size must be an int or a (height, width) pair of ints, got {size!r}")
    if min(pair) < 1:
        raise ValueError(f"{name}: size must be positive, got {size!r}")
    return int(pair[0]), int(pair[1])


def shorter_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """The ``(height, width)`` whose shorter side is ``size``, the longer scaled alike (truncated, as torchvision).

    Example:
        >>> shorter_side_size(400, 600, 200)
        (200, 300)
    """
    if height <= width:
        return size, max(1, int(size * width / height))
    return max(1, int(size * height / width)), size


def center_box(height: int, width: int, crop: tuple[int, int]) -> Box:
    """The centred box of ``crop`` ``(height, width)`` in an image of ``height`` x ``width`` (offsets rounded).

    Raises:
        ValueError: the crop is larger than the image.
    """
    h, w = crop
    if h > height or w > width:
        raise ValueError(f"the image is {width}x{height} (width x height), smaller than the crop of {w}x{h}")
    return int(round((height - h) / 2.0)), int(round((width - w) / 2.0)), h, w


def resized_crop_box(
    rng: np.random.Generator, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> Box:
    """A random box of area ``scale`` of the image's and aspect ``ratio`` (width / height): torchvision's draw.

    Up to 10 tries of an area fraction uniform in ``scale`` and a log-uniform aspect in
    ``ratio``, the first that fits placed uniformly; else the largest centred box whose
    aspect is ``ratio`` clamped. Depends only on the image size, the bounds and ``rng``'s numbers.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, max(1, int(round(width / min(ratio))))
    elif in_ratio > max(ratio):
        h, w = height, max(1, int(round(height * max(ratio))))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def resize(image: np.ndarray, size: tuple[int, int], box: Box | None = None) -> np.ndarray:
    """``image`` (or its ``box``) resized to ``size`` ``(height, width)`` with Pillow's bilinear filter.

    ``uint8`` images of any number of channels go through
    :func:`~quern.transforms.image.resampling.resize_u8` (each channel alone, so alpha is never
    premultiplied; within 1 level of Pillow's own resize); other dtypes through Pillow channel by
    channel, as 32-bit floats, rounded back for integers. The dtype and channels are kept.
    """
    out_h, out_w = size
    top, left, h, w = box if box is not None else (0, 0, image.shape[0], image.shape[1])
    pil_box = (left, top, left + w, top + h)
    if image.dtype == np.uint8:
        return resize_u8(image, (out_h, out_w), pil_box)
    from PIL import Image

    planes = []
    for c in range(image.shape[2]):
        plane = np.ascontiguousarray(image[:, :, c]).astype(np.float32)
        planes.append(np.asarray(Image.fromarray(plane).resize((out_w, out_h), Image.Resampling.BILINEAR, box=pil_box)))
    out = np.stack(planes, axis=2)
    if np.issubdtype(image.dtype, np.integer) and out.dtype != image.dtype:
        info = np.iinfo(image.dtype)
        out = np.clip(np.rint(out), info.min, info.max)
    return out.astype(image.dtype, copy=False)
