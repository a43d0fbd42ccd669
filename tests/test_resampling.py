"""The image kernels (libimage): the resize is Pillow's bilinear arithmetic with one pass order, the same
pixels everywhere; normalize gives NumPy's float32 values.

Every expected value comes from Pillow itself (within 1 level where both passes run; exactly where one
does), from a loop-by-loop implementation written here from Pillow's ``Resample.c`` (exactly), or from a
process where the C library is off (``QUERN_NATIVE=0``: exactly).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from quern.transforms import image
from quern.transforms.image import normalizing, resampling

HAVE_CC = bool(shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"))


def _weights(in_size, in0, in1, out_size):
    """Pillow's precompute_coeffs + normalize_coeffs_8bpc for the bilinear filter, one output pixel at a time."""
    in0, in1 = np.float32(in0), np.float32(in1)
    scale = float(np.float32(in1 - in0)) / out_size
    support = max(scale, 1.0)
    out = []
    for xx in range(out_size):
        center = float(in0) + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [max(0.0, 1.0 - abs((x + xmin - center + 0.5) * (1.0 / support))) for x in range(xmax)]
        total = 0.0
        for v in w:  # one at a time, as Pillow's loop (sum() compensates from Python 3.12)
            total += v
        w = [v / total for v in w] if total else w
        out.append((xmin, [int(0.5 + v * (1 << 22)) for v in w]))
    return out


def _by_loops(img, size, box):
    """The vertical pass, then the horizontal one, pixel by pixel, each rounded and clipped to 8 bits."""
    h, w, c = img.shape
    x0, y0, x1, y1 = box
    px = [[[int(v) for v in img[y, x]] for x in range(w)] for y in range(h)]
    if size[0] != h or np.float32(y0) != 0 or np.float32(y1) != size[0]:
        rows = _weights(h, y0, y1, size[0])
        px = [
            [
                [
                    min(255, max(0, ((1 << 21) + sum(px[lo + j][x][ch] * k for j, k in enumerate(ks))) >> 22))
                    for ch in range(c)
                ]
                for x in range(w)
            ]
            for lo, ks in rows
        ]
    if size[1] != w or np.float32(x0) != 0 or np.float32(x1) != size[1]:
        cols = _weights(w, x0, x1, size[1])
        px = [
            [
                [
                    min(255, max(0, ((1 << 21) + sum(row[lo + j][ch] * k for j, k in enumerate(ks))) >> 22))
                    for ch in range(c)
                ]
                for lo, ks in cols
            ]
            for row in px
        ]
    return np.array(px, np.uint8).reshape(len(px), len(px[0]), c)


def _pillow(img, size, box):
    """Pillow's resize of each channel as an "L" image."""
    planes = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(img[:, :, ch])).resize(size[::-1], Image.Resampling.BILINEAR, box=box)
        )
        for ch in range(img.shape[2])
    ]
    return np.stack(planes, axis=2)


def _cases(n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        h, w = (int(v) for v in rng.integers(1, 40, 2))
        c = int(rng.choice([1, 2, 3, 4]))
        img = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        size = tuple(int(v) for v in rng.integers(1, 50, 2))
        if rng.random() < 0.5:  # a fractional box inside the image
            x0, y0 = rng.uniform(0, w * 0.6), rng.uniform(0, h * 0.6)
            box = (float(x0), float(y0), float(rng.uniform(x0 + 0.3, w)), float(rng.uniform(y0 + 0.3, h)))
        else:
            box = (0.0, 0.0, float(w), float(h))
        yield img, size, box


def test_the_installed_wheel_uses_the_c_resize():
    if not HAVE_CC:
        pytest.skip("no C compiler here: the wheel is built without the resize (the NumPy path is tested)")
    assert resampling.is_native(), resampling.native_why()


@pytest.mark.parametrize("seed", range(3))
def test_pixels_equal_pillows_arithmetic_done_loop_by_loop(seed):
    for img, size, box in _cases(40, seed):
        assert np.array_equal(resampling.resize_u8(img, size, box), _by_loops(img, size, box)), (img.shape, size, box)


def test_the_weights_are_pillows_for_random_boxes():
    """Each axis's weights and first pixels, made at once, equal the loop's, output pixel by output pixel."""
    rng = np.random.default_rng(6)
    for _ in range(300):
        n, out = int(rng.integers(1, 2000)), int(rng.integers(1, 300))
        lo = float(rng.uniform(0, n)) if rng.random() < 0.7 else 0.0
        hi = float(rng.uniform(lo, n)) if lo else float(n)
        bounds, kk = resampling._coeffs(n, lo, hi, out)
        for (first, count, ks), (want_first, want) in zip(
            [(b[0], b[1], k) for b, k in zip(bounds.tolist(), kk.tolist())], _weights(n, lo, hi, out)
        ):
            assert (first, ks[:count], set(ks[count:]) <= {0}) == (want_first, want, True), (n, lo, hi, out)


def test_the_numpy_path_equals_pillows_arithmetic_done_loop_by_loop():
    """The path used without the C library (its taps vectorised, its weights made per axis at once)."""
    for img, size, box in _cases(60, seed=3):
        assert np.array_equal(resampling._numpy_resize(img, size, box), _by_loops(img, size, box)), (size, box)


def test_a_pass_whose_sums_reach_31_bits_is_exact():
    """Weights summing past what 32-bit sums hold (never from _coeffs below millions of taps) are summed in 64."""
    rng = np.random.default_rng(4)
    img = (rng.random((600, 5, 2)) < 0.3).astype(np.uint8)  # 0s and 1s: each sum a count of ones, under 255
    img[:, 0, 0] = 1  # a column of 600 ones: 255 (clipped), where a 32-bit sum wraps to a negative 0
    kk = np.full((2, 600), 1 << 22, np.int64)  # each output row: the sum of the 600 input rows
    kk[1, 300:] = 0  # the second: the first 300 only
    bounds = np.array([[0, 600], [0, 300]])
    out = resampling._pass(img, bounds, kk)
    sums = img.astype(np.int64).sum(axis=0), img[:300].astype(np.int64).sum(axis=0)
    assert np.array_equal(out, np.stack([np.minimum(s, 255) for s in sums]).astype(np.uint8))
    assert 0 < out[0, 1:].min() and out[0, 1:].max() < 255  # exact counts, not a saturated 255 or a wrapped sum
    assert (int(sums[0].max()) << 22) >= 1 << 31  # 32-bit sums would have wrapped
    scaled = kk // 300  # and an ordinary one (under 2**31) keeps the arithmetic
    want = (img.astype(np.int64) * scaled[0][:, None, None]).sum(axis=0) + (1 << 21) >> 22
    assert np.array_equal(resampling._pass(img, bounds, scaled)[0], np.clip(want, 0, 255).astype(np.uint8))


def test_pixels_are_within_one_level_of_pillow_and_equal_to_it_where_one_pass_runs():
    worst = 0
    for img, size, box in _cases(300, seed=7):
        got, want = resampling.resize_u8(img, size, box), _pillow(img, size, box)
        worst = max(worst, int(np.abs(got.astype(int) - want).max()))
    assert worst == 1  # the rounding between the passes: some pixels differ, never by more
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    for size, box in [((37, 20), (0, 0, 53, 37)), ((12, 53), (0, 0, 53, 37)), ((37, 30), (2.5, 0, 40, 37))]:
        assert np.array_equal(resampling.resize_u8(img, size, box), _pillow(img, size, box))
    whole = (0.0, 0.0, 53.0, 37.0)
    assert np.array_equal(resampling.resize_u8(img, (37, 53), whole), img)  # no pass: a copy


def test_a_strided_or_flipped_image_gives_the_pixels_of_its_copy():
    rng = np.random.default_rng(2)
    img = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    for view in (img[::-1], img[:, ::-1], img[5:40, 10:60], img[::2, ::3]):
        assert np.array_equal(resampling.resize_u8(view, (17, 23)), resampling.resize_u8(view.copy(), (17, 23)))


SCRIPT = """
import json, sys
import numpy as np
from quern.transforms import image
from quern.transforms.image import normalizing, resampling
assert not resampling.is_native() and "QUERN_NATIVE=0" in resampling.native_why()
same = np.zeros((5, 4, 3), np.uint8)
assert not np.shares_memory(resampling.resize_u8(same, (5, 4)), same)  # no pass: still a new array
rng = np.random.default_rng(11)
out = []
for shape, size, box in json.loads(sys.argv[1]):
    img = rng.integers(0, 256, shape, dtype=np.uint8)
    out.append(resampling.resize_u8(img, tuple(size), tuple(box)).tolist())
json.dump(out, sys.stdout)
"""


def test_the_numpy_path_gives_the_c_librarys_pixels():
    cases = [
        [[60, 80, 3], [24, 24], [3.25, 1.5, 71.0, 55.75]],
        [[31, 17, 1], [64, 40], [0, 0, 17, 31]],
        [[45, 45, 4], [45, 12], [0, 0, 45, 45]],
        [[9, 200, 2], [3, 50], [10, 0, 190, 9]],
    ]
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env={**os.environ, "QUERN_NATIVE": "0"},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rng = np.random.default_rng(11)
    here = []
    for shape, size, box in cases:
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        here.append(resampling.resize_u8(img, tuple(size), tuple(box)).tolist())
    assert json.loads(run.stdout) == here


@pytest.mark.parametrize("channels", [1, 2, 3, 4, 5, 16, 17])
def test_normalize_gives_numpys_float32_values(channels):
    rng = np.random.default_rng(channels)
    batch = rng.integers(0, 256, (2, 9, 7, channels), dtype=np.uint8)  # 126 pixels: not a multiple of 8
    mean, std = rng.uniform(0, 255, channels), rng.uniform(0.3, 90, channels)
    want = (batch.astype(np.float32) - mean.astype(np.float32)) / std.astype(np.float32)
    got = image.normalize(mean, std)(batch)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    flipped = batch[:, :, ::-1]
    assert np.array_equal(image.normalize(mean, std)(flipped), want[:, :, ::-1])
    one = image.normalize(100.0, 50.0)(batch[0])  # one value for every channel
    assert np.array_equal(one, (batch[0].astype(np.float32) - np.float32(100)) / np.float32(50))
    if channels <= 16 and HAVE_CC:
        lib, why = normalizing._library()
        assert lib is not None, why  # the C loop gave these values


def test_what_neither_path_can_resize_is_refused_as_pillow_refuses_it():
    img = np.zeros((20, 30, 3), np.uint8)
    for size, box, match in [
        ((0, 5), None, "size must be two ints of at least 1"),
        ((5, 0), None, "size must be two ints of at least 1"),
        ((5, 5), (-1, 0, 10, 10), "starts outside the image"),
        ((5, 5), (0, 0, 31, 10), r"ends outside the 30x20 image"),
        ((5, 5), (40, 0, 41, 10), r"ends outside the 30x20 image"),
        ((5, 5), (10, 0, 5, 10), "negative width or height"),
    ]:
        with pytest.raises(ValueError, match=match):
            resampling.resize_u8(img, size, box)
    with pytest.raises(ValueError, match="a uint8 image of height x width x channels"):
        resampling.resize_u8(np.zeros((20, 30), np.uint8), (5, 5))
    assert not np.shares_memory(resampling.resize_u8(img, (20, 30)), img)  # no pass: a new array
