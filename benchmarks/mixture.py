"""quern.mix vs grain's mix: throughput, the cost of mixing, drawn proportions; the filter scan.

What is measured
----------------
**Throughput** (records/s). Three components of int32 token records in
ArrayRecord files ("web", "code", "books": ``--records`` each, 2 shards per
component, lengths of their own), every pipeline with the same transforms
(decode int32, pad / truncate to 512, batch 256), all in one process
(``num_workers=0`` for quern, grain without ``mp_prefetch``), plus quern with 2
worker processes:

* ``quern mix`` -- ``quern.mix({web, code, books}, schedule=[(0, W0), (100, W1)])``
  of three ``ArrayRecordSource`` pipelines, each ``.shuffle()``'d with its own
  seed, then ``.map(decode(int32)).map(pad(512)).batch(256)``: the weights
  switch at step 100, inside every timed run. A variant has the transforms in
  each component instead (``.map(...)`` before ``mix``).
* ``quern single`` -- ``ArrayRecordSource`` over the same 6 files (the same total
  records), ``.shuffle()``, the same transforms: the reference for the cost of
  mixing, ``1 - mix / single``. (The mixture draws the components in other
  proportions than the single source holds them; the work per record differs
  only by the decode of longer or shorter records.)
* the same two quern pipelines as ``pipe.batches_at(step, 16)`` in a plain loop
  (no thread, no prefetch): the cost of mixing in the work of the steps alone,
  less exposed to the machine's scheduling than the iterators.
* ``grain MapDataset.mix`` -- ``MapDataset.mix([source(ArrayRecordDataSource(files
  of c)).shuffle(seed).repeat() for c], W0).map(decode_pad).batch(256)
  .to_iter_dataset(read_options)``, with grain's default ``ReadOptions`` (reader
  threads) and with ``num_threads=0`` (reads in the calling thread).
* ``grain IterDataset.mix`` -- ``IterDataset.mix([the same components
  .to_iter_dataset(read_options)], W0).map(decode_pad).batch(256)``, both read
  options.
* ``grain single`` -- ``MapDataset.source(ArrayRecordDataSource(all 6 files))``
  with the same chain, for grain's own cost of mixing.

grain has no schedule of weights: it gets the constant weights of stage 0
(``W0``) throughout. Each config: a fresh iterator per run, ``--warmup``
batches untimed, then at least ``--batches`` batches and ``--min-seconds``
seconds timed; ``--runs`` runs, the configs taking turns run by run (so a
slow spell of the machine hits all of them); the figure is the median.

**Proportions** (no reads): over 1,000 steps of batch 256 of the quern mixture,
the components of each row from ``pipe.segments(positions)``; per stage and
over the whole 1,000 steps, the largest deviation of a step's drawn proportion
from its stage's weight, ``max |count / 256 - w|`` over steps and components,
the same over blocks of 1,024 positions (4 steps: the unit whose counts are
exact) and of the stage's total. grain's mixes (``MapDataset.mix`` and
``IterDataset.mix`` over labelled ranges, no reads) get the same figures
against ``W0``.

**Filter** at ``N = --filter-n`` (10**7) in-memory records ``{"x": arange(N)}``
with a vectorised predicate (``keep_many``: keep ``x % 10 < 7``), survivors
cached under a temporary folder: the cold scan (its time and records/s, in
``workers`` = CPU-count scan processes, the default), then a warm build in
this process (the cache hit: source + ``filter``; with how much of it is the
hash of the in-memory source's content, part of the cache key), and the time to the first
batch with the warm cache in a fresh Python process (median of 3; the scan
functions are replaced there by ones that raise, so a hit is proven), against
the same pipeline without the filter. Before that, the scan rate of one
process at 10**6 records, with ``keep_many`` and with a plain per-record
function; if it puts the cold scan at ``N`` beyond 3 minutes, that scan is
skipped and its time extrapolated (labelled so), and the warm figures are
taken at 10**6.

Data: ``--records`` (60,000) records per component, values uniform in
[1, 32000), lengths uniform in 32..512 (web), 64..1024 (code), 256..512
(books), fixed NumPy seed, written with ``ArrayRecordWriter(path,
"group_size:1")`` under ``benchmarks/data/mixture/`` (git-ignored), rewritten
when missing or when ``--records`` changes. The page cache is warmed first.

It prints figures and ratios only; no target is asserted.

Run:  .venv/bin/python benchmarks/mixture.py [--records 60000] [--runs 3] [--filter-n 10000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import common
import numpy as np

import quern

SEQ_LEN = 512
BATCH = 256
SHARDS = 2  # files per component
DATA_SEED = 20260111
LENGTHS = {"web": (32, 512), "code": (64, 1024), "books": (256, 512)}
NAMES = tuple(LENGTHS)
SWITCH = 100  # the step where the schedule's second stage starts
W0 = {"web": 0.6, "code": 0.3, "books": 0.1}
W1 = {"web": 0.2, "code": 0.3, "books": 0.5}
SCHEDULE = [(0, W0), (SWITCH, W1)]
PROPORTION_STEPS = 1000
KEEP_BELOW = 7  # the filter keeps x % 10 < KEEP_BELOW
MAX_COLD_SCAN = 180.0  # seconds: beyond this (estimated), the cold scan at N is extrapolated
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mixture")


# --------------------------------------------------------------------------- data


def make_data(records: int) -> dict[str, list[str]]:
    """Write (or reuse) the shards of each component; return their paths by component."""
    paths = {
        name: [os.path.join(DATA_DIR, f"{name}-{i:05d}-of-{SHARDS:05d}.array_record") for i in range(SHARDS)]
        for name in NAMES
    }
    meta = {
        "records": records,
        "shards": SHARDS,
        "seed": DATA_SEED,
        "lengths": LENGTHS,
        "vocab": common.VOCAB,
        "dtype": "int32",
        "writer_options": "group_size:1",
        "format": 1,
    }
    note = f"generating {len(NAMES)} x {records:,} records under {DATA_DIR} ..."
    parts = [(paths[name], LENGTHS[name]) for name in NAMES]
    common.token_shards(DATA_DIR, meta, parts, records, DATA_SEED, announce=note)
    return paths


def all_files(paths: dict[str, list[str]]) -> list[str]:
    return [p for name in NAMES for p in paths[name]]


# --------------------------------------------------------------------------- quern


def transforms(pipe: quern.Pipeline) -> quern.Pipeline:
    return pipe.map(quern.transforms.decode(np.int32)).map(quern.transforms.pad(SEQ_LEN))


def component(files: list[str], seed: int) -> quern.Pipeline:
    return quern.Pipeline.from_source(quern.sources.ArrayRecordSource(files), seed=seed).shuffle()


def quern_mix(paths: dict[str, list[str]], transforms_in_components: bool = False) -> quern.Pipeline:
    """The scheduled mixture, transforms after ``mix`` (or in each component), batch 256."""
    comps = {name: component(paths[name], seed=1 + k) for k, name in enumerate(NAMES)}
    if transforms_in_components:
        return quern.mix({n: transforms(c) for n, c in comps.items()}, schedule=SCHEDULE, seed=0).batch(BATCH)
    return transforms(quern.mix(comps, schedule=SCHEDULE, seed=0)).batch(BATCH)


def quern_single(paths: dict[str, list[str]]) -> quern.Pipeline:
    """One source over all the files (the same total records), the same transforms."""
    return transforms(component(all_files(paths), seed=0)).batch(BATCH)


def quern_iterator(make: Callable[[], quern.Pipeline], **kwargs: Any) -> Callable[[], Any]:
    def start() -> Any:
        return common.started(make().iterator(**kwargs))

    return start


class BulkLoop:
    """``pipe.batches_at(step, 16)`` in a plain loop, one batch per ``next()``: no
    thread, no prefetch, the work of the steps only."""

    def __init__(self, pipe: quern.Pipeline, count: int = 16) -> None:
        self.pipe, self.count, self.step, self.ready = pipe, count, 0, []

    def __iter__(self) -> BulkLoop:
        return self

    def __next__(self) -> Any:
        if not self.ready:
            self.ready = self.pipe.batches_at(self.step, self.count)
            self.step += self.count
        return self.ready.pop(0)


# --------------------------------------------------------------------------- grain


def decode_pad(record: bytes) -> dict:
    """grain's per-record transform: bytes -> padded int32 tokens + length (quern's decode + pad)."""
    return common.decode_pad(record, SEQ_LEN)


def grain_read_options(threads: bool):
    import grain

    return None if threads else grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def grain_components(paths: dict[str, list[str]]) -> list:
    import grain

    return [
        grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths[name])).shuffle(seed=1 + k).repeat()
        for k, name in enumerate(NAMES)
    ]


def grain_map_mix(paths: dict[str, list[str]], threads: bool) -> Callable[[], Iterator]:
    import grain

    def start() -> Iterator:
        ds = grain.MapDataset.mix(grain_components(paths), [W0[n] for n in NAMES])
        ds = ds.map(decode_pad).batch(BATCH, drop_remainder=True)
        return iter(ds.to_iter_dataset(grain_read_options(threads)))

    return start


def grain_iter_mix(paths: dict[str, list[str]], threads: bool) -> Callable[[], Iterator]:
    import grain

    def start() -> Iterator:
        comps = [c.to_iter_dataset(grain_read_options(threads)) for c in grain_components(paths)]
        ds = grain.IterDataset.mix(comps, [W0[n] for n in NAMES])
        return iter(ds.map(decode_pad).batch(BATCH, drop_remainder=True))

    return start


def grain_single(paths: dict[str, list[str]], threads: bool) -> Callable[[], Iterator]:
    import grain

    def start() -> Iterator:
        ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(all_files(paths))).shuffle(seed=0).repeat()
        ds = ds.map(decode_pad).batch(BATCH, drop_remainder=True)
        return iter(ds.to_iter_dataset(grain_read_options(threads)))

    return start


# --------------------------------------------------------------------------- throughput

Q_SINGLE = "quern single source, iterator()"
Q_MIX = "quern mix (schedule), iterator()"
Q_MIX_IN = "quern mix (schedule), transforms in components, iterator()"
Q_SINGLE_W2 = "quern single source, iterator(num_workers=2)"
Q_MIX_W2 = "quern mix (schedule), iterator(num_workers=2)"
Q_SINGLE_LOOP = "quern single source, batches_at(step, 16) loop"
Q_MIX_LOOP = "quern mix (schedule), batches_at(step, 16) loop"
G_SINGLE = "grain single source, to_iter_dataset()"
G_SINGLE_0 = "grain single source, to_iter_dataset(0 threads)"
G_MAP = "grain MapDataset.mix (W0), to_iter_dataset()"
G_MAP_0 = "grain MapDataset.mix (W0), to_iter_dataset(0 threads)"
G_ITER = "grain IterDataset.mix (W0), components to_iter_dataset()"
G_ITER_0 = "grain IterDataset.mix (W0), components to_iter_dataset(0 threads)"


def configs(paths: dict[str, list[str]], workers: bool) -> list[tuple[str, Callable[[], Any]]]:
    out = [
        (Q_SINGLE, quern_iterator(lambda: quern_single(paths))),
        (Q_MIX, quern_iterator(lambda: quern_mix(paths))),
        (Q_MIX_IN, quern_iterator(lambda: quern_mix(paths, transforms_in_components=True))),
        (Q_SINGLE_LOOP, lambda: BulkLoop(quern_single(paths))),
        (Q_MIX_LOOP, lambda: BulkLoop(quern_mix(paths))),
    ]
    if workers:
        out += [
            (Q_SINGLE_W2, quern_iterator(lambda: quern_single(paths), num_workers=2)),
            (Q_MIX_W2, quern_iterator(lambda: quern_mix(paths), num_workers=2)),
        ]
    out += [
        (G_SINGLE, grain_single(paths, threads=True)),
        (G_SINGLE_0, grain_single(paths, threads=False)),
        (G_MAP, grain_map_mix(paths, threads=True)),
        (G_MAP_0, grain_map_mix(paths, threads=False)),
        (G_ITER, grain_iter_mix(paths, threads=True)),
        (G_ITER_0, grain_iter_mix(paths, threads=False)),
    ]
    return out


def one_run(start: Callable[[], Any], args: argparse.Namespace) -> float:
    """Records/s of one run: a fresh iterator, warm-up batches, then the timed batches."""
    it = start()
    try:
        for _ in range(args.warmup):
            batch = next(it)
            assert batch["tokens"].shape == (BATCH, SEQ_LEN), batch["tokens"].shape
        return common.rate(it.__next__, args.min_seconds, args.batches) * BATCH
    finally:
        common.close(it)


def measure(paths: dict[str, list[str]], args: argparse.Namespace) -> dict[str, list[float]]:
    selected = [c for c in configs(paths, args.workers) if not args.only or args.only in c[0]]
    errors: dict[str, str] = {}
    runs = [(name, lambda start=start: one_run(start, args)) for name, start in selected]
    rates = common.interleaved(runs, args.runs, errors=errors, progress=True)
    return {name: r for name, r in rates.items() if r and name not in errors}


def print_throughput(rates: dict[str, list[float]]) -> dict[str, float]:
    med = {name: statistics.median(r) for name, r in rates.items()}
    print()
    common.print_table(
        ["config", "records/s", "vs quern mix", "runs"],
        [
            [name, f"{med[name]:,.0f}", common.ratio(med[name], med.get(Q_MIX)), common.join_runs(r)]
            for name, r in rates.items()
        ],
        left=(0, 3),
    )

    def cost(mix: str, single: str) -> None:
        if mix in med and single in med:
            pct = 100.0 * (1.0 - med[mix] / med[single])
            print(f"  {mix} / {single}: {common.ratio(med[mix], med[single])} (cost of mixing {pct:+.1f}%)")

    print("\ncost of mixing (1 - mix / single source of the same total size; goal for quern: under 5%):")
    cost(Q_MIX, Q_SINGLE)
    cost(Q_MIX_IN, Q_SINGLE)
    cost(Q_MIX_LOOP, Q_SINGLE_LOOP)
    cost(Q_MIX_W2, Q_SINGLE_W2)
    cost(G_MAP, G_SINGLE)
    cost(G_MAP_0, G_SINGLE_0)
    cost(G_ITER, G_SINGLE)
    cost(G_ITER_0, G_SINGLE_0)
    grain_mixes = [n for n in (G_MAP, G_MAP_0, G_ITER, G_ITER_0) if n in med]
    print("\nquern / grain (one process each; grain with constant weights W0, quern with the schedule):")
    for q in (Q_MIX, Q_MIX_IN):
        for g in grain_mixes:
            if q in med:
                print(f"  {q} / {g}: {common.ratio(med[q], med[g])}")
    if grain_mixes and Q_MIX in med:
        best = max(grain_mixes, key=lambda n: med[n])
        print(f"  quern mix / grain's best mix ({best}): {common.ratio(med[Q_MIX], med[best])}")
    if Q_MIX_W2 in med and Q_MIX in med:
        print(f"  quern mix num_workers=2 / num_workers=0: {common.ratio(med[Q_MIX_W2], med[Q_MIX])}")
    return med


# --------------------------------------------------------------------------- proportions


def deviations(comp: np.ndarray, weights: np.ndarray, stage_of_step: np.ndarray) -> dict[str, Any]:
    """``comp``: (steps, BATCH) component indices; ``weights``: (stages, C); per stage
    and over all steps: the largest |count / rows - w| per step, per block of 4 steps
    (1,024 positions) and of the total."""
    steps, rows = comp.shape
    C = weights.shape[1]
    counts = np.stack([(comp == c).sum(axis=1) for c in range(C)], axis=1)  # (steps, C)
    w = weights[stage_of_step]  # (steps, C)
    per_step = np.abs(counts / rows - w)
    out: dict[str, Any] = {"stages": []}
    for t in range(weights.shape[0]):
        sel = np.flatnonzero(stage_of_step == t)
        if not sel.size:
            continue
        c = counts[sel]
        nblocks = len(sel) // 4
        blocks = c[: nblocks * 4].reshape(nblocks, 4, C).sum(axis=1) if nblocks else np.zeros((0, C))
        block_dev = float(np.abs(blocks / (4 * rows) - weights[t]).max()) if nblocks else float("nan")
        total = c.sum(axis=0)
        out["stages"].append(
            {
                "stage": t,
                "steps": [int(sel[0]), int(sel[-1])],
                "weights": weights[t].tolist(),
                "drawn": (total / total.sum()).tolist(),
                "max_step_deviation": float(per_step[sel].max()),
                "max_block_deviation": block_dev,
                "total_deviation": float(np.abs(total / total.sum() - weights[t]).max()),
            }
        )
    expected = (w * rows).sum(axis=0)
    total = counts.sum(axis=0)
    out["all_steps"] = {
        "max_step_deviation": float(per_step.max()),
        "total_deviation": float(np.abs(total - expected).max() / (steps * rows)),
        "drawn": (total / total.sum()).tolist(),
        "expected": (expected / expected.sum()).tolist(),
    }
    return out


def print_deviations(label: str, d: dict[str, Any]) -> None:
    print(f"  {label}:")
    for s in d["stages"]:
        drawn = ", ".join(f"{n} {x:.4f}" for n, x in zip(NAMES, s["drawn"]))
        print(
            f"    stage {s['stage']} (steps {s['steps'][0]}-{s['steps'][1]}, weights "
            f"{', '.join(f'{x:g}' for x in s['weights'])}): max |count/256 - w| per step "
            f"{s['max_step_deviation']:.4f}, per block of 1,024 positions {s['max_block_deviation']:.4f}, "
            f"stage total {s['total_deviation']:.5f} (drawn {drawn})"
        )
    a = d["all_steps"]
    print(
        f"    all {PROPORTION_STEPS:,} steps: max per-step deviation {a['max_step_deviation']:.4f}, "
        f"deviation of the totals from the schedule's {a['total_deviation']:.5f}"
    )


def quern_proportions(paths: dict[str, list[str]]) -> dict[str, Any]:
    pipe = quern_mix(paths)
    t0 = time.perf_counter()
    positions = np.concatenate([pipe.positions(s) for s in range(PROPORTION_STEPS)])
    seg = pipe.segments(positions)
    elapsed = time.perf_counter() - t0
    # segments agrees with explain (the same plan): a spot check at the switch
    names, rows = pipe.leaf_names, slice(SWITCH * BATCH, (SWITCH + 1) * BATCH)
    named = [[(names[c], i)] for c, i in zip(seg.component[rows].tolist(), seg.ids[rows].tolist())]
    assert named == pipe.explain(SWITCH)
    weights = np.asarray([[W0[n] for n in NAMES], [W1[n] for n in NAMES]])
    stage_of_step = (np.arange(PROPORTION_STEPS) >= SWITCH).astype(np.int64)
    d = deviations(seg.component.reshape(PROPORTION_STEPS, BATCH), weights, stage_of_step)
    d["seconds"] = elapsed
    sizes = [len(c.source) for c in pipe.leaves]
    d["epochs_drawn"] = [float(seg.positions[seg.component == c].max(initial=-1) + 1) / sizes[c] for c in range(3)]
    return d


def grain_proportions() -> dict[str, Any]:
    """grain's two mixes over labelled ranges (component c yields c * 10**9 + i), no reads."""
    import grain

    n = PROPORTION_STEPS * BATCH
    w = [W0[name] for name in NAMES]
    ranges = [grain.MapDataset.range(c * 10**9, c * 10**9 + n) for c in range(len(NAMES))]
    out = {}
    t0 = time.perf_counter()
    m = grain.MapDataset.mix(ranges, w)
    labels = np.fromiter((m[i] for i in range(n)), np.int64, n) // 10**9
    out["MapDataset.mix"] = labels
    opts = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    it = iter(grain.IterDataset.mix([r.to_iter_dataset(opts) for r in ranges], w))
    out["IterDataset.mix"] = np.fromiter((next(it) for _ in range(n)), np.int64, n) // 10**9
    elapsed = time.perf_counter() - t0
    weights = np.asarray([w])
    res = {
        k: deviations(v.reshape(PROPORTION_STEPS, BATCH), weights, np.zeros(PROPORTION_STEPS, np.int64))
        for k, v in out.items()
    }
    res["same_order"] = bool(np.array_equal(out["MapDataset.mix"], out["IterDataset.mix"]))
    res["seconds"] = elapsed
    return res


# --------------------------------------------------------------------------- filter


class KeepMod:
    """Keep ``x % 10 < KEEP_BELOW``: a plain predicate with a vectorised ``keep_many``."""

    def __call__(self, record: dict) -> bool:
        return bool(record["x"] % 10 < KEEP_BELOW)

    def keep_many(self, records: list) -> np.ndarray:
        x = np.fromiter((r["x"] for r in records), dtype=np.int64, count=len(records))
        return x % 10 < KEEP_BELOW


def keep_mod(record: dict) -> bool:
    """The same predicate as a plain function (called per record)."""
    return bool(record["x"] % 10 < KEEP_BELOW)


def filtered(n: int, cache_dir: str, pred: Any = None, workers: int | None = None) -> quern.Pipeline:
    src = quern.sources.ArraySource({"x": np.arange(n, dtype=np.int64)}, name="x")
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle()
    return pipe.filter(KeepMod() if pred is None else pred, cache_dir=cache_dir, workers=workers).batch(BATCH)


def child_first_batch(mode: str, n: int, cache_dir: str) -> dict:
    """In a fresh process: the seconds to build the pipeline (with ``mode == "filter"``:
    a warm-cache filter; a scan would raise) and to its first batch."""
    arr = np.arange(n, dtype=np.int64)  # the data exists before the clock starts
    if mode == "filter":
        from quern.pipeline.definition import scan

        def no_scan(*a: Any, **k: Any) -> Any:
            raise AssertionError("the filter scanned: the cache was not used")

        scan.keep_mask = no_scan
        scan._scan_in_processes = no_scan
    t0 = time.perf_counter()
    pipe = quern.Pipeline.from_source(quern.sources.ArraySource({"x": arr}, name="x"), seed=0).shuffle()
    if mode == "filter":
        pipe = pipe.filter(KeepMod(), cache_dir=cache_dir)
    pipe = pipe.batch(BATCH)
    t1 = time.perf_counter()
    with pipe.iterator() as it:
        batch = next(it)
    t2 = time.perf_counter()
    assert batch["x"].shape == (BATCH,)
    if mode == "filter":
        assert bool(np.all(batch["x"] % 10 < KEEP_BELOW))
    return {"build": t1 - t0, "first_batch": t2 - t1, "total": t2 - t0, "stream_len": pipe.stream_len}


def run_child(mode: str, n: int, cache_dir: str) -> dict:
    t0 = time.perf_counter()
    res = common.run_child(__file__, [mode, n, cache_dir])
    res["process"] = time.perf_counter() - t0
    return res


def filter_bench(n: int) -> dict[str, Any]:
    workers = os.cpu_count() or 1
    out: dict[str, Any] = {"n": n, "workers": workers, "kept_fraction": KEEP_BELOW / 10}
    with tempfile.TemporaryDirectory(prefix="quern-mixture-bench-") as tmp:
        # one process at 10**6: the per-record cost of a scan, with keep_many and with a plain function
        small = 10**6
        per_proc = {}
        for label, pred in (("keep_many", KeepMod()), ("plain function", keep_mod)):
            t0 = time.perf_counter()
            filtered(small, os.path.join(tmp, f"small-{label}"), pred, workers=1)
            per_proc[label] = small / (time.perf_counter() - t0)
            print(f"  scan of {small:,} records in 1 process, {label}: {per_proc[label]:,.0f} records/s")
        out["one_process_rate_1e6"] = per_proc
        estimate = n / (per_proc["keep_many"] * workers)
        print(f"  estimated cold scan at N = {n:,} with {workers} scan processes: {estimate:.0f} s (rate x processes)")
        cache = os.path.join(tmp, "cache")
        if estimate <= MAX_COLD_SCAN:
            t0 = time.perf_counter()
            pipe = filtered(n, cache)
            cold = time.perf_counter() - t0
            out.update(cold_seconds=cold, cold_rate=n / cold, cold_extrapolated=False, survivors=pipe.stream_len)
            print(
                f"  cold build at N = {n:,} (source + filter: scan in {workers} processes, cache written): "
                f"{cold:.1f} s = {n / cold:,.0f} records/s; {pipe.stream_len:,} kept"
            )
            warm_n = n
        else:
            out.update(cold_seconds=estimate, cold_rate=n / estimate, cold_extrapolated=True)
            print(
                f"  cold scan at N = {n:,} SKIPPED: EXTRAPOLATED {estimate:.0f} s = {n / estimate:,.0f} records/s "
                f"from the 1-process rate at {small:,} x {workers} processes; warm figures below at {small:,}"
            )
            warm_n = small
            filtered(warm_n, cache)
        out["warm_n"] = warm_n
        t0 = time.perf_counter()
        pipe = filtered(warm_n, cache)
        out["warm_build_seconds"] = time.perf_counter() - t0
        src = quern.sources.ArraySource({"x": np.arange(warm_n, dtype=np.int64)}, name="x")
        t0 = time.perf_counter()
        src.identity()  # the content hash of the source, part of the cache key
        out["warm_identity_seconds"] = time.perf_counter() - t0
        print(
            f"  warm build at N = {warm_n:,} in this process (source + filter, cache hit): "
            f"{out['warm_build_seconds'] * 1e3:,.0f} ms, of which {out['warm_identity_seconds'] * 1e3:,.0f} ms "
            "hash the in-memory source's content (the cache key), the rest load and verify the survivors"
        )
        firsts: dict[str, list[dict]] = {"filter": [], "plain": []}
        for _ in range(3):
            for mode in firsts:
                firsts[mode].append(run_child(mode, warm_n, cache))
        for mode, runs in firsts.items():
            build = statistics.median(r["build"] for r in runs)
            first = statistics.median(r["first_batch"] for r in runs)
            total = statistics.median(r["total"] for r in runs)
            out[f"first_batch_{mode}"] = {"build": build, "first_batch": first, "total": total, "runs": runs}
            what = "with the filter (warm cache)" if mode == "filter" else "without a filter"
            print(
                f"  time to first batch in a fresh process at N = {warm_n:,}, {what}: {total * 1e3:,.0f} ms "
                f"(source + pipeline {build * 1e3:,.0f} ms, iterator + first batch {first * 1e3:,.0f} ms; "
                f"median of 3; stream {runs[0]['stream_len']:,} records)"
            )
        extra = out["first_batch_filter"]["total"] - out["first_batch_plain"]["total"]
        out["filter_first_batch_extra"] = extra
        print(
            f"  the warm filter adds {extra * 1e3:,.0f} ms to the first batch (cache load + verification + "
            "the source's content hash that keys it)"
        )
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=60_000, help="records per component (default 60000)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per config (default 3)")
    ap.add_argument("--batches", type=int, default=20, help="at least this many timed batches per run (default 20)")
    ap.add_argument("--min-seconds", type=float, default=2.0, help="at least this long per timed run (default 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches per run (default 2)")
    ap.add_argument("--only", default=None, help="only the throughput configs whose name contains this")
    ap.add_argument(
        "--workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time quern with num_workers=2 (default: yes)",
    )
    ap.add_argument("--filter-n", type=int, default=10**7, help="records of the filter benchmark (default 10**7)")
    ap.add_argument("--no-filter", action="store_true", help="skip the filter benchmark")
    args = common.parse_args(ap, child=child_first_batch)
    if args is None:
        return

    grain_version = importlib.metadata.version("grain")
    t_start = common.begin(grain=grain_version)
    paths = make_data(args.records)
    nbytes = common.warm_page_cache(all_files(paths))
    print(
        f"data: {len(NAMES)} components x {args.records:,} records ({SHARDS} shards each, lengths "
        f"{', '.join(f'{n} {lo}..{hi}' for n, (lo, hi) in LENGTHS.items())}), {nbytes / 2**20:.0f} MiB on disk, "
        "page cache warmed"
    )
    print(f"schedule: W0 = {W0} from step 0, W1 = {W1} from step {SWITCH}; grain: W0 throughout (no schedule)")
    figures: dict[str, Any] = {
        "grain": grain_version,
        "quern": quern.__version__,
        "cpus": os.cpu_count(),
        "records_per_component": args.records,
        "schedule": SCHEDULE,
    }

    # a light correctness check: the mixture's batch at the switch holds the records explain() names
    pipe = quern_mix(paths)
    b = pipe.batch_at(SWITCH)
    readers = {n: quern.sources.ArrayRecordSource(paths[n]) for n in NAMES}
    for row, ((name, rid),) in enumerate(pipe.explain(SWITCH)[:32]):
        raw = np.frombuffer(readers[name].read_many(np.asarray([rid]))[0], np.int32)[:SEQ_LEN]
        assert np.array_equal(b["tokens"][row, : len(raw)], raw) and b["length"][row] == len(raw), (row, name, rid)
    print(f"check: step {SWITCH} of the mixture holds the records explain() names (32 rows checked)")

    print(
        f"\nthroughput: one process each (quern num_workers=0: 1 background thread, 16 steps per bulk read; grain "
        f"without mp_prefetch){'; quern also with 2 workers' if args.workers else ''}. Per config and run: a fresh "
        f"iterator, {args.warmup} warm-up batches, then >= {args.batches} batches and >= {args.min_seconds:g} s; "
        f"{args.runs} runs, configs in turn; median records/s"
    )
    rates = measure(paths, args)
    med = print_throughput(rates)
    figures["throughput"] = {"median": med, "runs": rates}

    print(f"\nproportions over {PROPORTION_STEPS:,} steps of {BATCH} (from pipe.segments(positions), no reads):")
    qp = quern_proportions(paths)
    print_deviations(f"quern mix (schedule, switch at step {SWITCH}; plan computed in {qp['seconds']:.2f} s)", qp)
    print(
        "    epochs drawn per component over the 1,000 steps: "
        + ", ".join(f"{n} {e:.2f}" for n, e in zip(NAMES, qp["epochs_drawn"]))
    )
    gp = grain_proportions()
    for k in ("MapDataset.mix", "IterDataset.mix"):
        print_deviations(f"grain {k} (W0 throughout: grain has no schedule)", gp[k])
    print(f"    grain's two mixes draw the components in the same order: {gp['same_order']}")
    figures["proportions"] = {"quern": qp, "grain": gp}

    if not args.no_filter:
        print(f"\nfilter: in-memory {{'x': arange(N)}}, keep x % 10 < {KEEP_BELOW} (keep_many), cache in a temp dir")
        figures["filter"] = filter_bench(args.filter_n)

    figures["total_seconds"] = time.perf_counter() - t_start
    print(f"\ntotal time {figures['total_seconds']:.0f}s")
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
