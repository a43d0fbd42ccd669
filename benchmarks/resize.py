"""The resize kernel: quern's C loop, its NumPy path (no C compiler at install) and Pillow, one image at a time.

What is measured
----------------
Milliseconds per call (the median of ``--runs`` rounds of at least ``--seconds`` each, the three
taking turns within a round so that a slow spell of the machine hits them all; one thread) of
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
import functools
import statistics
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


def _pillow(img: np.ndarray, size: tuple[int, int], box: tuple[float, ...]) -> Image.Image:
    return Image.fromarray(img).resize((size[1], size[0]), Image.Resampling.BILINEAR, box=box)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per run at least (default 0.5)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    print("# The resize kernel: C, NumPy, Pillow\n")
    common.begin(pillow=Image.__version__)
    print(f"C library: {'used' if resampling.is_native() else 'not used: ' + resampling.native_why()}\n")
    rng = np.random.default_rng(0)
    print(common.markdown_header(["case", "C ms", "NumPy path ms", "Pillow ms", "NumPy / C", "Pillow / C"]))
    figures: dict[str, Any] = {}
    for name, (shape, size, box) in CASES.items():
        img = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        assert np.array_equal(resampling.resize_u8(img, size, box), resampling._numpy_resize(img, size, box))
        calls = {
            "c": functools.partial(resampling.resize_u8, img, size, box),
            "numpy": functools.partial(resampling._numpy_resize, img, size, box),
            "pillow": functools.partial(_pillow, img, size, box),
        }
        if not resampling.is_native():
            del calls["c"]
        cases = [(k, lambda fn=fn: 1e3 / common.rate(fn, args.seconds, 1)) for k, fn in calls.items()]
        ms = {k: statistics.median(v) for k, v in common.interleaved(cases, args.runs, alternate=True).items()}
        figures[name] = ms
        c = ms.get("c")
        row = [f"{name} {shape[1]}x{shape[0]} -> {size[1]}x{size[0]}", "-" if c is None else f"{c:.2f}"]
        row += [
            f"{ms['numpy']:.2f}",
            f"{ms['pillow']:.2f}",
            common.ratio(ms["numpy"], c),
            common.ratio(ms["pillow"], c),
        ]
        print(common.markdown_row(row))
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
