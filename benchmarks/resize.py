"""The resize kernel: quern's C loop, its NumPy path (no C compiler at install) and Pillow, one image at a time.

What is measured
----------------
Milliseconds per call (the median of ``--runs`` runs of at least ``--seconds`` each, one thread) of
``quern.transforms.image.resampling.resize_u8`` with the C library (``libimage.so``), of the same
function's NumPy path (``_numpy_resize``: what runs without a C compiler at install or with
``QUERN_NATIVE=0``; the same pixels), and of Pillow's ``Image.resize(..., BILINEAR, box=...)`` (the
copy into a PIL image included), on random ``uint8`` RGB images:

* **crop**: a 600x500 box of a 800x600 image to 224x224 (what ``random_resized_crop`` does to the
  benchmark images of ``benchmarks/vision.py``);
* **grow**: a 224x224 image to 448x448;
* **shrink**: a 1920x1080 image to 256x144.

No timing is asserted; the two quern paths are checked to give the same pixels. Without the C
library the C column is left out (``resize_u8`` would be the NumPy path). Run (about 30 s):

    .venv/bin/python benchmarks/resize.py [--runs 5] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import common
import numpy as np
from PIL import Image

from quern.transforms.image import resampling

CASES = {  # name: (image height, width), output (height, width), box (left, top, right, bottom)
    "crop": ((600, 800), (224, 224), (100.5, 50.25, 700.0, 550.0)),
    "grow": ((224, 224), (448, 448), (0.0, 0.0, 224.0, 224.0)),
    "shrink": ((1080, 1920), (144, 256), (0.0, 0.0, 1920.0, 1080.0)),
}


def per_call_ms(fn: Callable[..., Any], fn_args: tuple[Any, ...], runs: int, seconds: float) -> float:
    """The median over ``runs`` runs of the milliseconds ``fn(*fn_args)`` takes (each run at least ``seconds``)."""
    times = []
    for _ in range(runs):
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < seconds:
            fn(*fn_args)
            n += 1
        times.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times)


def _pillow(img: np.ndarray, size: tuple[int, int], box: tuple[float, ...]) -> Image.Image:
    return Image.fromarray(img).resize((size[1], size[0]), Image.Resampling.BILINEAR, box=box)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per run at least (default 0.5)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    print("# The resize kernel: C, NumPy, Pillow\n")
    print(common.command_line())
    print(common.machine_line(pillow=Image.__version__))
    print(f"C library: {'used' if resampling.is_native() else 'not used: ' + resampling.native_why()}\n")
    rng = np.random.default_rng(0)
    print(common.markdown_header(["case", "C ms", "NumPy path ms", "Pillow ms", "NumPy / C", "Pillow / C"]))
    figures: dict[str, Any] = {}
    for name, (shape, size, box) in CASES.items():
        img = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        assert np.array_equal(resampling.resize_u8(img, size, box), resampling._numpy_resize(img, size, box))
        calls = {
            "c": (resampling.resize_u8, (img, size, box)),
            "numpy": (resampling._numpy_resize, (img, size, box)),
            "pillow": (_pillow, (img, size, box)),
        }
        if not resampling.is_native():
            del calls["c"]
        ms = {k: per_call_ms(fn, fn_args, args.runs, args.seconds) for k, (fn, fn_args) in calls.items()}
        figures[name] = ms
        c = ms.get("c")
        row = [f"{name} {shape[1]}x{shape[0]} -> {size[1]}x{size[0]}", "n/a" if c is None else f"{c:.2f}"]
        row += [f"{ms['numpy']:.2f}", f"{ms['pillow']:.2f}"]
        row += ["n/a", "n/a"] if c is None else [f"{ms['numpy'] / c:.1f}x", f"{ms['pillow'] / c:.1f}x"]
        print(common.markdown_row(row))
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
