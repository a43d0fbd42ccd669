"""Image transforms: decode JPEG and PNG bytes, resize, crop, flip and normalize, record by record.

Used as the other record transforms are: ``pipe.map(t)`` for :func:`decode`,
:func:`resize`, :func:`center_crop` and :func:`normalize`, and
``pipe.random_map(t)`` for the random :func:`random_resized_crop` and
:func:`random_flip`, whose draws come from the ``rng`` that ``random_map`` keys by
(seed, stream position, stage): the same crop for any worker count, host count or
resume. Images are ``numpy`` arrays of height x width x channels. :mod:`.device` has
the random crop and flip as device stages (``pipe.random_map_device``), for when the
host's CPUs are the limit. A bad image
(corrupt, truncated, empty, too large, a crop larger than the image) raises, so the
pipeline's :class:`~quern.StepError` names the record; it never becomes a black frame.

Example:
    >>> import io, numpy as np, quern
    >>> from PIL import Image
    >>> from quern.transforms import image
    >>> def jpeg(w, h):
    ...     out = io.BytesIO()
    ...     Image.new("RGB", (w, h), (200, 30, 90)).save(out, "JPEG")
    ...     return out.getvalue()
    >>> pipe = (
    ...     quern.Pipeline.from_source([jpeg(64, 48), jpeg(40, 80)], seed=0)
    ...     .map(image.decode())
    ...     .random_map(image.random_resized_crop(32))
    ...     .random_map(image.random_flip())
    ...     .map(image.normalize(mean=127.5, std=127.5))
    ...     .batch(2)
    ... )
    >>> pipe.batch_at(0).shape, pipe.batch_at(0).dtype
    ((2, 32, 32, 3), dtype('float32'))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import device
from .decoding import MAX_PIXELS, decode_image, image_size
from .operations import CenterCrop, DecodeImage, Normalize, RandomFlip, RandomResizedCrop, Resize

__all__ = [
    "MAX_PIXELS",
    "CenterCrop",
    "DecodeImage",
    "Normalize",
    "RandomFlip",
    "RandomResizedCrop",
    "Resize",
    "center_crop",
    "decode",
    "decode_image",
    "device",
    "image_size",
    "normalize",
    "random_flip",
    "random_resized_crop",
    "resize",
]


def decode(mode: str | None = "RGB", *, key: str | None = None, max_pixels: int = MAX_PIXELS) -> DecodeImage:
    """A record transform: JPEG or PNG bytes -> a ``uint8`` array, height x width x channels.

    By default every image becomes RGB (grey replicated, alpha dropped, CMYK converted
    as Pillow converts it); ``mode="L"`` gives one channel of luma, ``mode=None`` the
    file's own channels (16-bit grey stays ``uint16``). JPEG is decoded by
    libjpeg-turbo (``simplejpeg``, accurate DCT and upsampling: Pillow's pixels), PNG
    and CMYK JPEG by Pillow; both release the GIL, so thread workers decode in
    parallel.

    Args:
        mode: ``"RGB"``, ``"L"`` or ``None``.
        key: the field of a dict record that holds the bytes (``None``: the record is the bytes).
        max_pixels: images of more pixels are refused before decoding (default: Pillow's limit,
            89,478,485): a tiny file that would decode to gigapixels is an error, not a crash.

    Returns:
        The transform, for ``pipe.map()``.

    Raises:
        ValueError: an unknown ``mode`` or a ``max_pixels`` below 1. At run time (a ``StepError`` naming
            the record): empty, corrupt or truncated data, zero pixels, too many pixels, not a JPEG or PNG.
    """
    return DecodeImage(mode=mode, key=key, max_pixels=max_pixels)


def resize(size: int | Sequence[int], *, key: str | None = None) -> Resize:
    """A record transform: the image resized, with Pillow's bilinear filter (antialiased when shrinking).

    ``uint8`` images: :func:`quern.transforms.image.resampling.resize_u8` (Pillow's arithmetic, the
    vertical pass first: the same pixels everywhere, within 1 level of Pillow's ``resize``).

    Args:
        size: an int, the shorter side's new length (the longer one scaled alike and
            truncated, as torchvision's ``Resize``); or ``(height, width)`` exactly.
        key: the field of a dict record holding the image.

    Raises:
        ValueError: ``size`` not positive, or not an int or a pair.
    """
    return Resize(size=_size(size), key=key)


def center_crop(size: int | Sequence[int], *, key: str | None = None) -> CenterCrop:
    """A record transform: the centre ``size`` (an int for a square, or ``(height, width)``) of the image.

    A crop larger than the image is an error naming the record (torchvision pads it instead).

    Raises:
        ValueError: ``size`` not positive, or not an int or a pair.
    """
    return CenterCrop(size=_size(size), key=key)


def random_resized_crop(
    size: int | Sequence[int],
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    *,
    key: str | None = None,
) -> RandomResizedCrop:
    """A ``random_map`` transform: a random box of the image resized to ``size``, torchvision's draw.

    The box covers a fraction of the image's area uniform in ``scale`` with an aspect
    (width / height) log-uniform in ``ratio`` (up to 10 tries; then the largest centred
    box of the clamped aspect), placed uniformly, resized with Pillow's bilinear filter.
    The draws come from ``random_map``'s rng, so a row's crop depends only on the seed,
    its stream position and the stage.

    Args:
        size: the output, an int for a square or ``(height, width)``.
        scale: the area fraction's bounds, ``0 < low <= high <= 1``.
        ratio: the aspect's bounds, ``0 < low <= high``.
        key: the field of a dict record holding the image.

    Raises:
        ValueError: ``size``, ``scale`` or ``ratio`` out of range.
    """
    return RandomResizedCrop(size=_size(size), scale=tuple(scale), ratio=tuple(ratio), key=key)  # type: ignore[arg-type]


def random_flip(p: float = 0.5, *, key: str | None = None) -> RandomFlip:
    """A ``random_map`` transform: the image mirrored left to right with probability ``p``.

    Raises:
        ValueError: ``p`` outside ``[0, 1]``.
    """
    return RandomFlip(p=p, key=key)


def normalize(
    mean: float | Sequence[float], std: float | Sequence[float], dtype: Any = np.float32, *, key: str | None = None
) -> Normalize:
    """A record transform: ``(image - mean) / std`` per channel, as ``dtype``.

    ``mean`` and ``std`` are in the input's units (0-255 for ``uint8`` images: ImageNet's
    are ``mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)``), one value or
    one per channel.

    Raises:
        ValueError: non-finite values, a ``std`` not positive, or a dtype that is not floating.
    """
    as_tuple = lambda v: (v,) if isinstance(v, (int, float, np.number)) else tuple(v)  # noqa: E731
    return Normalize(mean=as_tuple(mean), std=as_tuple(std), dtype=dtype, key=key)


def _size(size: int | Sequence[int]) -> Any:
    return size if isinstance(size, (int, np.integer)) else tuple(size)
