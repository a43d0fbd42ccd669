"""quern vs grain vs raw ArrayRecord: throughput of one token pipeline.

What is measured
----------------
One pipeline, built three ways over the same synthetic data:

    ArrayRecord shards -> global shuffle -> decode bytes to int32
    -> pad (0) / truncate to 512 -> {"tokens": (512,) int32, "length": int32}
    -> batch 256

* ``raw ArrayRecordReader`` -- the limit: the shuffled record ids of 1 batch
  (or of 16 consecutive batches) are grouped by file and read with one
  ``reader.read(list)`` per file (readers opened with
  ``readahead_buffer_size:0,max_parallelism:0``), then each batch is decoded
  and padded into one preallocated block with NumPy. Larger calls amortise the
  reader's per-call cost (and its internal parallelism), so the 16-batch figure
  is the limit quern is held to. The ids are
  quern's own shuffled ids, precomputed outside the timed region, so raw and
  quern read exactly the same records.
* ``grain`` -- ``MapDataset.source(ArrayRecordDataSource).shuffle(seed=0)
  .map(decode_pad).batch(256)`` read by index (``ds[i]``), through
  ``to_iter_dataset()`` with several ``ReadOptions`` (``num_threads=0`` reads in
  the calling thread), with ``mp_prefetch`` (2 worker processes), and through
  the classic ``grain.DataLoader(IndexSampler(shuffle=True), [Map, Batch])``
  with 0 and 2 workers, each at grain's defaults and tuned. grain's own
  shuffle gives a different (equally random) order; the work per record is
  the same. The fastest of them is "grain-best".
* ``quern`` -- ``Pipeline.from_source(ArrayRecordSource, seed=0).shuffle()
  .map(decode(int32)).map(pad(512)).batch(256)``: ``pipe.iterator()`` with its
  defaults (one process, 1 background thread, the records of 16 steps read in
  one bulk call per file), with 2 threads, with one read per step
  (``read_ahead=1``), plus ``pipe.batch_at(step)`` in a plain loop (no
  threads). The fastest is "quern".

Every config: one iterator, ``--warmup`` batches untimed, then ``--runs``
consecutive timed runs, each at least ``--batches`` batches and at least
``--min-seconds`` long (so batches prefetched before the clock starts weigh
little); the reported figure is the median records/s over the runs. The files are read once before measuring, so
the page cache is warm. Also reported: time to the first batch for quern
(fresh source + pipeline + iterator) from step 0 and after resuming at step
10**7, the same for grain's MapDataset by index, and peak RSS of this process
and of its (multiprocessing) children, each measured separately by
``getrusage`` (RUSAGE_CHILDREN is the largest single waited-for child).

A light correctness check runs first: the quern batch at step 0 has shape
(256, 512), and the raw and quern outputs at step 0 hold the same multiset of
lengths as decoding the records ``pipe.explain(0)`` names (and identical
tokens), so every config does real work.

Data
----
``--records`` (default 200,000) records of int32 tokens, lengths uniform in
64..512, values uniform in [1, 32000), fixed NumPy seed, written as 8
ArrayRecord shards with ``ArrayRecordWriter(path, "group_size:1")`` (default
zstd compression) under ``benchmarks/data/vs_grain/`` (git-ignored). The data
are regenerated when missing or when ``--records`` differs from the cached set.

Run
---
    .venv/bin/python benchmarks/vs_grain.py            # full run, a few minutes on 2 cores
    .venv/bin/python benchmarks/vs_grain.py --quick    # fewer batches, 3 runs
    .venv/bin/python benchmarks/vs_grain.py --records 50000 --batches 60 --runs 5
    .venv/bin/python benchmarks/vs_grain.py --only quern  # configs whose name contains "quern"

A config that raises prints a FAILED line (set VS_GRAIN_TRACEBACK=1 for the
traceback) and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import grain
import numpy as np

import quern

SEQ_LEN = 512
BATCH = 256
NUM_SHARDS = 8
MIN_LEN, MAX_LEN = 64, 512
DATA_SEED = 20240601
VOCAB = 32000
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
RESUME_STEP = 10**7
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vs_grain")


# --------------------------------------------------------------------------- data


def make_data(num_records: int) -> list[str]:
    """Write (or reuse) the synthetic shards; return their paths in order."""
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = [os.path.join(DATA_DIR, f"tokens-{i:05d}-of-{NUM_SHARDS:05d}.array_record") for i in range(NUM_SHARDS)]
    meta_path = os.path.join(DATA_DIR, "meta.json")
    meta = {"records": num_records, "shards": NUM_SHARDS, "seed": DATA_SEED, "lengths": [MIN_LEN, MAX_LEN],
            "vocab": VOCAB, "dtype": "int32", "writer_options": "group_size:1", "format": 1}
    try:
        with open(meta_path) as f:
            if json.load(f) == meta and all(os.path.exists(p) for p in paths):
                return paths
    except (OSError, ValueError):
        pass
    print(f"generating {num_records:,} records in {NUM_SHARDS} shards under {DATA_DIR} ...", flush=True)
    t0 = time.perf_counter()
    os.makedirs(DATA_DIR, exist_ok=True)
    if os.path.exists(meta_path):
        os.remove(meta_path)
    rng = np.random.default_rng(DATA_SEED)
    bounds = np.linspace(0, num_records, NUM_SHARDS + 1).astype(np.int64)
    for k, path in enumerate(paths):
        n = int(bounds[k + 1] - bounds[k])
        lengths = rng.integers(MIN_LEN, MAX_LEN + 1, size=n)
        tokens = rng.integers(1, VOCAB, size=int(lengths.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        writer = ArrayRecordWriter(path, "group_size:1")
        for i in range(n):
            writer.write(tokens[offsets[i] : offsets[i + 1]].tobytes())
        writer.close()
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    print(f"  done in {time.perf_counter() - t0:.1f}s", flush=True)
    return paths


def warm_page_cache(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


# --------------------------------------------------------------------------- shared transform


def decode_pad(record: bytes) -> dict:
    """The per-record transform used by grain: bytes -> padded int32 tokens + length."""
    arr = np.frombuffer(record, dtype=np.int32)
    n = min(arr.size, SEQ_LEN)
    tokens = np.zeros(SEQ_LEN, dtype=np.int32)
    tokens[:n] = arr[:n]
    return {"tokens": tokens, "length": np.int32(n)}


class DecodePad(grain.transforms.Map):
    """``decode_pad`` as a grain transform (for ``grain.DataLoader`` operations)."""

    def map(self, element: bytes) -> dict:
        return decode_pad(element)


# --------------------------------------------------------------------------- raw ArrayRecord (the limit)


class RawReader:
    """Batches straight from ``ArrayRecordReader.read(list)``: one call per file per batch."""

    def __init__(self, paths: list[str]):
        from array_record.python.array_record_module import ArrayRecordReader

        self.readers = [ArrayRecordReader(p, READER_OPTIONS) for p in paths]
        counts = [r.num_records() for r in self.readers]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def read(self, ids: np.ndarray) -> list[bytes]:
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        order = np.argsort(file_of, kind="stable")
        sorted_files = file_of[order]
        cuts = np.flatnonzero(np.diff(sorted_files)) + 1
        out: list = [None] * len(ids)
        for where in np.split(order, cuts):
            f = int(file_of[where[0]])
            records = self.readers[f].read((ids[where] - self.starts[f]).tolist())
            for k, rec in zip(where.tolist(), records):
                out[k] = rec
        return out

    def batches(self, ids: np.ndarray) -> list[dict]:
        """Several batches' ids read with one call per file, then padded batch by batch."""
        records = self.read(ids)
        return [self.pad(records[i : i + BATCH]) for i in range(0, len(records), BATCH)]

    def batch(self, ids: np.ndarray) -> dict:
        return self.pad(self.read(ids))

    def pad(self, records: list[bytes]) -> dict:
        tokens = np.zeros((len(records), SEQ_LEN), dtype=np.int32)
        lengths = np.empty(len(records), dtype=np.int32)
        for i, rec in enumerate(records):
            arr = np.frombuffer(rec, dtype=np.int32)
            n = min(arr.size, SEQ_LEN)
            tokens[i, :n] = arr[:n]
            lengths[i] = n
        return {"tokens": tokens, "length": lengths}


# --------------------------------------------------------------------------- builders


def quern_pipeline(paths: list[str]):
    src = quern.sources.ArrayRecordSource(paths)
    return (
        quern.Pipeline.from_source(src, seed=0)
        .shuffle()
        .map(quern.transforms.decode(np.int32))
        .map(quern.transforms.pad(SEQ_LEN))
        .batch(BATCH)
    )


def grain_map_dataset(paths: list[str], batched: bool = True, repeat: bool = False):
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).shuffle(seed=0)
    if repeat:  # only when one epoch has fewer batches than the benchmark needs
        ds = ds.repeat()
    ds = ds.map(decode_pad)
    return ds.batch(BATCH, drop_remainder=True) if batched else ds


class Stepper:
    """A ``next()``-style callable over ``fn(step)`` for step = 0, 1, 2, ..."""

    def __init__(self, fn: Callable[[int], Any]):
        self.fn, self.step = fn, 0

    def __call__(self) -> Any:
        out = self.fn(self.step)
        self.step += 1
        return out


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


# --------------------------------------------------------------------------- measurement


def measure(make: Callable[[], tuple[Callable[[], Any], Any]], args) -> tuple[float, list[float]]:
    """Median records/s over ``args.runs`` timed runs; a run is at least ``args.batches``
    batches and at least ``args.min_seconds`` long, so that batches prefetched before
    the clock starts weigh little."""
    next_batch, handle = make()
    try:
        for _ in range(args.warmup):
            b = next_batch()
        assert b["tokens"].shape == (BATCH, SEQ_LEN) and b["tokens"].dtype == np.int32, b["tokens"].shape
        rates = []
        for _ in range(args.runs):
            n, t0 = 0, time.perf_counter()
            while n < args.batches or time.perf_counter() - t0 < args.min_seconds:
                next_batch()
                n += 1
            rates.append(n * BATCH / (time.perf_counter() - t0))
    finally:
        _close(handle)
    return statistics.median(rates), rates


def configs(paths: list[str], raw_ids: np.ndarray, args) -> list[tuple[str, str, Callable]]:
    """(group, name, make) where ``make() -> (next_batch, closeable)``."""
    repeat = True  # runs are time-bounded and may pass an epoch; grain's MapDataset batches do not cross epochs
    out = []

    # 1. the limit
    def raw():
        reader = RawReader(paths)
        steps = len(raw_ids) // BATCH
        return Stepper(lambda s: reader.batch(raw_ids[s % steps * BATCH : (s % steps + 1) * BATCH])), None

    def raw_bulk(k: int):
        def make():
            reader = RawReader(paths)
            pending: list = []

            def next_batch(state={"step": 0}):
                if not pending:
                    s = state["step"] % (len(raw_ids) // BATCH // k) * k
                    pending.extend(reader.batches(raw_ids[s * BATCH : (s + k) * BATCH]))
                    state["step"] += 1
                return pending.pop(0)

            return next_batch, None

        return make

    out.append(("raw", "raw ArrayRecordReader.read(list) + numpy pad, 1 batch per call", raw))
    out.append(("raw", "raw ArrayRecordReader.read(list) + numpy pad, 16 batches per call", raw_bulk(16)))

    # 2. grain
    def g_index():
        ds = grain_map_dataset(paths, repeat=repeat)
        return Stepper(lambda s: ds[s]), None

    def g_iter(read_options=None, batched=True, workers=None, worker_buffer=1):
        def make():
            ds = grain_map_dataset(paths, batched=batched, repeat=repeat)
            it_ds = ds.to_iter_dataset(read_options)  # None: grain's default ReadOptions
            if not batched:
                it_ds = it_ds.batch(BATCH, drop_remainder=True)
            if workers is not None:
                it_ds = it_ds.mp_prefetch(
                    grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=worker_buffer)
                )
            it = iter(it_ds)
            return it.__next__, it

        return make

    def g_loader(workers: int, read_options=None, worker_buffer=1):
        def make():
            source = grain.sources.ArrayRecordDataSource(paths)
            loader = grain.DataLoader(
                data_source=source,
                sampler=grain.samplers.IndexSampler(
                    num_records=len(source), shard_options=grain.sharding.NoSharding(), shuffle=True, seed=0,
                    num_epochs=None if repeat else 1,
                ),
                operations=[DecodePad(), grain.transforms.Batch(BATCH, drop_remainder=True)],
                worker_count=workers,
                worker_buffer_size=worker_buffer,
                read_options=read_options,
            )
            it = iter(loader)
            return it.__next__, getattr(it, "_iterator", None)  # the DatasetIterator underneath has close()

        return make

    # ReadOptions(num_threads=0) means "no reader threads": records are read in the calling thread.
    no_threads = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    threads = lambda n, buf: grain.ReadOptions(num_threads=n, prefetch_buffer_size=buf)  # noqa: E731
    out += [
        ("grain", "grain MapDataset ds[i]", g_index),
        ("grain", "grain .batch().to_iter_dataset()  [default: 16 threads]", g_iter()),
        ("grain", "grain .batch().to_iter_dataset(4 threads)", g_iter(threads(4, 8))),
        ("grain", "grain .batch().to_iter_dataset(2 threads)", g_iter(threads(2, 4))),
        ("grain", "grain .to_iter_dataset(0 threads).batch()", g_iter(no_threads, batched=False)),
        ("grain", "grain .to_iter_dataset(2 threads).batch()", g_iter(threads(2, 2 * BATCH), batched=False)),
        ("grain", "grain .batch().to_iter_dataset().mp_prefetch(2 workers)", g_iter(workers=2)),
        ("grain", "grain .batch().to_iter_dataset(0 thr).mp_prefetch(2 workers, buf 4)",
         g_iter(no_threads, workers=2, worker_buffer=4)),
        ("grain", "grain DataLoader(worker_count=0)", g_loader(0)),
        ("grain", "grain DataLoader(worker_count=0, 0 read threads)", g_loader(0, no_threads)),
        ("grain", "grain DataLoader(worker_count=2)", g_loader(2)),
        ("grain", "grain DataLoader(worker_count=2, 0 read threads, buf 4)", g_loader(2, no_threads, 4)),
    ]

    # 3. quern, single process
    def q_iter(**kwargs):
        def make():
            it = quern_pipeline(paths).iterator(start_step=0, **kwargs)
            return it.__next__, it

        return make

    def q_batch_at():
        pipe = quern_pipeline(paths)
        return Stepper(pipe.batch_at), None

    out += [
        ("quern", "quern iterator() [defaults: 1 thread, read_ahead 16]", q_iter()),
        ("quern", "quern iterator(num_threads=2)", q_iter(num_threads=2)),
        ("quern", "quern iterator(read_ahead=1) [one read per step]", q_iter(read_ahead=1)),
        ("quern-loop", "quern batch_at(step) loop (no threads)", q_batch_at),
    ]
    return out


def check_correctness(paths: list[str], raw_ids: np.ndarray) -> None:
    """Cheap sanity check that raw and quern do the real work on the same records."""
    from array_record.python.array_record_module import ArrayRecordReader

    pipe = quern_pipeline(paths)
    named = pipe.explain(0)
    assert len(named) == BATCH and all(len(row) == 1 for row in named)
    ids = np.asarray([row[0][1] for row in named], dtype=np.int64)
    assert np.array_equal(ids, raw_ids[:BATCH]), "raw benchmark ids differ from pipe.explain(0)"

    # Decode the named records independently, one reader call per record.
    readers = [ArrayRecordReader(p, READER_OPTIONS) for p in paths]
    starts = np.concatenate([[0], np.cumsum([r.num_records() for r in readers])])
    expected = []
    for i in ids.tolist():
        f = int(np.searchsorted(starts, i, side="right") - 1)
        expected.append(np.frombuffer(readers[f].read([i - int(starts[f])])[0], dtype=np.int32))
    for r in readers:
        r.close()
    exp_len = sorted(min(len(a), SEQ_LEN) for a in expected)

    with pipe.iterator(start_step=0) as it:
        q = next(it)
    q2 = pipe.batch_at(0)
    raw = RawReader(paths).batch(raw_ids[:BATCH])
    assert set(q) == {"tokens", "length"}, sorted(q)
    assert q["tokens"].shape == (BATCH, SEQ_LEN) and q["tokens"].dtype == np.int32, (q["tokens"].shape, q["tokens"].dtype)
    assert q["length"].shape == (BATCH,), q["length"].shape
    assert sorted(q["length"].tolist()) == exp_len, "quern lengths differ from the records explain(0) names"
    assert sorted(raw["length"].tolist()) == exp_len, "raw lengths differ from the records explain(0) names"
    assert np.array_equal(q["tokens"], raw["tokens"]) and np.array_equal(q["length"], raw["length"])
    assert np.array_equal(q2["tokens"], q["tokens"]), "batch_at(0) differs from iterator step 0"
    for row, a in zip(q["tokens"], expected):
        n = min(len(a), SEQ_LEN)
        assert np.array_equal(row[:n], a[:n]) and not row[n:].any()
    print(f"correctness: ok (step 0: shape {q['tokens'].shape}, lengths {min(exp_len)}..{max(exp_len)}, "
          f"mean {np.mean(exp_len):.0f}; quern == raw == records named by explain(0))")


def time_to_first_batch(paths: list[str], reps: int = 5) -> list[tuple[str, float]]:
    """Median seconds from nothing (no open files, no pipeline) to the first batch.

    Closing the iterator afterwards is not timed. One untimed round first pays
    imports and other one-time lazy initialisation."""

    def quern_iter(step: int) -> float:
        t0 = time.perf_counter()
        it = quern_pipeline(paths).iterator(start_step=step)
        b = next(it)
        dt = time.perf_counter() - t0
        it.close()
        assert b["tokens"].shape == (BATCH, SEQ_LEN)
        return dt

    def quern_batch_at(step: int) -> float:
        t0 = time.perf_counter()
        b = quern_pipeline(paths).batch_at(step)
        dt = time.perf_counter() - t0
        assert b["tokens"].shape == (BATCH, SEQ_LEN)
        return dt

    def grain_index(step: int) -> float:
        t0 = time.perf_counter()
        ds = grain_map_dataset(paths)
        b = ds[step % len(ds)]
        dt = time.perf_counter() - t0
        assert b["tokens"].shape == (BATCH, SEQ_LEN)
        return dt

    cases = [
        ("quern: source+pipeline+iterator -> batch at step 0", quern_iter, 0),
        (f"quern: source+pipeline+iterator(start_step={RESUME_STEP:.0e}) -> batch", quern_iter, RESUME_STEP),
        ("quern: source+pipeline -> batch_at(0) (no threads)", quern_batch_at, 0),
        (f"quern: source+pipeline -> batch_at({RESUME_STEP:.0e}) (no threads)", quern_batch_at, RESUME_STEP),
        ("grain: source+MapDataset -> ds[0]", grain_index, 0),
        (f"grain: source+MapDataset -> ds[{RESUME_STEP:.0e} % len(ds)]", grain_index, RESUME_STEP),
    ]
    out = []
    for name, fn, step in cases:
        try:
            fn(step)
            out.append((name, statistics.median(fn(step) for _ in range(reps))))
        except Exception as e:  # noqa: BLE001
            print(f"  ERROR {name}: {type(e).__name__}: {e}")
            out.append((name, float("nan")))
    return out


# --------------------------------------------------------------------------- main


def print_summary(results: list[tuple[str, str, float | None, Any]]) -> None:
    """The final table: every config, then raw / grain-best / quern and their ratios."""

    def best(group: str) -> tuple[str, float] | None:
        ok = [(n, m) for g, n, m, _ in results if g == group and m is not None]
        return max(ok, key=lambda x: x[1]) if ok else None

    def ratio(x: float, b: tuple[str, float] | None) -> str:
        return f"{x / b[1]:.2f}x" if b else "-"

    raw_b, grain_b, quern_b = best("raw"), best("grain"), best("quern")
    w = max([len(n) for _, n, _, _ in results] + [20])
    line = "-" * (w + 44)
    print("\n" + "=" * (w + 44))
    print(f"{'config':<{w}s} {'records/s':>11s} {'batches/s':>10s} {'vs raw':>8s} {'vs grain-best':>13s}")
    print(line)
    for _, name, med, _ in results:
        if med is None:
            print(f"{name:<{w}s} {'FAILED':>11s}")
        else:
            print(f"{name:<{w}s} {med:>11,.0f} {med / BATCH:>10.1f} {ratio(med, raw_b):>8s} {ratio(med, grain_b):>13s}")
    print(line)
    for label, b in (("raw (limit)", raw_b), ("grain-best", grain_b), ("quern", quern_b)):
        if b:
            print(f"{label:<12s} {b[1]:>11,.0f} rec/s   [{b[0]}]")
    if quern_b and grain_b:
        print(f"quern / grain-best = {quern_b[1] / grain_b[1]:.2f}x")
    if quern_b and raw_b:
        print(f"quern / raw        = {quern_b[1] / raw_b[1]:.2f}x")
    for _, name, med, err in results:
        if med is None:
            print(f"failed: {name}: {err}")


def parse_flags_for_grain() -> None:
    """grain's multiprocessing reads absl flags; parse them when not running under absl.app."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["vs_grain"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=200_000, help="records in the synthetic data set (default 200000)")
    ap.add_argument("--batches", type=int, default=None, help="timed batches per run (default 100; --quick: 40)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per config (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches before timing (default 2)")
    ap.add_argument("--min-seconds", type=float, default=None, help="minimum seconds per timed run (default 2; --quick: 0.5)")
    ap.add_argument("--quick", action="store_true", help="fewer batches per run (40), 3 runs")
    ap.add_argument("--only", default=None, help="only configs whose name contains this text (e.g. quern)")
    args = ap.parse_args()
    args.batches = args.batches or (40 if args.quick else 100)
    args.runs = args.runs or 3
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.5 if args.quick else 2.0)
    if args.records < BATCH:
        ap.error(f"--records must be >= {BATCH}")
    parse_flags_for_grain()

    t_start = time.perf_counter()
    print("command:", shlex.join([sys.executable] + sys.argv))
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, grain {grain.__version__}, "
          f"quern {quern.__version__}, cpus {os.cpu_count()}")
    paths = make_data(args.records)
    nbytes = warm_page_cache(paths)
    print(f"data: {args.records:,} records, {NUM_SHARDS} shards, {nbytes / 2**20:.0f} MiB on disk (page cache warmed)")
    print(f"each config: {args.warmup} warm-up batches, then {args.runs} runs of at least {args.batches} batches "
          f"x {BATCH} records and {args.min_seconds:g} s; median records/s")

    # Record ids for the raw reader: quern's shuffled order, computed outside the timed region.
    raw_ids = quern_pipeline(paths).record_ids(np.arange(3 * args.records // (16 * BATCH) * 16 * BATCH))
    check_correctness(paths, raw_ids)

    results: list[tuple[str, str, float | None, list[float] | str]] = []
    print()
    for group, name, make in configs(paths, raw_ids, args):
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            med, rates = measure(make, args)
            results.append((group, name, med, rates))
            print(f"  {name:<66s} {med:>10,.0f} rec/s   runs: {', '.join(f'{r:,.0f}' for r in rates)}"
                  f"   ({time.perf_counter() - t0:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001 - one broken config must not stop the benchmark
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            results.append((group, name, None, msg))
            print(f"  {name:<66s} FAILED: {msg}", flush=True)
            if os.environ.get("VS_GRAIN_TRACEBACK"):
                traceback.print_exc()

    print("\ntime to first batch (fresh source and pipeline, median of 5, in this already-warm process):")
    for name, secs in time_to_first_batch(paths):
        print(f"  {name:<66s} {secs * 1e3:>9.1f} ms")

    print_summary(results)

    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS: this process {self_rss:,.0f} MiB; largest child process {child_rss:,.0f} MiB "
          "(ru_maxrss, measured separately; not a sum)")
    print(f"total time {time.perf_counter() - t_start:.0f}s")
    print("command:", shlex.join([sys.executable] + sys.argv))


if __name__ == "__main__":
    main()
