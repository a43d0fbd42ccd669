"""Start-up: how soon batches arrive with and without worker processes.

What is measured
----------------
For each data set and worker count, in a fresh Python process per run (which
has already imported quern, numpy, pyarrow and array_record, as a training
script has; the page cache is warm): the source and the pipeline are built
(not timed), then the clock starts, ``pipe.iterator(num_workers=W)`` is made
and batches are taken; the seconds from the clock's start to the 1st, 20th,
200th and 700th batch are recorded (``--marks``). Reported: the median over
``--runs`` runs, and the runs themselves.

* **parquet**: 200,000 records of int32 token lists, lengths uniform in
  64..512, one file, 10,000-row row groups, snappy (the data of
  ``benchmarks/parquet.py``, written by its ``make_data``);
  ``ParquetSource -> shuffle("block", window=4) -> pad(512, key="tokens")
  -> batch(256)``.
* **array_record**: the same kind of records in 8 ArrayRecord shards (the
  data of ``benchmarks/vs_grain.py``, written by its ``make_data``);
  ``ArrayRecordSource -> shuffle() -> decode(int32) -> pad(512) -> batch(256)``.

And the time one worker takes to start, in the same kind of fresh process
(median of ``--runs``): ``python -c pass`` (a bare interpreter),
``python -c "import quern.pipeline.iterate.workers.forkserver, pyarrow.parquet,
array_record..."`` (interpreter + a worker's imports),
``pipe.iterator(num_workers=1)`` until ``wait_for_workers()`` returns
(interpreter, imports and the pipeline loaded), and **the delay one worker
adds**: the 1st batch with ``num_workers=1`` minus the 1st batch with
``num_workers=0``. That last one is "the time one worker takes to start" in
the goal below: everything a worker does before it can compute steps the way
the parent does with ``num_workers=0``, which is the interpreter, the imports,
loading the pipeline *and opening the source's files* (with ``num_workers=0``
the parent's source has them open already: it opened them to count the
records when it was built, before the clock started; a worker opens its own,
for ArrayRecord about 40 ms for 8 files, a third of it array_record's thread
pool).

The goal this measures (issue 10): with 2 workers, the 20th batch arrives no
later than with ``num_workers=0`` plus the time one worker takes to start.
The summary prints that comparison; no timing is asserted.

Run:  .venv/bin/python benchmarks/startup.py [--runs 5] [--only parquet] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import common

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS = 200_000
SEQ_LEN, BATCH = 512, 256
DATASETS = ("parquet", "array_record")


def _load(name: str):
    """A sibling benchmark module, by path (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def make_data(records: int) -> dict[str, list[str]]:
    """Write (or reuse) both data sets; return their paths, page cache warmed."""
    paths = {
        "parquet": [_load("parquet").make_data(records)],
        "array_record": _load("vs_grain").make_data(records),
    }
    common.warm_page_cache(p for ps in paths.values() for p in ps)
    return paths


# --------------------------------------------------------------------------- in the measured process


def _pipeline(dataset: str, paths: list[str]):
    import numpy as np

    import quern

    if dataset == "parquet":
        src = quern.sources.ParquetSource(paths)
        pipe = quern.Pipeline.from_source(src, seed=0).shuffle("block", window=4)
        return pipe.map(quern.transforms.pad(SEQ_LEN, key="tokens")).batch(BATCH)
    src = quern.sources.ArrayRecordSource(paths)
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle()
    return pipe.map(quern.transforms.decode(np.int32)).map(quern.transforms.pad(SEQ_LEN)).batch(BATCH)


def _imports() -> None:
    """What a training script has imported before it makes an iterator."""
    import numpy  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    from array_record.python import array_record_module  # noqa: F401

    import quern  # noqa: F401


def child_batches(dataset: str, workers: int, marks: list[int], paths: list[str]) -> dict:
    _imports()
    pipe = _pipeline(dataset, paths)
    times = {}
    t0 = time.perf_counter()
    it = pipe.iterator(num_workers=workers)
    for n in range(1, max(marks) + 1):
        next(it)
        if n in marks:
            times[n] = time.perf_counter() - t0
    stats = it.stats()
    it.close()
    return {"times": times, "stats": stats}


def child_worker_start(dataset: str, paths: list[str]) -> dict:
    _imports()
    pipe = _pipeline(dataset, paths)
    t0 = time.perf_counter()
    it = pipe.iterator(num_workers=1)
    assert it.wait_for_workers(120)
    t = time.perf_counter() - t0
    it.close()
    return {"start": t}


def child(kind: str, dataset: str, *rest: Any) -> dict:
    """A measured process (``--child``): ``batches`` (workers, marks, paths) or ``start`` (paths)."""
    if kind == "batches":
        workers, marks, paths = rest
        return child_batches(dataset, workers, marks, paths)
    return child_worker_start(dataset, rest[0])


# --------------------------------------------------------------------------- driver


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--records", type=int, default=RECORDS)
    ap.add_argument("--marks", default="1,20,200,700", help="batch counts to time (comma-separated)")
    ap.add_argument("--workers", default="0,2", help="worker counts (comma-separated)")
    ap.add_argument("--only", choices=DATASETS, help="one data set")
    args = common.parse_args(ap, child=child)
    if args is None:  # a measured process
        return

    common.begin()
    marks = sorted({int(m) for m in args.marks.split(",")})
    worker_counts = [int(w) for w in args.workers.split(",")]
    datasets = [args.only] if args.only else list(DATASETS)
    paths = make_data(args.records)
    figures: dict = {"marks": marks, "runs": args.runs, "start": {}, "batches": {}}

    imports = "import quern.pipeline.iterate.workers.forkserver, pyarrow.parquet; from array_record.python import array_record_module"
    bare = [_timed([sys.executable, "-c", "pass"]) for _ in range(args.runs)]
    imp = [_timed([sys.executable, "-c", imports]) for _ in range(args.runs)]
    figures["start"]["bare interpreter"] = bare
    figures["start"]["interpreter + worker imports"] = imp
    for d in datasets:
        figures["start"][f"worker ready ({d})"] = [
            common.run_child(__file__, ["start", d, paths[d]])["start"] for _ in range(args.runs)
        ]
        figures["first"] = figures.get("first", {})
        for w in (0, 1):
            figures["first"][f"{d} W={w}"] = [
                common.run_child(__file__, ["batches", d, w, [1], paths[d]])["times"]["1"] for _ in range(args.runs)
            ]
        delay = statistics.median(figures["first"][f"{d} W=1"]) - statistics.median(figures["first"][f"{d} W=0"])
        figures["start"][f"delay one worker adds ({d})"] = [delay]
    print(f"\none worker's start, seconds (median of {args.runs}; runs):")
    for label, runs in figures["start"].items():
        print(f"  {label:<36s} {statistics.median(runs):6.3f}   " + common.join_runs(runs, ".3f"))
    for d in datasets:
        w0, w1 = (statistics.median(figures["first"][f"{d} W={w}"]) for w in (0, 1))
        print(f"  {'(1st batch, ' + d + ')':<36s} W=1 {w1:.3f} - W=0 {w0:.3f} = delay one worker adds")

    for d in datasets:
        for w in worker_counts:
            runs = [common.run_child(__file__, ["batches", d, w, marks, paths[d]]) for _ in range(args.runs)]
            figures["batches"][f"{d} W={w}"] = runs
    print(f"\nseconds from pipe.iterator() to the n-th batch (median of {args.runs}):")
    rows = []
    for label, runs in figures["batches"].items():
        med = [f"{statistics.median(r['times'][str(m)] for r in runs):.3f}" for m in marks]
        twenty = common.join_runs((r["times"]["20"] for r in runs), ".3f") if 20 in marks else ""
        rows.append([label, *med, twenty])
    header = ["config", *(f"n={m}" for m in marks), "runs of n=20"]
    common.print_table(header, rows, left=(0, len(marks) + 1), indent="  ")
    for label, runs in figures["batches"].items():
        if "W=0" not in label:
            print(f"  stats of the last run, {label}: {runs[-1]['stats']}")

    if 20 in marks and 0 in worker_counts:
        print("\ngoal: 20th batch with W workers <= 20th batch with W=0 + one worker's start")
        for d in datasets:
            w0 = statistics.median(r["times"]["20"] for r in figures["batches"][f"{d} W=0"])
            start = figures["start"][f"delay one worker adds ({d})"][0]
            for w in worker_counts:
                if w:
                    got = statistics.median(r["times"]["20"] for r in figures["batches"][f"{d} W={w}"])
                    verdict = "met" if got <= w0 + start else "NOT met"
                    print(f"  {d:<13s} W={w}: {got:.3f} s vs {w0:.3f} + {start:.3f} = {w0 + start:.3f} s: {verdict}")
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
