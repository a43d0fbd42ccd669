"""``quern prepare`` of image folders: each file a record, with ``label``, ``width`` and ``height`` metadata.

An ImageNet-style tree (``CLASS/xxx.jpg`` under the input folder) becomes shards
whose records are the images' bytes and whose metadata index holds each image's
``width`` and ``height`` and, with ``labels_from_dirs``, its ``label``: the index of
its class folder among the class folders sorted by name (the list is in the
manifest). With ``max_side``, an image whose longer side is larger is shrunk to it
once, here (Pillow's Lanczos filter, the aspect kept; JPEG at quality
:data:`QUALITY` for 1- and 3-channel images, PNG otherwise), so training never
decodes pixels it throws away. A record depends only on the file's bytes, its
path and these options.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

__all__ = ["QUALITY", "ImageRecords", "class_of", "image_records"]

QUALITY = 95
"""The JPEG quality of an image shrunk to ``max_side``."""


def class_of(name: str) -> str | None:
    """The class folder of an input file named ``BASE/CLASS/.../FILE`` (``None``: the file is at the top).

    Example:
        >>> class_of("train/cat/001.jpg"), class_of("train/001.jpg")
        ('cat', None)
    """
    parts = name.split("/")
    return parts[1] if len(parts) >= 3 else None


@dataclasses.dataclass(frozen=True)
class ImageRecords:
    """What ``prepare`` stores of an image file: its (possibly shrunk) bytes and its metadata.

    Attributes:
        classes: the class folders in label order (``None``: no labels).
        max_side: the longest side kept (``None``: images are stored as they are).
    """

    classes: tuple[str, ...] | None
    max_side: int | None

    def fields(self) -> tuple[str, ...]:
        """The metadata fields it makes."""
        return (("label",) if self.classes is not None else ()) + ("width", "height")

    def describe(self) -> dict[str, Any]:
        """The manifest's (and the job's) record of these options."""
        out: dict[str, Any] = {"labels_from_dirs": self.classes is not None, "max_side": self.max_side}
        if self.classes is not None:
            out["classes"] = list(self.classes)
        if self.max_side is not None:
            out["shrunk"] = f"Pillow Lanczos, aspect kept; JPEG quality {QUALITY} (1 or 3 channels), else PNG"
        return out

    def __call__(self, data: bytes, name: str) -> dict[str, Any]:
        """``{"record": bytes, "width", "height"[, "label"]}`` of the file ``name``.

        Raises:
            ValueError: not a JPEG or PNG, or a file outside the class folders.
        """
        from ..transforms.image import image_size

        height, width, _ = image_size(data)
        out = bytes(data)
        if self.max_side is not None and max(height, width) > self.max_side:
            out, height, width = _shrink(out, self.max_side)
        rec: dict[str, Any] = {"record": out, "width": width, "height": height}
        if self.classes is not None:
            cls = class_of(name)
            if cls is None or cls not in self.classes:
                raise ValueError(f"{name} is not in a class folder (labels come from the folders: CLASS/FILE)")
            rec["label"] = self.classes.index(cls)
        return rec


def _shrink(data: bytes, max_side: int) -> tuple[bytes, int, int]:
    """The image's bytes with its longer side ``max_side``: ``(bytes, height, width)``."""
    from PIL import Image

    from ..transforms.image import decode_image, image_size

    _, _, kind = image_size(data)
    pixels = decode_image(data, mode=None)
    if kind == "JPEG" and pixels.shape[2] == 4:  # a CMYK JPEG (no alpha): shrunk as the RGB Pillow converts it to
        pixels = decode_image(data, mode="RGB")
    if pixels.dtype != "uint8":
        pixels = (pixels >> 8).astype("uint8")
    h, w, c = pixels.shape
    scale = max_side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    img = Image.fromarray(pixels[:, :, 0] if c == 1 else pixels).resize(size, Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    if c in (1, 3):
        img.save(buf, "JPEG", quality=QUALITY)
    else:
        img.save(buf, "PNG")
    return buf.getvalue(), size[1], size[0]


def image_records(names: Sequence[str], labels_from_dirs: bool, max_side: int | None) -> ImageRecords:
    """The :class:`ImageRecords` of a prepare of the input files ``names`` (``BASE/REL`` each).

    Raises:
        ValueError: ``max_side`` not positive, or labels asked of files none of which is in a class folder.
    """
    if max_side is not None and (isinstance(max_side, bool) or not isinstance(max_side, int) or max_side < 1):
        raise ValueError(f"prepare: max_side must be a positive int, got {max_side!r}")
    classes = None
    if labels_from_dirs:
        classes = tuple(sorted({c for c in map(class_of, names) if c is not None}))
        if not classes:
            raise ValueError(
                "prepare: labels_from_dirs needs class folders (INPUT/CLASS/FILE); the files are at the top"
            )
    return ImageRecords(classes, max_side)
