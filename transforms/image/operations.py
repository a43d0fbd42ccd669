"""The image transforms: registered, fingerprinted record stages over :mod:`.decoding` and :mod:`.geometry`.

Each is a frozen dataclass (its fields are the factory's arguments, written as a
config's ``kwargs``) with a ``VERSION`` in the fingerprint. ``key=None`` takes the
record itself; ``key="image"`` takes a dict record's field and gives a new dict with
that field replaced. The random ones are called ``t(record, rng)`` by
:meth:`~quern.Pipeline.random_map`, whose ``rng`` is keyed by (seed, stream
position, stage): their draws never depend on the worker count, host count or a
resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ...pipeline.core.registry import register
from . import geometry
from .decoding import MAX_PIXELS, MODES, decode_image, decode_scaled, image_size
from .normalizing import normalize_u8_f32

__all__ = ["DecodeImage", "Resize", "CenterCrop", "RandomResizedCrop", "RandomFlip", "Normalize"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OnImage:
    """What the image stages share: the record's image (``key``) in and out."""

    key: str | None = None

    def _get(self, record: Any) -> Any:
        if self.key is None:
            return record
        if not isinstance(record, Mapping):
            raise TypeError(f"{self._name()}(key={self.key!r}) needs dict records, got {type(record).__name__}")
        if self.key not in record:
            raise KeyError(f"{self._name()}: the record has no key {self.key!r} (its keys: {sorted(map(str, record))})")
        return record[self.key]

    def _put(self, record: Any, value: Any) -> Any:
        return value if self.key is None else {**record, self.key: value}

    def _name(self) -> str:
        return type(self).NAME  # type: ignore[attr-defined]

    def _pixels(self, record: Any) -> tuple[np.ndarray, bool]:
        """The record's image as height x width x channels, and whether it came without the channel axis.

        Raises:
            TypeError: not an array of 2 or 3 axes (bytes: decode them first).
        """
        image = self._get(record)
        if not isinstance(image, np.ndarray) or image.ndim not in (2, 3):
            what = f"an array of shape {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise TypeError(
                f"{self._name()} takes an image array (height x width [x channels]), got {what}; "
                "decode the bytes first (quern.transforms.image.decode())"
            )
        if not image.shape[0] or not image.shape[1]:
            raise ValueError(f"{self._name()}: the image is {image.shape[1]}x{image.shape[0]}, without a pixel")
        return (image[:, :, None], True) if image.ndim == 2 else (image, False)

    def _done(self, record: Any, image: np.ndarray, flat: bool) -> Any:
        return self._put(record, image[:, :, 0] if flat else image)

    @staticmethod
    def _need_rng(rng: np.random.Generator | None, name: str) -> np.random.Generator:
        if rng is None:
            raise TypeError(f"{name} is random: apply it with pipe.random_map(t), which passes its rng, not map(t)")
        return rng


def _size_field(obj: Any, name: str) -> None:
    """Store the ``size`` field as an int or a ``(height, width)`` tuple (checked), so configs round-trip."""
    size = obj.size
    geometry.check_size(size, name)
    object.__setattr__(obj, "size", int(size) if isinstance(size, (int, np.integer)) else tuple(int(v) for v in size))


@register("image.decode")
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeImage(_OnImage):
    """The transform :func:`~quern.transforms.image.decode` makes (its fields are the factory's arguments)."""

    NAME: ClassVar[str] = "image.decode"
    VERSION: ClassVar[int] = 1  # in the fingerprint: bump it when what it computes changes

    mode: str | None = "RGB"
    max_pixels: int = MAX_PIXELS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"image.decode: mode must be one of {MODES}, got {self.mode!r}")
        if (
            isinstance(self.max_pixels, bool)
            or not isinstance(self.max_pixels, (int, np.integer))
            or self.max_pixels < 1
        ):
            raise ValueError(f"image.decode: max_pixels must be a positive int, got {self.max_pixels!r}")
        object.__setattr__(self, "max_pixels", int(self.max_pixels))

    def __call__(self, record: Any) -> Any:
        """The record with its image decoded (see :func:`~quern.transforms.image.decoding.decode_image`)."""
        return self._put(record, decode_image(self._get(record), self.mode, self.max_pixels))


@register("image.resize")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Resize(_OnImage):
    """The transform :func:`~quern.transforms.image.resize` makes."""

    NAME: ClassVar[str] = "image.resize"
    VERSION: ClassVar[int] = 2  # 2: uint8 pixels by resampling.resize_u8 (within 1 level of version 1)

    size: int | tuple[int, int]

    def __post_init__(self) -> None:
        _size_field(self, self.NAME)

    def __call__(self, record: Any) -> Any:
        """The record with its image resized."""
        image, flat = self._pixels(record)
        h, w = image.shape[:2]
        size = geometry.shorter_side_size(h, w, self.size) if isinstance(self.size, int) else self.size
        return self._done(record, geometry.resize(image, size), flat)


@register("image.center_crop")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CenterCrop(_OnImage):
    """The transform :func:`~quern.transforms.image.center_crop` makes."""

    NAME: ClassVar[str] = "image.center_crop"
    VERSION: ClassVar[int] = 1

    size: int | tuple[int, int]

    def __post_init__(self) -> None:
        _size_field(self, self.NAME)

    def __call__(self, record: Any) -> Any:
        """The record with its image's centre cut out (a copy)."""
        image, flat = self._pixels(record)
        top, left, h, w = geometry.center_box(image.shape[0], image.shape[1], geometry.check_size(self.size, ""))
        return self._done(record, image[top : top + h, left : left + w].copy(), flat)


@register("image.random_resized_crop")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomResizedCrop(_OnImage):
    """The transform :func:`~quern.transforms.image.random_resized_crop` makes (a ``random_map`` stage)."""

    NAME: ClassVar[str] = "image.random_resized_crop"
    VERSION: ClassVar[int] = 2  # 2: uint8 pixels by resampling.resize_u8

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        _size_field(self, self.NAME)
        for name in ("scale", "ratio"):
            pair = tuple(float(v) for v in getattr(self, name))
            if len(pair) != 2 or not 0 < pair[0] <= pair[1] or (name == "scale" and pair[1] > 1):
                bound = "0 < low <= high <= 1" if name == "scale" else "0 < low <= high"
                raise ValueError(
                    f"{self.NAME}: {name} must be a (low, high) pair with {bound}, got {getattr(self, name)!r}"
                )
            object.__setattr__(self, name, pair)

    def __call__(self, record: Any, rng: np.random.Generator | None = None) -> Any:
        """The record with a random box of its image resized to ``size``.

        Given the encoded bytes instead of an array, it decodes them (RGB) and crops in one:
        the box is drawn from the file's size, as it would be from the decoded image's, and
        a JPEG is decoded at the smallest DCT scale that keeps the box at least ``size``
        (:func:`~quern.transforms.image.decoding.decode_scaled`); the same box, its pixels
        within a few levels of decoding first.
        """
        rng = self._need_rng(rng, self.NAME)
        size = geometry.check_size(self.size, "")
        value = self._get(record)
        if isinstance(value, (bytes, bytearray, memoryview)) or (
            isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.uint8
        ):
            height, width, _ = image_size(value)
            top, left, h, w = geometry.resized_crop_box(rng, height, width, self.scale, self.ratio)
            need = (-(-size[0] * height // int(h)), -(-size[1] * width // int(w)))  # the box keeps >= size pixels
            image = decode_scaled(value, need)
            sy, sx = image.shape[0] / height, image.shape[1] / width
            return self._put(record, geometry.resize(image, size, (top * sy, left * sx, h * sy, w * sx)))
        image, flat = self._pixels(record)
        box = geometry.resized_crop_box(rng, image.shape[0], image.shape[1], self.scale, self.ratio)
        return self._done(record, geometry.resize(image, size, box), flat)


@register("image.random_flip")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomFlip(_OnImage):
    """The transform :func:`~quern.transforms.image.random_flip` makes (a ``random_map`` stage)."""

    NAME: ClassVar[str] = "image.random_flip"
    VERSION: ClassVar[int] = 1

    p: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float, np.number)) or not 0 <= self.p <= 1:
            raise ValueError(f"{self.NAME}: p must be a probability in [0, 1], got {self.p!r}")
        object.__setattr__(self, "p", float(self.p))

    def __call__(self, record: Any, rng: np.random.Generator | None = None) -> Any:
        """The record with its image mirrored left to right with probability ``p`` (one draw either way)."""
        rng = self._need_rng(rng, self.NAME)
        image, flat = self._pixels(record)
        flip = rng.random() < self.p
        return self._done(record, image[:, ::-1] if flip else image, flat)


@register("image.normalize")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Normalize(_OnImage):
    """The transform :func:`~quern.transforms.image.normalize` makes."""

    NAME: ClassVar[str] = "image.normalize"
    VERSION: ClassVar[int] = 1

    mean: tuple[float, ...]
    std: tuple[float, ...]
    dtype: Any = np.float32

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            value = getattr(self, name)
            values = (value,) if isinstance(value, (int, float, np.number)) else tuple(value)
            if not values or not all(isinstance(v, (int, float, np.number)) and np.isfinite(v) for v in values):
                raise ValueError(f"{self.NAME}: {name} must be finite numbers, one or one per channel, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if min(self.std) <= 0:
            raise ValueError(f"{self.NAME}: std must be positive, got {self.std!r}")
        dtype = np.dtype(self.dtype)
        if dtype.kind != "f":
            raise ValueError(f"{self.NAME}: dtype must be a floating dtype, got {dtype}")
        object.__setattr__(self, "dtype", dtype.str)

    def __call__(self, record: Any) -> Any:
        """The record with its image as ``(image - mean) / std`` per channel, in ``dtype``.

        A batch of images (rows x height x width x channels, from ``map_batch``) is normalized
        at once, as each of its rows would be.
        """
        batch = self._get(record)
        if isinstance(batch, np.ndarray) and batch.ndim == 4:
            return self._put(record, self._normalized(batch))
        image, flat = self._pixels(record)
        return self._done(record, self._normalized(image), flat)

    def _normalized(self, image: np.ndarray) -> np.ndarray:
        channels = image.shape[-1]
        for name in ("mean", "std"):
            if len(getattr(self, name)) not in (1, channels):
                raise ValueError(
                    f"{self.NAME}: {len(getattr(self, name))} {name} values for an image of {channels} channels"
                )
        dtype = np.dtype(self.dtype)
        mean, std = np.asarray(self.mean, dtype), np.asarray(self.std, dtype)
        if image.dtype == np.uint8 and dtype == np.float32:
            return normalize_u8_f32(image, mean, std)  # the same values, in one pass
        out = image.astype(dtype)
        out -= mean
        out /= std
        return out
