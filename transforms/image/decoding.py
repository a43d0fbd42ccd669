"""Decoding JPEG and PNG bytes into ``uint8`` arrays (height x width x channels).

JPEG goes through libjpeg-turbo by way of ``simplejpeg`` (with its accurate DCT and
upsampling, whose output equals Pillow's byte for byte on the files tested, and it
releases the GIL while it decodes); CMYK and YCCK JPEGs, which libjpeg-turbo cannot
turn into RGB, and PNG go through Pillow (which also releases the GIL while it
decodes). The decoder and its settings are chosen by measurement:
``docs/benchmarks/vision.md``. The output depends only on the bytes, ``mode`` and
``max_pixels``.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["MAX_PIXELS", "MODES", "decode_image", "decode_scaled", "image_size", "luma"]

MAX_PIXELS = 89_478_485
"""The pixels an image may have by default (Pillow's own limit): a larger one is refused, not decoded."""

MODES = ("RGB", "L", None)
"""``"RGB"``: 3 channels; ``"L"``: 1 channel of luma; ``None``: the file's own channels."""

_JPEG = b"\xff\xd8\xff"
_PNG = b"\x89PNG\r\n\x1a\n"


def _module(name: str) -> Any:
    """Import ``simplejpeg`` or ``PIL.Image``, or say how to install them.

    Raises:
        ImportError: not installed, naming the extra that installs it.
    """
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"quern.transforms.image needs {name.split('.')[0]}: pip install 'quern[image]'") from e


def _as_bytes(data: Any) -> bytes | bytearray | memoryview:
    """The encoded bytes of ``data`` (bytes, bytearray, memoryview or a 1-D ``uint8`` array).

    Raises:
        TypeError: anything else.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return np.ascontiguousarray(data).tobytes() if not data.flags.c_contiguous else memoryview(data.data)
    what = f"an array of {data.dtype} and shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
    raise TypeError(f"an image must be the encoded bytes of a JPEG or PNG file, got {what}")


def image_size(data: Any) -> tuple[int, int, str]:
    """``(height, width, format)`` of an encoded JPEG or PNG image, from its header alone.

    Raises:
        ValueError: empty, not a JPEG or PNG, or a header that cannot be read.
        TypeError: ``data`` is not bytes.
    """
    buf = _as_bytes(data)
    head = bytes(buf[:8])
    if not head:
        raise ValueError("the image is empty (0 bytes)")
    if head.startswith(_JPEG):
        simplejpeg = _module("simplejpeg")
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(buf)
        except ValueError as e:
            raise ValueError(f"a corrupt JPEG header: {e}") from e
        return int(height), int(width), "JPEG"
    if head == _PNG:
        if len(buf) < 24 or bytes(buf[12:16]) != b"IHDR":
            raise ValueError("a corrupt PNG: no IHDR chunk where the format puts it")
        return int.from_bytes(buf[20:24], "big"), int.from_bytes(buf[16:20], "big"), "PNG"
    raise ValueError(f"not a JPEG or PNG file (it starts with {head!r})")


def decode_image(data: Any, mode: str | None = "RGB", max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode a JPEG or PNG file's bytes into an array of height x width x channels.

    Args:
        data: the file's bytes.
        mode: ``"RGB"`` (grey replicated, alpha dropped, CMYK converted as Pillow does), ``"L"`` (luma), or
            ``None`` (the file's channels: 1 grey, 2 grey and alpha, 3 colour, 4 colour and alpha or CMYK;
            a palette becomes RGB, or RGBA with transparency).
        max_pixels: the pixels an image may have; a larger one is refused before it is decoded.

    Returns:
        A ``uint8`` array. 16-bit samples become 8-bit by their high byte (as Pillow reads 16-bit colour
        PNGs), except a 16-bit grey PNG with ``mode=None``, which stays ``uint16``.

    Raises:
        ValueError: empty, corrupt or truncated data (never a partly black frame), zero pixels, more than
            ``max_pixels``, an unknown format or ``mode``.
        TypeError: ``data`` is not bytes.
    """
    if mode not in MODES:
        raise ValueError(f"decode: mode must be one of {MODES}, got {mode!r}")
    height, width, kind = image_size(data)
    if not height or not width:
        raise ValueError(f"the {kind} is {width}x{height}: an image needs at least one pixel")
    if height * width > max_pixels:
        raise ValueError(
            f"the {kind} is {width}x{height} = {height * width:,} pixels, more than max_pixels={max_pixels:,} "
            "(a decompression bomb, or raise max_pixels)"
        )
    buf = _as_bytes(data)
    if kind == "JPEG":
        got = _jpeg(buf, mode)
        if got is not None:
            return got
    return _pillow(buf, mode, kind, max_pixels)


def decode_scaled(data: Any, at_least: tuple[int, int], max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """An RGB ``uint8`` decode at the smallest DCT scale (1, 1/2, 1/4 or 1/8) keeping ``at_least`` pixels.

    A JPEG whose ``at_least`` ``(height, width)`` is at most half its size is decoded by
    libjpeg-turbo at a reduced scale (the inverse DCT computes fewer pixels: a decode and
    a shrink in one, faster than both); any other image is :func:`decode_image`'s RGB.
    Only the scales 1/2, 1/4 and 1/8 are used: libjpeg-turbo's others were slower than a
    full decode here.

    Raises:
        ValueError: as :func:`decode_image`.
        TypeError: ``data`` is not bytes.
    """
    height, width, kind = image_size(data)
    factor = 8
    while factor > 1 and (height // factor < at_least[0] or width // factor < at_least[1]):
        factor //= 2
    if kind != "JPEG" or factor == 1 or not height * width or height * width > max_pixels:
        return decode_image(data, "RGB", max_pixels)
    simplejpeg = _module("simplejpeg")
    buf = _as_bytes(data)
    if simplejpeg.decode_jpeg_header(buf)[2] in ("CMYK", "YCCK"):
        return decode_image(data, "RGB", max_pixels)
    try:
        return simplejpeg.decode_jpeg(
            buf, colorspace="RGB", min_height=-(-height // factor), min_width=-(-width // factor), strict=True
        )
    except ValueError as e:
        raise ValueError(f"a corrupt or truncated JPEG: {e}") from e


def _jpeg(buf: bytes | bytearray | memoryview, mode: str | None) -> np.ndarray | None:
    """libjpeg-turbo's decode, or ``None`` for a CMYK or YCCK file (Pillow converts those)."""
    simplejpeg = _module("simplejpeg")
    _, _, space, _ = simplejpeg.decode_jpeg_header(buf)
    if space in ("CMYK", "YCCK"):
        return None
    grey = space == "Gray"
    target = "GRAY" if grey and mode != "RGB" else "RGB"
    try:
        out = simplejpeg.decode_jpeg(buf, colorspace=target, fastdct=False, fastupsample=False, strict=True)
    except ValueError as e:
        raise ValueError(f"a corrupt or truncated JPEG: {e}") from e
    if mode == "L" and not grey:
        return luma(out)
    return out if out.ndim == 3 else out[:, :, None]


def luma(rgb: np.ndarray) -> np.ndarray:
    """The ``uint8`` luma of an RGB image as Pillow's ``convert("L")`` computes it (ITU-R 601-2, rounded).

    Example:
        >>> luma(np.array([[[255, 0, 0], [10, 200, 30]]], dtype=np.uint8))[..., 0].tolist()
        [[76, 124]]
    """
    r, g, b = (rgb[:, :, c].astype(np.uint32) for c in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[:, :, None]


def _pillow(buf: bytes | bytearray | memoryview, mode: str | None, kind: str, max_pixels: int) -> np.ndarray:
    """Pillow's decode, converted to ``mode``."""
    Image = _module("PIL.Image")  # noqa: N806 - Pillow's own name for it
    try:
        with Image.open(io.BytesIO(buf), formats=[kind]) as img:
            img.load()  # a truncated file raises here (unless the user set ImageFile.LOAD_TRUNCATED_IMAGES)
            return _convert(img, mode)
    except Image.DecompressionBombError as e:
        raise ValueError(
            f"Pillow refuses it ({e}); raise PIL.Image.MAX_IMAGE_PIXELS too (max_pixels={max_pixels:,})"
        ) from e
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"a corrupt or truncated {kind}: {type(e).__name__}: {e}") from e


def _convert(img: Any, mode: str | None) -> np.ndarray:
    """A decoded Pillow image as ``uint8`` (or 16-bit grey with ``mode=None``) height x width x channels."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grey (Pillow's convert would clip it at 255)
        wide = np.clip(np.asarray(img), 0, 65535).astype(np.uint16)
        if mode is None:
            return wide[:, :, None]
        grey = (wide >> 8).astype(np.uint8)[:, :, None]
        return np.repeat(grey, 3, axis=2) if mode == "RGB" else grey
    if mode is None:
        if img.mode == "P":
            img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        elif img.mode == "PA":
            img = img.convert("RGBA")
        elif img.mode == "1":
            img = img.convert("L")
        elif img.mode not in ("L", "LA", "RGB", "RGBA", "CMYK"):
            img = img.convert("RGB")
    elif img.mode != mode:
        img = img.convert(mode)
    out = np.asarray(img)
    return out if out.ndim == 3 else out[:, :, None]
