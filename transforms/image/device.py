"""Image augmentation on the accelerator: batch stages for :meth:`~quern.Pipeline.random_map_device`.

The host decodes and resizes to one size (so the batch is one array), the devices
crop, flip and normalize under ``jax.jit``, each row from its own typed key
(derived from seed, stream position and stage): the same pixels for any host
count, batch size or resume. The crop follows torchvision's ``RandomResizedCrop``
draw, made with ``jax.random`` (all ten tries at once, the first that fits taken),
and resamples with ``jax.image.scale_and_translate`` (linear, antialiased), so its
pixels are not those of the host stage :func:`~quern.transforms.image.random_resized_crop`
(another draw and another filter), but each is reproducible.

Example:
    >>> import numpy as np, quern
    >>> from quern.transforms.image import device
    >>> images = {"image": np.zeros((8, 40, 48, 3), np.uint8)}
    >>> pipe = (
    ...     quern.Pipeline.from_source(images, seed=0).batch(4)
    ...     .random_map_device(device.random_resized_crop(24, key="image"))
    ...     .random_map_device(device.random_flip(key="image"))
    ... )
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from ...pipeline.core.registry import register
from . import geometry

__all__ = [
    "RandomResizedCropDevice",
    "RandomFlipDevice",
    "crop_boxes",
    "random_resized_crop",
    "random_flip",
    "resized_crops",
]


def crop_boxes(keys: Any, height: int, width: int, scale: Sequence[float], ratio: Sequence[float]) -> Any:
    """``(rows, 4)`` float boxes ``(top, left, height, width)``, one per key: torchvision's draw in ``jax.random``.

    Ten candidate (area fraction uniform in ``scale``, aspect log-uniform in ``ratio``)
    pairs per row; the first whose box fits is placed uniformly; if none does, the
    largest centred box of the clamped aspect. Depends only on the keys, the size and the bounds.
    """
    import jax
    import jax.numpy as jnp

    def one(key: Any) -> Any:
        k_area, k_ratio, k_top, k_left = jax.random.split(key, 4)
        area = height * width * jax.random.uniform(k_area, (10,), minval=scale[0], maxval=scale[1])
        aspect = jnp.exp(jax.random.uniform(k_ratio, (10,), minval=math.log(ratio[0]), maxval=math.log(ratio[1])))
        w = jnp.round(jnp.sqrt(area * aspect))
        h = jnp.round(jnp.sqrt(area / aspect))
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = jnp.argmax(fits)
        in_ratio = width / height
        if in_ratio < min(ratio):
            fw, fh = float(width), float(max(1, round(width / min(ratio))))
        elif in_ratio > max(ratio):
            fw, fh = float(max(1, round(height * max(ratio)))), float(height)
        else:
            fw, fh = float(width), float(height)
        h_ = jnp.where(fits[first], h[first], fh)
        w_ = jnp.where(fits[first], w[first], fw)
        top = jnp.where(fits[first], jnp.floor(jax.random.uniform(k_top) * (height - h_ + 1)), (height - fh) // 2)
        left = jnp.where(fits[first], jnp.floor(jax.random.uniform(k_left) * (width - w_ + 1)), (width - fw) // 2)
        return jnp.stack([top, left, h_, w_])

    return jax.vmap(one)(keys)


def resized_crops(images: Any, boxes: Any, size: tuple[int, int]) -> Any:
    """Each image's box resized to ``size`` ``(height, width)``: linear and antialiased, as ``float32``.

    ``images`` is ``(rows, height, width, channels)``; ``boxes`` :func:`crop_boxes`'s.
    """
    import jax
    import jax.numpy as jnp

    out_h, out_w = size

    def one(image: Any, box: Any) -> Any:
        top, left, h, w = box[0], box[1], box[2], box[3]
        sy, sx = out_h / h, out_w / w
        return jax.image.scale_and_translate(
            image.astype(jnp.float32),
            (out_h, out_w, image.shape[2]),
            spatial_dims=(0, 1),
            scale=jnp.stack([sy, sx]),
            translation=jnp.stack([-top * sy, -left * sx]),
            method="linear",
            antialias=True,
        )

    return jax.vmap(one)(images, boxes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OnBatch:
    key: str | None = None

    def _get(self, batch: Any) -> Any:
        return batch if self.key is None else batch[self.key]

    def _put(self, batch: Any, value: Any) -> Any:
        return value if self.key is None else {**batch, self.key: value}


@register("image.device_random_resized_crop")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomResizedCropDevice(_OnBatch):
    """The device stage :func:`random_resized_crop` makes (for ``random_map_device``)."""

    VERSION: ClassVar[int] = 1

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        size = geometry.check_size(self.size, "image.device_random_resized_crop")
        object.__setattr__(self, "size", size[0] if size[0] == size[1] and isinstance(self.size, int) else size)
        for name in ("scale", "ratio"):
            pair = tuple(float(v) for v in getattr(self, name))
            if len(pair) != 2 or not 0 < pair[0] <= pair[1] or (name == "scale" and pair[1] > 1):
                raise ValueError(f"image.device_random_resized_crop: {name} must be a (low, high) pair, got {pair!r}")
            object.__setattr__(self, name, pair)

    def __call__(self, batch: Any, keys: Any) -> Any:
        """The batch with each image's random box resized to ``size`` (``float32``)."""
        images = self._get(batch)
        boxes = crop_boxes(keys, images.shape[1], images.shape[2], self.scale, self.ratio)
        return self._put(batch, resized_crops(images, boxes, geometry.check_size(self.size, "")))


@register("image.device_random_flip")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomFlipDevice(_OnBatch):
    """The device stage :func:`random_flip` makes (for ``random_map_device``)."""

    VERSION: ClassVar[int] = 1

    p: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float, np.number)) or not 0 <= self.p <= 1:
            raise ValueError(f"image.device_random_flip: p must be a probability in [0, 1], got {self.p!r}")
        object.__setattr__(self, "p", float(self.p))

    def __call__(self, batch: Any, keys: Any) -> Any:
        """The batch with each image mirrored left to right with probability ``p``."""
        import jax
        import jax.numpy as jnp

        images = self._get(batch)
        flip = jax.vmap(lambda key: jax.random.uniform(key) < self.p)(keys)
        mirrored = jnp.where(flip[:, None, None, None], images[:, :, ::-1], images)
        return self._put(batch, mirrored)


def random_resized_crop(
    size: int | Sequence[int],
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    *,
    key: str | None = None,
) -> RandomResizedCropDevice:
    """A ``random_map_device`` stage: each image's random box (torchvision's draw) resized to ``size``.

    The images of a batch share one size (resize or center-crop them on the host first);
    the output is ``float32`` (normalize on the device after it, or cast).

    Raises:
        ValueError: ``size``, ``scale`` or ``ratio`` out of range.
    """
    size_ = size if isinstance(size, (int, np.integer)) else tuple(size)
    return RandomResizedCropDevice(size=size_, scale=tuple(scale), ratio=tuple(ratio), key=key)  # type: ignore[arg-type]


def random_flip(p: float = 0.5, *, key: str | None = None) -> RandomFlipDevice:
    """A ``random_map_device`` stage: each image mirrored left to right with probability ``p``.

    Raises:
        ValueError: ``p`` outside ``[0, 1]``.
    """
    return RandomFlipDevice(p=p, key=key)
