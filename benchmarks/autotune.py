"""``num_workers="auto"`` against the fixed settings, on every pipeline of the benchmarks.

What is measured
----------------
Each pipeline below is iterated with ``num_workers=0``, ``num_threads=2``,
``num_workers=2`` and ``num_workers="auto"``, a fresh iterator each, for
``--seconds`` (10) of wall time from building the iterator (so start-up and
auto's measuring are in the figure); records/s (rows/s for packed pipelines) =
rows delivered / seconds. ``--runs`` (2) rounds, settings in turn; the median.
The table gives auto's choice (``stats()["tuning"]``), its rate, the best fixed
setting's, auto / best and auto / ``num_workers=0``.

* **ArrayRecord built-ins**: ``benchmarks/vs_grain.py``'s data (8 shards of int32
  token records), ``shuffle().map(decode(int32)).map(pad(512)).batch(256)``;
* **ArrayRecord user fn**: the same with ``.map(decode_pad)``, a Python function;
* **Parquet**: ``benchmarks/parquet.py``'s file, a global shuffle, batch 256;
* **mixture**: ``benchmarks/mixture.py``'s three components with a schedule;
* **packing best_fit / concat**: the stdlib corpus prepared as ``examples/quickstart.py``
  does, ``.map(decode(uint8)).pack(2048, mode).batch(16)``;
* **vision**: ``benchmarks/vision.py``'s JPEGs, decode, random resized crop to
  224, flip, normalize, batch 32.

Run:  python benchmarks/autotune.py  [--seconds 10] [--runs 2] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "examples"))  # after benchmarks/: its mixture.py is not the example

import common  # noqa: E402
from common import begin, command_line, machine_line, markdown_header, markdown_row, print_table  # noqa: E402

import quern  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "num_workers=0": {"num_workers": 0},
    "num_threads=2": {"num_threads": 2},
    "num_workers=2": {"num_workers": 2},
    "auto": {"num_workers": "auto"},
}


def rows_of(batch: Any) -> int:
    """The rows of a batch: the first axis of its first leaf."""
    from quern.pipeline.core.tree import leaves

    return int(len(leaves(batch)[0][1]))


def measure(pipe: quern.Pipeline, options: dict[str, Any], seconds: float) -> tuple[float, dict[str, Any] | None]:
    """Rows/s over ``seconds`` from building the iterator, and its tuning (auto only)."""
    t0 = time.perf_counter()
    rows = 0
    with pipe.iterator(**options) as it:
        for batch in it:
            rows += rows_of(batch)
            if time.perf_counter() - t0 >= seconds:
                break
        tuning = it.stats().get("tuning")
        elapsed = time.perf_counter() - t0
    return rows / elapsed, tuning


def steady(pipe: quern.Pipeline, workers: int, seconds: float) -> tuple[float, float]:
    """Rows/s once started (the workers ready, 20 batches taken), and the seconds to the first batch."""
    t0 = time.perf_counter()
    with pipe.iterator(num_workers=workers) as it:
        next(it)
        first = time.perf_counter() - t0
        it.wait_for_workers()
        for _ in range(20):
            next(it)
        rows, t1 = 0, time.perf_counter()
        while time.perf_counter() - t1 < seconds:
            rows += rows_of(next(it))
        return rows / (time.perf_counter() - t1), first


def pipelines(tmp: str) -> dict[str, Callable[[], quern.Pipeline]]:
    """Each benchmark's pipeline, built on demand (its data made first, or reused)."""
    import mixture
    import parquet
    import quickstart
    import vision
    import vs_grain

    out: dict[str, Callable[[], quern.Pipeline]] = {}
    paths = vs_grain.make_data(200_000)
    out["ArrayRecord built-ins"] = lambda: vs_grain.quern_pipeline(paths)

    def user_fn() -> quern.Pipeline:
        src = quern.sources.ArrayRecordSource(paths)
        return quern.Pipeline.from_source(src, seed=0).shuffle().map(vs_grain.decode_pad).batch(vs_grain.BATCH)

    out["ArrayRecord user fn"] = user_fn
    pq = parquet.make_data(200_000)
    pad = quern.transforms.pad(512, key="tokens")
    out["Parquet (global shuffle)"] = lambda: (
        quern.Pipeline.from_source(quern.sources.ParquetSource(pq), seed=0).shuffle().map(pad).batch(256)
    )
    mix_paths = mixture.make_data(60_000)
    out["mixture (3 components)"] = lambda: mixture.quern_mix(mix_paths)
    folder, _ = quickstart.build_dataset(os.path.join(tmp, "stdlib"))
    for mode in ("best_fit", "concat"):

        def packed(mode: str = mode) -> quern.Pipeline:
            src = quern.sources.ArrayRecordSource(folder)
            pipe = quern.Pipeline.from_source(src, seed=0).shuffle().map(quern.transforms.decode(np.uint8))
            return pipe.pack(2048, mode=mode, cache_dir=os.path.join(tmp, "cache")).batch(16)

        out[f"packing {mode}"] = packed
    jpegs = os.path.join(tmp, "images.array_record")
    common.write_array_record(jpegs, vision.make_jpegs(400))
    out["vision (decode, crop, flip)"] = lambda: vision.quern_pipeline(jpegs, fused=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", default="", help="pipelines to run (comma-separated prefixes)")
    ap.add_argument("--out", default=str(HERE / "results" / "autotune.md"))
    args = ap.parse_args()
    begin()
    rows = []
    packed: dict[tuple[str, int], list[tuple[float, float]]] = {}
    printed: list[str] = []  # each pipeline's rates per setting and round, and what auto measured
    with tempfile.TemporaryDirectory() as tmp:
        made = pipelines(tmp)
        for name, make in made.items():
            if args.only and not any(name.startswith(p) for p in args.only.split(",")):
                continue
            pipe = make()
            rates: dict[str, list[float]] = {k: [] for k in SETTINGS}
            chose: list[str] = []
            measured: list[dict[str, float]] = []  # auto's measured steps/s per candidate, each run
            for _ in range(args.runs):
                for label, options in SETTINGS.items():
                    r, tuning = measure(pipe, options, args.seconds)
                    rates[label].append(r)
                    if tuning:
                        chose.append(f"{tuning['chose']} @ step {tuning['at_step']}")
                        measured.append(tuning["measured"])
            med = {k: statistics.median(v) for k, v in rates.items()}
            fixed = {k: v for k, v in med.items() if k != "auto"}
            best = max(fixed, key=lambda k: fixed[k])
            row = [
                name,
                "; ".join(chose),
                f"{med['auto']:,.0f}",
                f"{best} {fixed[best]:,.0f}",
                f"{med['num_workers=0']:,.0f}",
                f"{med['auto'] / fixed[best]:.2f}",
                f"{med['auto'] / med['num_workers=0']:.2f}",
            ]
            for line in (
                f"{name} { ({k: [round(x) for x in v] for k, v in rates.items()}) } {chose}",
                f"  auto measured (steps/s): {measured}",
            ):
                print(line, flush=True)
                printed.append(line)
            rows.append(row)
            if name.startswith("packing"):  # issue 41's point 4: workers against one process, once started
                for _ in range(args.runs):
                    for w in (0, 2):
                        r, first = steady(pipe, w, args.seconds / 2)
                        packed.setdefault((name, w), []).append((r, first))
    head2 = ["packing", "num_workers", "rows/s once started", "first batch (s)"]
    rows2 = [
        [name, w, f"{statistics.median(r for r, _ in v):,.0f}", f"{statistics.median(f for _, f in v):.3f}"]
        for (name, w), v in packed.items()
    ]
    head = ["pipeline", "auto chose", "auto /s", "best fixed /s", "num_workers=0 /s", "auto / best", "auto / 0 workers"]
    print_table(head, rows)
    print_table(head2, rows2)
    lines = [
        "# num_workers='auto' against the fixed settings",
        "",
        f"`{command_line()}`; {machine_line()}; {args.seconds:g} s per run from the iterator's build, "
        f"median of {args.runs}",
        "",
        markdown_header(head, left=(0, 1)),
        *[markdown_row(r) for r in rows],
        "",
        markdown_header(head2),
        *[markdown_row(r) for r in rows2],
        "",
        "What the run printed as it went (each pipeline's rows/s per setting and round, and what auto measured "
        "for each candidate, in steps/s):",
        "",
        "```",
        *printed,
        "```",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
