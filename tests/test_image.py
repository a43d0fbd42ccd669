"""quern.transforms.image: decoding against Pillow's own decode, the geometry, the errors, and the
random stages' draws, which depend only on (seed, position, stage)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from helpers import (
    assert_batches_equal,
    assert_host_slices_make_the_batch,
    assert_iterator_gives_batch_at,
    assert_same_pipeline,
    write_array_record,
    write_config,
)
from PIL import Image

import quern
from quern.transforms import image

# --------------------------------------------------------------------------- files


def _smooth(h: int = 90, w: int = 120) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 2) % 256, (y * 3) % 256, (x + y) % 256], axis=2).astype(np.uint8)


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png16_rgb(pixels: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (Pillow cannot write one), by the format's book: IHDR, filter 0 rows, IEND."""
    h, w, _ = pixels.shape
    rows = b"".join(b"\x00" + pixels[r].astype(">u2").tobytes() for r in range(h))
    head = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", head)
        + _png_chunk(b"IDAT", zlib.compress(rows))
        + _png_chunk(b"IEND", b"")
    )


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims ``w`` x ``h`` pixels and whose data is a few bytes (a decompression bomb's shape)."""
    head = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", head) + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))


RGB = _smooth()
FILES = {
    "rgb jpeg": _save(Image.fromarray(RGB), "JPEG", quality=90),
    "grey jpeg": _save(Image.fromarray(RGB[:, :, 0]), "JPEG"),
    "cmyk jpeg": _save(Image.fromarray(RGB).convert("CMYK"), "JPEG"),
    "progressive jpeg": _save(Image.fromarray(RGB), "JPEG", progressive=True, subsampling=0),
    "rgb png": _save(Image.fromarray(RGB), "PNG"),
    "rgba png": _save(Image.fromarray(np.dstack([RGB, RGB[:, :, 1]]), "RGBA"), "PNG"),
    "grey png": _save(Image.fromarray(RGB[:, :, 2]), "PNG"),
    "grey+alpha png": _save(Image.fromarray(np.dstack([RGB[:, :, 0], RGB[:, :, 1]]), "LA"), "PNG"),
    "palette png": _save(Image.fromarray(RGB).convert("P"), "PNG"),
    "bilevel png": _save(Image.fromarray(RGB[:, :, 0] > 100), "PNG"),
    "grey 16-bit png": _save(Image.fromarray(RGB[:, :, 0].astype(np.uint16) * 257 + 3), "PNG"),
}
CHANNELS = {  # mode=None: the file's own channels
    "rgb jpeg": 3,
    "grey jpeg": 1,
    "cmyk jpeg": 4,
    "progressive jpeg": 3,
    "rgb png": 3,
    "rgba png": 4,
    "grey png": 1,
    "grey+alpha png": 2,
    "palette png": 3,
    "bilevel png": 1,
    "grey 16-bit png": 1,
}


def _pillow(data: bytes, mode: str) -> np.ndarray:
    """The reference: Pillow's decode converted to ``mode``; 16-bit grey by its high byte, as documented."""
    img = Image.open(io.BytesIO(data))
    if img.mode.startswith("I"):
        grey = (np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8)
        out = np.repeat(grey[:, :, None], 3, axis=2) if mode == "RGB" else grey
    else:
        out = np.asarray(img.convert(mode))
    return out if out.ndim == 3 else out[:, :, None]


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_decoded_pixels_are_pillows_within_2(name, mode):
    got = image.decode(mode)(FILES[name])
    want = _pillow(FILES[name], mode)
    assert got.dtype == np.uint8 and got.shape == (90, 120, 3 if mode == "RGB" else 1)
    assert int(np.abs(got.astype(int) - want.astype(int)).max()) <= 2, name


@pytest.mark.parametrize("name", sorted(FILES))
def test_mode_none_keeps_the_files_channels(name):
    got = image.decode(None)(FILES[name])
    assert got.shape == (90, 120, CHANNELS[name])
    assert got.dtype == (np.uint16 if "16-bit" in name else np.uint8)
    if "16-bit" in name:
        assert np.array_equal(got[:, :, 0], np.asarray(Image.open(io.BytesIO(FILES[name]))))  # every bit kept


def test_a_16_bit_rgb_png_becomes_8_bit_by_its_high_byte():
    wide = RGB.astype(np.uint16) * 257 + np.uint16(100)  # low bytes that rounding would notice
    got = image.decode()(_png16_rgb(wide))
    assert np.array_equal(got, (wide >> 8).astype(np.uint8))


def test_the_rgb_jpeg_decode_is_libjpeg_turbos_and_equals_pillow_exactly():
    import simplejpeg

    data = FILES["rgb jpeg"]
    assert np.array_equal(image.decode()(data), simplejpeg.decode_jpeg(data, colorspace="RGB"))
    assert np.array_equal(image.decode()(data), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_bytes_in_a_dict_record_and_a_uint8_array():
    rec = {"jpg": np.frombuffer(FILES["rgb png"], dtype=np.uint8), "label": 3}
    out = image.decode(key="jpg")(rec)
    assert out["label"] == 3 and np.array_equal(out["jpg"], RGB)
    assert "jpg" in rec and isinstance(rec["jpg"], np.ndarray) and rec["jpg"].ndim == 1  # the input is not changed


BAD = [
    ("empty", b"", "empty"),
    ("not an image", b"GIF89a" + bytes(40), "not a JPEG or PNG"),
    ("truncated jpeg", FILES["rgb jpeg"][: len(FILES["rgb jpeg"]) // 2], "corrupt or truncated JPEG"),
    ("truncated png", FILES["rgb png"][: len(FILES["rgb png"]) // 2], "corrupt or truncated PNG"),
    ("jpeg header only", FILES["rgb jpeg"][:200], "JPEG"),
    ("png without IHDR", b"\x89PNG\r\n\x1a\n" + bytes(20), "no IHDR"),
    ("zero width png", _png_header_only(0, 10), "at least one pixel"),
    ("png bomb", _png_header_only(60_000, 60_000), "3,600,000,000 pixels, more than max_pixels"),
]


@pytest.mark.parametrize(("data", "message"), [(d, m) for _, d, m in BAD], ids=[n for n, _, _ in BAD])
def test_bad_images_are_errors_never_black_frames(data, message):
    with pytest.raises(ValueError, match=message):
        image.decode()(data)


def test_a_jpeg_with_corrupt_scan_data_is_an_error():
    data = bytearray(FILES["rgb jpeg"])
    sos = data.index(b"\xff\xda")
    data[sos + 40 : sos + 240] = b"\xff\xd9" * 100  # end-of-image markers inside the scan
    with pytest.raises(ValueError, match="JPEG"):
        image.decode()(bytes(data))


def test_the_pixel_limit_is_configurable():
    data = FILES["rgb png"]
    with pytest.raises(ValueError, match="90 = 10,800 pixels, more than max_pixels=10,000"):
        image.decode(max_pixels=10_000)(data)
    assert image.decode(max_pixels=10_800)(data).shape == (90, 120, 3)


def test_a_bad_image_in_a_pipeline_names_the_record():
    docs = [FILES["rgb jpeg"], FILES["rgb png"], FILES["rgb jpeg"][:300]]
    pipe = quern.Pipeline.from_source(docs, seed=0).map(image.decode()).batch(3)
    with pytest.raises(quern.StepError, match=r"record 2 of source .list.* ValueError: a corrupt"):
        pipe.batch_at(0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        image.decode("CMYK")
    with pytest.raises(ValueError, match="max_pixels must be a positive int"):
        image.decode(max_pixels=0)
    for make in (image.resize, image.center_crop, image.random_resized_crop):
        with pytest.raises(ValueError, match="size must be positive"):
            make(0)
        with pytest.raises(ValueError, match="size must be an int or a"):
            make((1, 2, 3))
    with pytest.raises(ValueError, match="scale must be a"):
        image.random_resized_crop(8, scale=(0.5, 1.5))
    with pytest.raises(ValueError, match="ratio must be a"):
        image.random_resized_crop(8, ratio=(2, 1))
    with pytest.raises(ValueError, match="p must be a probability"):
        image.random_flip(1.5)
    with pytest.raises(ValueError, match="std must be positive"):
        image.normalize(0, 0)
    with pytest.raises(ValueError, match="floating dtype"):
        image.normalize(0, 1, dtype=np.int32)


# --------------------------------------------------------------------------- geometry


def _near(a: np.ndarray, b: np.ndarray) -> bool:
    """Within 1 level: quern's resize rounds between its passes in another order than Pillow may."""
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1


def test_resize_takes_the_shorter_side_or_an_exact_size_as_pillow_resizes():
    got = image.resize(45)(RGB)
    assert got.shape == (45, 60, 3)
    want = np.asarray(Image.fromarray(RGB).resize((60, 45), Image.Resampling.BILINEAR))
    assert _near(got, want)
    only_rows = np.asarray(Image.fromarray(RGB).resize((120, 45), Image.Resampling.BILINEAR))
    assert np.array_equal(image.resize((45, 120))(RGB), only_rows)  # one pass: Pillow's pixels exactly
    tall = np.ascontiguousarray(RGB.transpose(1, 0, 2))  # 120 x 90: the width is the shorter side
    assert image.resize(30)(tall).shape == (40, 30, 3)
    assert image.resize((17, 23))(RGB).shape == (17, 23, 3)


def test_resize_keeps_four_channels_and_other_dtypes_without_premultiplying_alpha():
    rgba = np.dstack([RGB, np.zeros((90, 120), np.uint8)])  # fully transparent: colours must survive
    got = image.resize((45, 60))(rgba)
    want = np.asarray(Image.fromarray(RGB).resize((60, 45), Image.Resampling.BILINEAR))
    assert got.shape == (45, 60, 4) and np.array_equal(got[:, :, :3], image.resize((45, 60))(RGB))
    assert _near(got[:, :, :3], want) and not got[:, :, 3].any()
    wide = RGB[:, :, :1].astype(np.uint16) * 257
    assert image.resize((45, 60))(wide).dtype == np.uint16
    grey2d = RGB[:, :, 0]
    assert image.resize((45, 60))(grey2d).shape == (45, 60)  # without a channel axis in, none out


def test_center_crop_and_a_crop_larger_than_the_image():
    got = image.center_crop((50, 60))(RGB)
    assert np.array_equal(got, RGB[20:70, 30:90])
    with pytest.raises(ValueError, match="the image is 120x90 .* smaller than the crop of 100x100"):
        image.center_crop(100)(RGB)


def test_random_resized_crop_boxes_follow_torchvisions_draw():
    from quern.transforms.image.geometry import resized_crop_box

    rng = np.random.default_rng(0)
    for _ in range(500):
        top, left, h, w = resized_crop_box(rng, 90, 120, (0.08, 1.0), (3 / 4, 4 / 3))
        assert 0 <= top and top + h <= 90 and 0 <= left and left + w <= 120
        assert 0.07 <= h * w / (90 * 120) <= 1.0 and 0.7 <= w / h <= 1.4
    # nothing fits (a ratio the image cannot hold at that area): the centred box of the clamped ratio
    assert resized_crop_box(np.random.default_rng(1), 10, 100, (1.0, 1.0), (1.0, 1.0)) == (0, 45, 10, 10)


def test_the_whole_image_at_scale_1_is_a_plain_resize():
    rng = np.random.Generator(np.random.Philox(0))
    got = image.random_resized_crop((30, 40), scale=(1, 1), ratio=(4 / 3, 4 / 3))(RGB, rng)
    assert np.array_equal(got, image.resize((30, 40))(RGB))


def test_flip_and_normalize():
    rng = np.random.Generator(np.random.Philox(0))
    assert np.array_equal(image.random_flip(1.0)(RGB, rng), RGB[:, ::-1])
    assert np.array_equal(image.random_flip(0.0)(RGB, rng), RGB)
    out = image.normalize((10, 20, 30), (2, 4, 5))(RGB)
    assert out.dtype == np.float32
    assert np.allclose(out, (RGB.astype(np.float32) - [10, 20, 30]) / [2, 4, 5])
    batch = np.stack([RGB, RGB[::-1]])
    assert np.array_equal(image.normalize((10, 20, 30), (2, 4, 5))(batch), np.stack([out, out[::-1]]))  # map_batch
    with pytest.raises(ValueError, match="3 mean values for an image of 1 channels"):
        image.normalize((1, 2, 3), 1)(RGB[:, :, :1])


def test_a_random_stage_given_to_map_says_to_use_random_map():
    pipe = quern.Pipeline.from_source([RGB], seed=0).map(image.random_flip()).batch(1)
    with pytest.raises(quern.StepError, match=r"random_map\(t\)"):
        pipe.batch_at(0)


def test_bytes_given_to_a_geometric_stage_say_to_decode_first():
    with pytest.raises(TypeError, match="decode the bytes first"):
        image.resize(8)(FILES["rgb jpeg"])


# --------------------------------------------------------------------------- the pipeline's draws


def _sizes(n: int) -> list[bytes]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(40, 120, 2))
        out.append(_save(Image.fromarray(_smooth(h, w)), "JPEG" if i % 3 else "PNG"))
    return out


def _vision(n: int = 24, **kw):
    records = [{"jpg": b, "label": i} for i, b in enumerate(_sizes(n))]
    return (
        quern.Pipeline.from_source(records, seed=11, **kw)
        .shuffle()
        .map(image.decode(key="jpg"))
        .random_map(image.random_resized_crop(32, key="jpg"))
        .random_map(image.random_flip(key="jpg"))
        .map(image.normalize((123.675, 116.28, 103.53), (58.395, 57.12, 57.375), key="jpg"))
        .batch(4)
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_crops_are_the_same_for_any_worker_count_and_on_resume(num_workers):
    pipe = _vision()
    assert pipe.batch_at(0)["jpg"].shape == (4, 32, 32, 3)
    assert_iterator_gives_batch_at(pipe, count=8, num_workers=num_workers)
    assert_iterator_gives_batch_at(pipe, start_step=9, count=3, num_workers=num_workers)


def test_crops_are_the_same_for_any_host_count():
    assert_host_slices_make_the_batch(_vision(), steps=[0, 5, 13])


def test_a_crop_depends_on_the_position_not_on_the_record_alone():
    pipe = _vision(num_epochs=2)
    epoch = 24 // 4
    first = {int(lbl): row for lbl, row in zip(pipe.batch_at(0)["label"], pipe.batch_at(0)["jpg"])}
    later = {}
    for s in range(epoch, 2 * epoch):
        b = pipe.batch_at(s)
        later.update({int(lbl): row for lbl, row in zip(b["label"], b["jpg"])})
    assert any(not np.array_equal(first[k], later[k]) for k in first)  # the same image, cropped anew
    assert_batches_equal(_vision(num_epochs=2).batch_at(3), pipe.batch_at(3), "a new pipeline object")


def test_the_fingerprint_and_the_config_form(tmp_path):
    path = tmp_path / "images.array_record"
    write_array_record(path, _sizes(12))
    src = quern.sources.ArrayRecordSource(str(path))

    def pipe(size):
        return (
            quern.Pipeline.from_source(src, seed=4)
            .shuffle()
            .map(image.decode())
            .random_map(image.random_resized_crop(size, scale=(0.25, 1)))
            .random_map(image.random_flip())
            .map(image.normalize(127.5, 127.5))
            .batch(4)
        )

    assert pipe(32).fingerprint() != pipe(48).fingerprint()
    cfg = pipe(32).to_config()
    names = [(t["name"], t["kind"]) for t in cfg["transforms"]]
    assert names == [
        ("image.decode", "map"),
        ("image.random_resized_crop", "random_map"),
        ("image.random_flip", "random_map"),
        ("image.normalize", "map"),
    ]
    assert_same_pipeline(pipe(32), quern.load_config(write_config(tmp_path, cfg)), (0, 2, 5))


# --------------------------------------------------------------------------- decode and crop in one


def test_a_crop_of_the_bytes_is_the_same_box_decoded_at_a_reduced_scale():
    big = _smooth(480, 640)
    data = _save(Image.fromarray(big), "JPEG", quality=95)
    crop = image.random_resized_crop(48)
    for seed in range(6):
        from_bytes = crop(data, np.random.Generator(np.random.Philox(seed)))
        decoded_first = crop(image.decode()(data), np.random.Generator(np.random.Philox(seed)))
        assert from_bytes.shape == decoded_first.shape == (48, 48, 3)
        assert np.abs(from_bytes.astype(int) - decoded_first.astype(int)).mean() < 4, seed  # the same box
    whole = image.random_resized_crop((60, 80), scale=(1, 1), ratio=(4 / 3, 4 / 3))  # the whole image, 1/8 scale
    small = whole(data, np.random.Generator(np.random.Philox(0)))
    assert np.abs(small.astype(int) - image.resize((60, 80))(image.decode()(data)).astype(int)).mean() < 4
    png = _save(Image.fromarray(big), "PNG")  # not a JPEG: decoded whole, so exactly the decode-first pixels
    rng = lambda: np.random.Generator(np.random.Philox(3))  # noqa: E731
    assert np.array_equal(crop(png, rng()), crop(image.decode()(png), rng()))


def test_decode_scaled_picks_the_smallest_scale_that_keeps_the_pixels():
    from quern.transforms.image.decoding import decode_scaled

    data = _save(Image.fromarray(_smooth(480, 640)), "JPEG")
    assert decode_scaled(data, (60, 80)).shape == (60, 80, 3)  # 1/8
    assert decode_scaled(data, (61, 80)).shape == (120, 160, 3)  # 1/4
    assert decode_scaled(data, (300, 10)).shape == (480, 640, 3)  # more than half: the whole image
    with pytest.raises(ValueError, match="corrupt"):
        decode_scaled(data[:400], (60, 80))
