"""quern vs grain vs raw ArrayRecord: throughput of one token pipeline.

What is measured
----------------
One pipeline, built three ways over the same synthetic data:

    ArrayRecord shards -> global shuffle -> decode bytes to int32
    -> pad (0) / truncate to 512 -> {"tokens": (512,) int32, "length": int32}
    -> batch 256

* **the CPU limit** -- the reader's own CPU seconds per record (16 batches' shuffled ids,
  one call per file, its zstd decompression included) and the parse's (decode + pad with
  NumPy), each timed apart with ``time.process_time`` over the same records. The reader is
  timed both ways the library offers: ``ArrayRecordReader.read(list)`` (spread over the
  library's thread pool, whose spinning threads cost CPU) and ``seek`` + ``read()`` one
  record at a time on the calling thread (what a quern worker process does); the cheaper
  sets the limit. The limit on C cores is ``C / (reader + parse)`` records/s, which a
  pipeline reaches only if nothing but that work runs. quern with 2 workers is set against it.
* ``raw ArrayRecordReader`` -- the reader called from one thread: the shuffled record ids of 1 batch
  (or of 16 consecutive batches) are grouped by file and read with one
  ``reader.read(list)`` per file (which spreads the call over the library's own
  thread pool; readers opened as quern opens them, with
  ``readahead_buffer_size:0,max_parallelism:0`` and a 4 KiB file buffer), then each batch is decoded
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
  (``read_ahead=1``), with 1 and 2 worker processes (``num_workers``), plus
  ``pipe.batch_at(step)`` in a plain loop (no threads). The fastest is "quern"
  (the loop is not a candidate). With workers, quern lends each batch's
  shared-memory slot to the caller (zero copy; the slot is reused once no
  array of the batch is alive). One more config, ``PipelineIterator(pipe,
  num_workers=2, copy_batches=True)``, copies each batch out of shared memory once
  instead: a private knob that exists only to measure what the lease saves
  (labelled "copy out once, measurement only"), never a candidate for "quern".

CPU-heavy variant (``--heavy``, the default; names start with "heavy:"): the
same pipelines with one more per-record transform after decode + pad,
``heavy(record)``: ``HEAVY_ROUNDS`` rounds of scale / cumsum / mod / sort on
the record's 512 tokens as float32, adding ``"score"`` (the last value) to the
record -- many small NumPy calls, so it holds the GIL for most of its time
(about 50 us per record on a 2-core development machine; the cost measured
at start-up is printed). It is a module-level function (grain's spawned
workers import it by reference) and runs identically in quern ``iterator()``
with 0, 1 and 2 workers (``.map(heavy)`` after ``pad``), grain
``.batch().to_iter_dataset(0 threads).mp_prefetch(2 workers, buffer 4)`` and
``grain.DataLoader(worker_count=2, 0 read threads, buffer 4)`` (the fastest
2-worker forms of the plain run; ``.map(heavy)`` / ``Heavy()`` after
``decode_pad``). Here parallel workers matter.

Every config: one iterator (with workers: started and, for quern,
``wait_for_workers()`` before any batch is taken; for grain the warm-up batches
wait for them), ``--warmup`` batches untimed, then ``--runs``
consecutive timed runs, each at least ``--batches`` batches and at least
``--min-seconds`` long (so batches prefetched before the clock starts weigh
little); the reported figure is the median records/s over the runs. The files are read once before measuring, so
the page cache is warm. While a config runs (start, measurement and close), a
background thread samples every 50 ms the summed RSS of this process and all
its descendants (``psutil``, about 1 ms of this process's time per sample;
pages shared between processes, such as the workers' shared-memory batches,
count once per process that maps them); the peak is reported per config, with
its rise over the value at the config's start. At the end, ``ru_maxrss`` of
this process alone is printed too (getrusage's figure for children is left
out: a child started by fork + exec inherits its parent's high-water mark).
After each config, and at the end, a warning is printed if any child process is still alive
(multiprocessing's resource tracker, which grain's workers start and which
lives as long as this process, excepted).

Time to the first batch (fresh source + pipeline + iterator, closing not
timed; median of 5 rounds, of 3 for grain with workers): quern ``iterator()``
with 0 and 2 workers from step 0 and after resuming at step 10**7, quern
``batch_at``, grain's MapDataset by index, grain ``mp_prefetch(2 workers)``
and ``grain.DataLoader(worker_count=2)`` (both in their tuned forms). With
workers, quern's first batch waits for a worker (forked by its fork server),
as grain's waits for its workers.

The summary prints the tables (plain, heavy), then ratios: plain quern 2
workers vs grain ``mp_prefetch(2)`` (best of its forms), quern 1 and 2 workers
vs 0, copy vs zero-copy lease; heavy quern 2 workers vs 0 and vs grain's
2-worker forms; time to first batch of quern with 2 workers vs grain
``mp_prefetch(2)``, ``DataLoader(2)`` and ``ds[0]``. It prints figures only
and asserts no timing target.

A light correctness check runs first: the quern batch at step 0 has shape
(256, 512), and the raw and quern outputs at step 0 hold the same multiset of
lengths as decoding the records ``pipe.explain(0)`` names (and identical
tokens), so every config does real work; quern's 2-worker iterator yields the
same batches as ``batch_at``, and quern's and grain's heavy batches carry
``heavy``'s score of each row.

Data
----
``--records`` (default 200,000) records of int32 tokens, lengths uniform in
64..512, values uniform in [1, 32000), fixed NumPy seed, written as 8
ArrayRecord shards with ``ArrayRecordWriter(path, "group_size:1")`` (default
zstd compression) under ``benchmarks/data/vs_grain/`` (git-ignored). The data
are regenerated when missing or when ``--records`` differs from the cached set.

Run
---
    .venv/bin/python benchmarks/vs_grain.py            # full run, about 7 minutes on 2 cores
    .venv/bin/python benchmarks/vs_grain.py --quick    # fewer batches, 3 runs
    .venv/bin/python benchmarks/vs_grain.py --records 50000 --batches 60 --runs 5
    .venv/bin/python benchmarks/vs_grain.py --only quern  # configs whose name contains "quern"
    .venv/bin/python benchmarks/vs_grain.py --only heavy  # the CPU-heavy variant only
    .venv/bin/python benchmarks/vs_grain.py --no-heavy    # the plain pipeline only

A config that raises prints a FAILED line (set VS_GRAIN_TRACEBACK=1 for the
traceback) and the rest still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import common
import grain
import numpy as np
import psutil

import quern

SEQ_LEN = 512
BATCH = 256
NUM_SHARDS = 8
MIN_LEN, MAX_LEN = 64, 512
DATA_SEED = 20240601
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
READER_BUFFER = quern.sources.ArrayRecordSource.READER_BUFFER  # the file buffer quern's readers have
RESUME_STEP = 10**7
HEAVY_ROUNDS = 4  # rounds of heavy(): about 50 us per record on a 2-core development machine
RSS_INTERVAL = 0.05  # seconds between RSS samples
# ReadOptions(num_threads=0) means "no reader threads": records are read in the calling thread.
GRAIN_NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vs_grain")

# Config names the summary refers to.
Q_W0 = "quern iterator() [defaults: 1 thread, read_ahead 16]"
Q_W1 = "quern iterator(num_workers=1)"
Q_W2 = "quern iterator(num_workers=2)"
Q_COPY = "quern PipelineIterator(num_workers=2, copy_batches=True) [copy out once, measurement only]"
G_MP = "grain .batch().to_iter_dataset(0 thr).mp_prefetch(2 workers, buf 4)"
G_LOADER = "grain DataLoader(worker_count=2, 0 read threads, buf 4)"
HQ_W0 = "heavy: quern iterator() [num_workers=0]"
HQ_W1 = "heavy: quern iterator(num_workers=1)"
HQ_W2 = "heavy: quern iterator(num_workers=2)"
HG_MP = "heavy: " + G_MP
HG_LOADER = "heavy: " + G_LOADER


# --------------------------------------------------------------------------- data


def make_data(num_records: int) -> list[str]:
    """Write (or reuse) the synthetic shards; return their paths in order."""
    paths = [os.path.join(DATA_DIR, f"tokens-{i:05d}-of-{NUM_SHARDS:05d}.array_record") for i in range(NUM_SHARDS)]
    meta = {
        "records": num_records,
        "shards": NUM_SHARDS,
        "seed": DATA_SEED,
        "lengths": [MIN_LEN, MAX_LEN],
        "vocab": common.VOCAB,
        "dtype": "int32",
        "writer_options": "group_size:1",
        "format": 1,
    }
    note = f"generating {num_records:,} records in {NUM_SHARDS} shards under {DATA_DIR} ..."
    common.token_shards(DATA_DIR, meta, [(paths, (MIN_LEN, MAX_LEN))], num_records, DATA_SEED, announce=note)
    return paths


# --------------------------------------------------------------------------- shared transforms


def decode_pad(record: bytes) -> dict:
    """The per-record transform used by grain: bytes -> padded int32 tokens + length."""
    return common.decode_pad(record, SEQ_LEN)


class DecodePad(grain.transforms.Map):
    """``decode_pad`` as a grain transform (for ``grain.DataLoader`` operations)."""

    def map(self, element: bytes) -> dict:
        return decode_pad(element)


def heavy(record: dict) -> dict:
    """The CPU-heavy per-record transform (after decode + pad, in quern and grain alike):
    ``HEAVY_ROUNDS`` rounds of small NumPy calls on the tokens; adds ``"score"``."""
    x = record["tokens"].astype(np.float32)
    for _ in range(HEAVY_ROUNDS):
        x = np.sort(np.cumsum(x * np.float32(1e-3)) % np.float32(7.0))
    return {**record, "score": np.float32(x[-1])}


class Heavy(grain.transforms.Map):
    """``heavy`` as a grain transform (for ``grain.DataLoader`` operations)."""

    def map(self, element: dict) -> dict:
        return heavy(element)


def heavy_cost_us(paths: list[str], reps: int = 5) -> float:
    """Median microseconds per record of ``heavy`` over the padded records of step 0."""
    rows = quern_pipeline(paths).batch_at(0)
    records = [{"tokens": t, "length": n} for t, n in zip(rows["tokens"], rows["length"])]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for r in records:
            heavy(r)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(records) * 1e6


# --------------------------------------------------------------------------- raw ArrayRecord (the limit)


class RawReader:
    """Batches straight from ``ArrayRecordReader.read(list)``: one call per file per batch.

    Readers are opened as quern opens them (random-access options, a 4 KiB file buffer).
    ``one_by_one``: each file's records are read with ``seek`` + ``read()`` in ascending
    order on the calling thread instead (no library thread pool), as a quern worker
    process reads them.
    """

    def __init__(self, paths: list[str], one_by_one: bool = False):
        from array_record.python.array_record_module import ArrayRecordReader

        self.one_by_one = one_by_one
        self.readers = [ArrayRecordReader(p, READER_OPTIONS, file_reader_buffer_size=READER_BUFFER) for p in paths]
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
            local = (ids[where] - self.starts[f]).tolist()
            if self.one_by_one:
                reader, got = self.readers[f], [None] * len(local)
                for k in sorted(range(len(local)), key=local.__getitem__):
                    reader.seek(local[k])
                    got[k] = reader.read()
                records = got
            else:
                records = self.readers[f].read(local)
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


def quern_pipeline(paths: list[str], heavy_work: bool = False):
    """The quern pipeline; ``heavy_work``: with ``.map(heavy)`` after ``pad``."""
    src = quern.sources.ArrayRecordSource(paths)
    pipe = (
        quern.Pipeline.from_source(src, seed=0)
        .shuffle()
        .map(quern.transforms.decode(np.int32))
        .map(quern.transforms.pad(SEQ_LEN))
    )
    return (pipe.map(heavy) if heavy_work else pipe).batch(BATCH)


def grain_map_dataset(paths: list[str], batched: bool = True, repeat: bool = False, heavy_work: bool = False):
    """grain's MapDataset; ``heavy_work``: with ``.map(heavy)`` after ``decode_pad``."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).shuffle(seed=0)
    if repeat:  # only when one epoch has fewer batches than the benchmark needs
        ds = ds.repeat()
    ds = ds.map(decode_pad)
    if heavy_work:
        ds = ds.map(heavy)
    return ds.batch(BATCH, drop_remainder=True) if batched else ds


def grain_iter(
    paths: list[str],
    read_options=None,
    batched: bool = True,
    workers: int | None = None,
    worker_buffer: int = 1,
    repeat: bool = False,
    heavy_work: bool = False,
) -> Iterator:
    """``iter()`` of the MapDataset through ``to_iter_dataset(read_options)`` (batched
    before or after it), with ``mp_prefetch`` when ``workers`` is given; it has ``close()``."""
    ds = grain_map_dataset(paths, batched=batched, repeat=repeat, heavy_work=heavy_work)
    it_ds = ds.to_iter_dataset(read_options)  # None: grain's default ReadOptions
    if not batched:
        it_ds = it_ds.batch(BATCH, drop_remainder=True)
    if workers is not None:
        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=worker_buffer)
        it_ds = it_ds.mp_prefetch(options)
    return iter(it_ds)


def grain_loader(
    paths: list[str],
    workers: int,
    read_options=None,
    worker_buffer: int = 1,
    repeat: bool = False,
    heavy_work: bool = False,
) -> tuple[Iterator, Any]:
    """``iter(grain.DataLoader(...))`` and the DatasetIterator underneath it (which has ``close()``)."""
    source = grain.sources.ArrayRecordDataSource(paths)
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(
            num_records=len(source),
            shard_options=grain.sharding.NoSharding(),
            shuffle=True,
            seed=0,
            num_epochs=None if repeat else 1,
        ),
        operations=[
            DecodePad(),
            *([Heavy()] if heavy_work else []),
            grain.transforms.Batch(BATCH, drop_remainder=True),
        ],
        worker_count=workers,
        worker_buffer_size=worker_buffer,
        read_options=read_options,
    )
    it = iter(loader)
    return it, getattr(it, "_iterator", None)


def quern_iterator(paths: list[str], heavy_work: bool = False, copy: bool = False, **kwargs):
    """A quern iterator from step 0 whose worker processes (if any) have started.

    ``copy``: ``PipelineIterator(num_workers=2, copy_batches=True)``
    (copy each batch out instead of lending its slot) that exists only to measure
    what the lease saves."""
    pipe = quern_pipeline(paths, heavy_work)
    it = (
        quern.PipelineIterator(pipe, num_workers=2, copy_batches=True)
        if copy
        else pipe.iterator(start_step=0, **kwargs)
    )
    return common.started(it)


class Stepper:
    """A ``next()``-style callable over ``fn(step)`` for step = 0, 1, 2, ..."""

    def __init__(self, fn: Callable[[int], Any]):
        self.fn, self.step = fn, 0

    def __call__(self) -> Any:
        out = self.fn(self.step)
        self.step += 1
        return out


def _first(it: Iterator, handle: Any) -> tuple[Any, Any]:
    """``(next(it), handle)``; ``handle`` is closed if ``next`` raises."""
    try:
        return next(it), handle
    except BaseException:
        common.close(handle)
        raise


# --------------------------------------------------------------------------- memory and processes


class PeakRSS:
    """Peak of the summed RSS of this process and all its descendants, sampled every
    ``RSS_INTERVAL`` seconds on a background thread while the ``with`` block runs (MiB)."""

    def __init__(self):
        self.start = self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vs-grain-rss", daemon=True)

    @staticmethod
    def sample() -> float:
        me = psutil.Process()
        total = me.memory_info().rss
        for child in me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # it exited meanwhile
                pass
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.wait(RSS_INTERVAL):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())


def leftover_children(wait: float = 0.0) -> list[str]:
    """Descendants of this process still present after up to ``wait`` seconds, as
    "pid: command" lines; multiprocessing's resource tracker (started by
    grain's workers, it lives as long as this process) does not count."""
    deadline = time.monotonic() + wait
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.ZombieProcess:
                cmd = "<zombie: exited, not waited for>"
            except psutil.Error:  # it exited meanwhile
                continue
            if "resource_tracker" not in cmd:
                left.append(f"{p.pid}: {cmd[:120]}")
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


# --------------------------------------------------------------------------- measurement


@dataclasses.dataclass
class Result:
    """One config's outcome: median records/s (``None`` if it failed) and peak RSS (MiB)."""

    group: str
    name: str
    rate: float | None
    runs: list[float]
    rss_start: float
    rss_peak: float
    error: str = ""


def measure(make: Callable[[], tuple[Callable[[], Any], Any]], args) -> tuple[float, list[float]]:
    """Median records/s over ``args.runs`` timed runs; a run is at least ``args.batches``
    batches and at least ``args.min_seconds`` long, so that batches prefetched before
    the clock starts weigh little."""
    next_batch, handle = make()
    try:
        for _ in range(args.warmup):
            b = next_batch()
        assert b["tokens"].shape == (BATCH, SEQ_LEN) and b["tokens"].dtype == np.int32, b["tokens"].shape
        rates = [common.rate(next_batch, args.min_seconds, args.batches) * BATCH for _ in range(args.runs)]
    finally:
        common.close(handle)
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
            state = {"step": 0}

            def next_batch():
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

    def g_iter(read_options=None, **kwargs):
        def make():
            it = grain_iter(paths, read_options, repeat=repeat, **kwargs)
            return it.__next__, it

        return make

    def g_loader(workers: int, read_options=None, worker_buffer=1, **kwargs):
        def make():
            it, handle = grain_loader(paths, workers, read_options, worker_buffer, repeat=repeat, **kwargs)
            return it.__next__, handle

        return make

    no_threads = GRAIN_NO_THREADS
    threads = lambda n, buf: grain.ReadOptions(num_threads=n, prefetch_buffer_size=buf)  # noqa: E731
    out += [
        ("grain", "grain MapDataset ds[i]", g_index),
        ("grain", "grain .batch().to_iter_dataset()  [default: 16 threads]", g_iter()),
        ("grain", "grain .batch().to_iter_dataset(4 threads)", g_iter(threads(4, 8))),
        ("grain", "grain .batch().to_iter_dataset(2 threads)", g_iter(threads(2, 4))),
        ("grain", "grain .to_iter_dataset(0 threads).batch()", g_iter(no_threads, batched=False)),
        ("grain", "grain .to_iter_dataset(2 threads).batch()", g_iter(threads(2, 2 * BATCH), batched=False)),
        ("grain", "grain .batch().to_iter_dataset().mp_prefetch(2 workers)", g_iter(workers=2)),
        ("grain", G_MP, g_iter(no_threads, workers=2, worker_buffer=4)),
        ("grain", "grain DataLoader(worker_count=0)", g_loader(0)),
        ("grain", "grain DataLoader(worker_count=0, 0 read threads)", g_loader(0, no_threads)),
        ("grain", "grain DataLoader(worker_count=2)", g_loader(2)),
        ("grain", G_LOADER, g_loader(2, no_threads, 4)),
    ]

    # 3. quern: one process (threads), then worker processes
    def q_iter(**kwargs):
        def make():
            it = quern_iterator(paths, **kwargs)
            return it.__next__, it

        return make

    def q_batch_at():
        pipe = quern_pipeline(paths)
        return Stepper(pipe.batch_at), None

    out += [
        ("quern", Q_W0, q_iter()),
        ("quern", "quern iterator(num_threads=2)", q_iter(num_threads=2)),
        ("quern", "quern iterator(read_ahead=1) [one read per step]", q_iter(read_ahead=1)),
        ("quern", Q_W1, q_iter(num_workers=1)),
        ("quern", Q_W2, q_iter(num_workers=2)),
        ("quern-loop", "quern batch_at(step) loop (no threads)", q_batch_at),
        ("quern-copy", Q_COPY, q_iter(copy=True)),
    ]

    # 4. the CPU-heavy variant: heavy() after decode + pad, 2-worker grain in its fastest plain forms
    if args.heavy:
        out += [
            ("heavy-quern", HQ_W0, q_iter(heavy_work=True)),
            ("heavy-quern", HQ_W1, q_iter(heavy_work=True, num_workers=1)),
            ("heavy-quern", HQ_W2, q_iter(heavy_work=True, num_workers=2)),
            ("heavy-grain", HG_MP, g_iter(no_threads, workers=2, worker_buffer=4, heavy_work=True)),
            ("heavy-grain", HG_LOADER, g_loader(2, no_threads, 4, heavy_work=True)),
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
    assert q["tokens"].shape == (BATCH, SEQ_LEN) and q["tokens"].dtype == np.int32, (
        q["tokens"].shape,
        q["tokens"].dtype,
    )
    assert q["length"].shape == (BATCH,), q["length"].shape
    assert sorted(q["length"].tolist()) == exp_len, "quern lengths differ from the records explain(0) names"
    assert sorted(raw["length"].tolist()) == exp_len, "raw lengths differ from the records explain(0) names"
    assert np.array_equal(q["tokens"], raw["tokens"]) and np.array_equal(q["length"], raw["length"])
    assert np.array_equal(q2["tokens"], q["tokens"]), "batch_at(0) differs from iterator step 0"
    for row, a in zip(q["tokens"], expected):
        n = min(len(a), SEQ_LEN)
        assert np.array_equal(row[:n], a[:n]) and not row[n:].any()

    # Worker processes: steps 0 and 1 computed by the two workers equal batch_at.
    it = quern_iterator(paths, num_workers=2)
    try:
        for step in range(2):
            b, ref = next(it), pipe.batch_at(step)
            assert all(np.array_equal(b[k], ref[k]) for k in ref), f"num_workers=2 differs from batch_at({step})"
    finally:
        it.close()

    # The heavy variant: the same rows plus heavy()'s score of each, in quern and in grain.
    def check_heavy(b: dict, who: str) -> None:
        assert set(b) == {"tokens", "length", "score"}, (who, sorted(b))
        scores = [heavy({"tokens": t, "length": n})["score"] for t, n in zip(b["tokens"], b["length"])]
        assert np.array_equal(b["score"], scores), f"{who}: heavy scores differ"

    h = quern_pipeline(paths, heavy_work=True).batch_at(0)
    assert np.array_equal(h["tokens"], q["tokens"]) and np.array_equal(h["length"], q["length"])
    check_heavy(h, "quern")
    check_heavy(grain_map_dataset(paths, heavy_work=True)[0], "grain")
    print(
        f"correctness: ok (step 0: shape {q['tokens'].shape}, lengths {min(exp_len)}..{max(exp_len)}, "
        f"mean {np.mean(exp_len):.0f}; quern == raw == records named by explain(0); "
        "num_workers=2 == batch_at; heavy scores in quern and grain)"
    )


def time_to_first_batch(paths: list[str], reps: int = 5, worker_reps: int = 3) -> list[tuple[str, str, float]]:
    """(key, label, median seconds) from nothing (no open files, no pipeline) to the first batch.

    Closing the iterator afterwards is not timed. One untimed round first pays
    imports and other one-time lazy initialisation. grain's worker cases start
    new processes each round (a few seconds), so they take ``worker_reps``."""

    def timed(start: Callable[[int], tuple[Any, Any]], step: int) -> float:
        t0 = time.perf_counter()
        b, handle = start(step)
        dt = time.perf_counter() - t0
        common.close(handle)
        assert b["tokens"].shape == (BATCH, SEQ_LEN)
        return dt

    def quern_iter(workers: int) -> Callable[[int], tuple[Any, Any]]:
        def start(step: int) -> tuple[Any, Any]:
            it = quern_pipeline(paths).iterator(start_step=step, num_workers=workers)
            return _first(it, it)

        return start

    def quern_batch_at(step: int) -> tuple[Any, Any]:
        return quern_pipeline(paths).batch_at(step), None

    def grain_index(step: int) -> tuple[Any, Any]:
        ds = grain_map_dataset(paths)
        return ds[step % len(ds)], None

    def grain_mp(step: int) -> tuple[Any, Any]:
        it = grain_iter(paths, GRAIN_NO_THREADS, workers=2, worker_buffer=4)
        return _first(it, it)

    def grain_dl(step: int) -> tuple[Any, Any]:
        return _first(*grain_loader(paths, 2, GRAIN_NO_THREADS, 4))

    resume = f"{RESUME_STEP:.0e}"
    cases = [
        ("q0", "quern: source+pipeline+iterator -> batch at step 0", quern_iter(0), 0, reps),
        (
            "q0-resume",
            f"quern: source+pipeline+iterator(start_step={resume}) -> batch",
            quern_iter(0),
            RESUME_STEP,
            reps,
        ),
        ("q2", "quern: source+pipeline+iterator(num_workers=2) -> batch at step 0", quern_iter(2), 0, reps),
        (
            "q2-resume",
            f"quern: source+pipeline+iterator(num_workers=2, start_step={resume}) -> batch",
            quern_iter(2),
            RESUME_STEP,
            reps,
        ),
        ("q-batch_at", "quern: source+pipeline -> batch_at(0) (no threads)", quern_batch_at, 0, reps),
        (
            "q-batch_at-resume",
            f"quern: source+pipeline -> batch_at({resume}) (no threads)",
            quern_batch_at,
            RESUME_STEP,
            reps,
        ),
        ("g-index", "grain: source+MapDataset -> ds[0]", grain_index, 0, reps),
        ("g-index-resume", f"grain: source+MapDataset -> ds[{resume} % len(ds)]", grain_index, RESUME_STEP, reps),
        (
            "g-mp",
            "grain: source+MapDataset+iterator, mp_prefetch(2 workers, 0 thr, buf 4) -> batch",
            grain_mp,
            0,
            worker_reps,
        ),
        ("g-loader", "grain: DataLoader(worker_count=2, 0 read threads, buf 4) -> batch", grain_dl, 0, worker_reps),
    ]
    out = []
    for key, name, fn, step, n in cases:
        try:
            timed(fn, step)
            out.append((key, name, statistics.median(timed(fn, step) for _ in range(n))))
        except Exception as e:  # noqa: BLE001
            print(f"  ERROR {name}: {type(e).__name__}: {e}")
            out.append((key, name, float("nan")))
    return out


def cpu_costs(paths: list[str], raw_ids: np.ndarray, rounds: int = 3) -> tuple[float, float, float]:
    """The CPU seconds per record of the reader alone, both ways, and of the parse alone (medians of ``rounds``).

    The reader: 16 batches' shuffled ids per call, one call per file, read with
    ``ArrayRecordReader.read(list)`` (the library's thread pool, as quern reads in one
    process) and one by one with ``seek`` + ``read()`` (the calling thread only, as a quern
    worker process reads), zstd decompression and record framing included; the parse:
    decode + pad of those records into a batch with NumPy, timed after the one-by-one read
    (after a ``read(list)`` the library's threads spin on a while, and their CPU would count).
    All timed with ``time.process_time`` (this process's CPU, all threads) over the same records.

    Returns:
        ``(read(list), one by one, parse)`` seconds per record.
    """
    per = 16 * BATCH
    out: list[list[float]] = [[], [], []]
    for _ in range(rounds):
        for which, reader in enumerate((RawReader(paths), RawReader(paths, one_by_one=True))):
            read_s = parse_s = 0.0
            n = 0
            for lo in range(0, len(raw_ids) - per + 1, per):
                t0 = time.process_time()
                records = reader.read(raw_ids[lo : lo + per])
                t1 = time.process_time()
                for i in range(0, per, BATCH):
                    reader.pad(records[i : i + BATCH])
                t2 = time.process_time()
                read_s, parse_s, n = read_s + t1 - t0, parse_s + t2 - t1, n + per
            out[which].append(read_s / n)
            if which == 1:  # after a read(list) the library's threads still spin a while: not the parse's CPU
                out[2].append(parse_s / n)
    return statistics.median(out[0]), statistics.median(out[1]), statistics.median(out[2])


def _raw_process(paths: list[str], ids: np.ndarray, seconds: float, out: Any, start: Any) -> None:
    """One process of :func:`raw_per_core`: ``ids`` read one by one and padded, 16 batches per call, for ``seconds``
    from when every process is ready (``start``, a barrier); puts ``(records, seconds)`` on ``out``."""
    reader, per = RawReader(paths, one_by_one=True), 16 * BATCH
    reader.batches(ids[:per])  # warm
    start.wait()
    done, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        lo = i * per % (len(ids) - per + 1)
        reader.batches(ids[lo : lo + per])
        done, i = done + per, i + 1
    out.put((done, time.perf_counter() - t0))


def raw_per_core(paths: list[str], raw_ids: np.ndarray, seconds: float = 5.0, rounds: int = 3) -> float:
    """The reader's and the parse's work alone on every core at once: records/s (median of ``rounds``).

    One process per usable core (started fresh, ``spawn``), each reading its share of the
    shuffled ids one by one (the cheaper way, no library threads) and padding them, 16 batches
    per call, with no pipeline around it, all timed from one barrier; their rates summed. What the machine gives this work
    when every core runs it, contention for caches and memory included, which the CPU limit
    (one core's cost, times the cores) leaves out.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    cores = len(os.sched_getaffinity(0))
    rates = []
    for _ in range(rounds):
        q, start = ctx.Queue(), ctx.Barrier(cores)
        args = [(paths, raw_ids[k::cores], seconds, q, start) for k in range(cores)]
        procs = [ctx.Process(target=_raw_process, args=a) for a in args]
        try:
            for p in procs:
                p.start()
            got = [q.get(timeout=seconds + 120) for _ in procs]
        finally:
            for p in procs:
                if p.is_alive() and p.exitcode is None:
                    p.join(timeout=5)
                    p.terminate()
                p.join()
        rates.append(sum(n / t for n, t in got))
    return statistics.median(rates)


# --------------------------------------------------------------------------- main


def print_summary(
    results: list[Result],
    ttfb: list[tuple[str, str, float]],
    costs: tuple[float, float, float] | None = None,
    per_core: float | None = None,
) -> None:
    """The final tables (plain, then heavy), the best of raw / grain / quern, and the
    ratios the worker processes are judged by: figures only, no target is asserted."""

    def best(group: str, contains: str = "") -> tuple[str, float] | None:
        ok = [(r.name, r.rate) for r in results if r.group == group and r.rate is not None and contains in r.name]
        return max(ok, key=lambda x: x[1]) if ok else None

    rate = {r.name: r.rate for r in results}
    header = ["config", "records/s", "batches/s", "vs raw", "vs grain-best", "peak RSS MiB"]
    raw_b, grain_b, quern_b = best("raw"), best("grain"), best("quern")
    width = 0
    for heavy_part in (False, True):
        rows = [r for r in results if r.group.startswith("heavy") == heavy_part]
        if not rows:
            continue
        ref_raw, ref_grain = (None, best("heavy-grain")) if heavy_part else (raw_b, grain_b)
        cells = [
            [r.name, "FAILED"]
            if r.rate is None
            else [
                r.name,
                f"{r.rate:,.0f}",
                f"{r.rate / BATCH:.1f}",
                common.ratio(r.rate, ref_raw[1] if ref_raw else None),
                common.ratio(r.rate, ref_grain[1] if ref_grain else None),
                f"{r.rss_peak:,.0f} (+{r.rss_peak - r.rss_start:,.0f})",
            ]
            for r in rows
        ]
        lines = common.format_table(header, cells, rule=True)
        width = max(len(line) for line in lines)
        print("\n" + "=" * width)
        print("CPU-heavy variant: heavy() after decode + pad" if heavy_part else "plain pipeline")
        print("\n".join(lines))
    if results:
        print("-" * width)
        print(
            "peak RSS: this process + all its children, summed, sampled every "
            f"{RSS_INTERVAL * 1e3:.0f} ms while the config ran (+: rise over its start)"
        )
    for label, b in (("raw (limit)", raw_b), ("grain-best", grain_b), ("quern", quern_b)):
        if b:
            print(f"{label:<12s} {b[1]:>11,.0f} rec/s   [{b[0]}]")
    if quern_b and grain_b:
        print(f"quern / grain-best = {quern_b[1] / grain_b[1]:.2f}x")
    if quern_b and raw_b:
        print(f"quern / raw        = {quern_b[1] / raw_b[1]:.2f}x")
    if costs is not None:
        cpus = len(os.sched_getaffinity(0))
        reader, parse = min(costs[0], costs[1]), costs[2]
        how = "read(list)" if costs[0] <= costs[1] else "one by one"
        limit = cpus / (reader + parse)
        print(
            f"CPU limit ({cpus} cores) = {cpus} / (reader {reader * 1e6:.2f} us [{how}, the cheaper] + parse "
            f"{parse * 1e6:.2f} us per record) = {limit:,.0f} rec/s"
        )
        if rate.get(Q_W2):
            print(f"quern num_workers=2 / CPU limit = {rate[Q_W2] / limit:.2f}  (target >= 0.95)")
            loose = cpus / (costs[0] + parse)
            print(f"  (against the read(list) reader alone, {loose:,.0f} rec/s: {rate[Q_W2] / loose:.2f})")
    if per_core and rate.get(Q_W2):
        print(
            f"raw reader + parse, one process per core, no pipeline = {per_core:,.0f} rec/s; "
            f"quern num_workers=2 / that = {rate[Q_W2] / per_core:.2f}"
        )

    def line(label: str, x: float | None, y: float | None, note: str = "", ms: bool = False) -> None:
        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:,.1f}" if ms else f"{v:,.0f}"

        print(f"  {label:<54s} {common.ratio(x, y):>8s}   ({fmt(x)} / {fmt(y)} {'ms' if ms else 'rec/s'}){note}")

    mp_b = best("grain", "mp_prefetch")
    print("\n(a) plain pipeline, records/s")
    line(
        "quern num_workers=2 / grain mp_prefetch(2) best",
        rate.get(Q_W2),
        mp_b and mp_b[1],
        f"  target >= 10x; grain: {mp_b[0]}" if mp_b else "  target >= 10x",
    )
    line("quern num_workers=2 / grain-best", rate.get(Q_W2), grain_b and grain_b[1], "  target >= 10x")
    line("quern num_workers=1 / quern num_workers=0", rate.get(Q_W1), rate.get(Q_W0))
    line("quern num_workers=2 / quern num_workers=0", rate.get(Q_W2), rate.get(Q_W0))
    line(
        "quern num_workers=2: lease (default) / copy out once",
        rate.get(Q_W2),
        rate.get(Q_COPY),
        "  (what lending the slot saves over copying each batch out)",
    )
    print("(b) CPU-heavy variant, records/s")
    line("quern num_workers=2 / quern num_workers=0", rate.get(HQ_W2), rate.get(HQ_W0), "  target >= 1.6x")
    line("quern num_workers=1 / quern num_workers=0", rate.get(HQ_W1), rate.get(HQ_W0))
    line("quern num_workers=2 / grain mp_prefetch(2)", rate.get(HQ_W2), rate.get(HG_MP))
    line("quern num_workers=2 / grain DataLoader(worker_count=2)", rate.get(HQ_W2), rate.get(HG_LOADER))
    secs = {key: s for key, _, s in ttfb}
    print("(c) time to first batch, lower is better")
    line("quern num_workers=2 / grain mp_prefetch(2)", secs.get("q2"), secs.get("g-mp"), "  target <= 1x", ms=True)
    line("quern num_workers=2 / grain DataLoader(2)", secs.get("q2"), secs.get("g-loader"), ms=True)
    line("quern num_workers=2 / grain MapDataset ds[0]", secs.get("q2"), secs.get("g-index"), ms=True)
    line(
        "quern num_workers=2, resumed / grain ds[i], i large",
        secs.get("q2-resume"),
        secs.get("g-index-resume"),
        ms=True,
    )
    for r in results:
        if r.rate is None:
            print(f"failed: {r.name}: {r.error}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=200_000, help="records in the synthetic data set (default 200000)")
    ap.add_argument("--batches", type=int, default=None, help="timed batches per run (default 100; --quick: 40)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per config (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches before timing (default 2)")
    ap.add_argument(
        "--min-seconds", type=float, default=None, help="minimum seconds per timed run (default 5; --quick: 0.5)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer batches per run (40), 3 runs")
    ap.add_argument("--only", default=None, help="only configs whose name contains this text (e.g. quern, heavy)")
    ap.add_argument(
        "--heavy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the CPU-heavy variant (default: yes)",
    )
    args = ap.parse_args()
    args.batches = args.batches or (40 if args.quick else 100)
    args.runs = args.runs or 3
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.5 if args.quick else 5.0)
    if args.records < BATCH:
        ap.error(f"--records must be >= {BATCH}")
    common.grain_flags()

    t_start = common.begin(grain=grain.__version__)
    paths = make_data(args.records)
    nbytes = common.warm_page_cache(paths)
    print(f"data: {args.records:,} records, {NUM_SHARDS} shards, {nbytes / 2**20:.0f} MiB on disk (page cache warmed)")
    print(
        f"each config: {args.warmup} warm-up batches, then {args.runs} runs of at least {args.batches} batches "
        f"x {BATCH} records and {args.min_seconds:g} s; median records/s"
    )
    if args.heavy:
        cost = heavy_cost_us(paths)
        print(
            f"heavy(): {HEAVY_ROUNDS} rounds, {cost:.1f} us per record measured here "
            f"(x {BATCH} = {cost * BATCH / 1e3:.1f} ms of transform per batch, on one core)"
        )

    # Record ids for the raw reader: quern's shuffled order, computed outside the timed region.
    raw_ids = quern_pipeline(paths).record_ids(np.arange(3 * args.records // (16 * BATCH) * 16 * BATCH))
    check_correctness(paths, raw_ids)
    costs = cpu_costs(paths, raw_ids[: args.records])
    print(
        f"CPU per record on one core: the reader (zstd, framing) {costs[0] * 1e6:.2f} us with read(list), "
        f"{costs[1] * 1e6:.2f} us one by one (seek + read); the parse (decode, pad) {costs[2] * 1e6:.2f} us"
    )

    results: list[Result] = []
    selected = [c for c in configs(paths, raw_ids, args) if not args.only or args.only in c[1]]
    w = max([len(name) for _, name, _ in selected] + [20])
    print()
    for group, name, make in selected:
        t0 = time.perf_counter()
        rss = PeakRSS()
        try:
            with rss:
                med, rates = measure(make, args)
            results.append(Result(group, name, med, rates, rss.start, rss.peak))
            print(
                f"  {name:<{w}s} {med:>10,.0f} rec/s   runs: {common.join_runs(rates)}"
                f"   peak RSS {rss.peak:,.0f} MiB (+{rss.peak - rss.start:,.0f})"
                f"   ({time.perf_counter() - t0:.1f}s)",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - one broken config must not stop the benchmark
            msg = common.error_line(e)
            results.append(Result(group, name, None, [], rss.start, rss.peak, msg))
            print(f"  {name:<{w}s} FAILED: {msg}", flush=True)
            if os.environ.get("VS_GRAIN_TRACEBACK"):
                traceback.print_exc()
        if left := leftover_children(wait=5.0):
            print(f"  WARNING: {len(left)} child process(es) still alive after closing this config: {'; '.join(left)}")

    print(
        "\ntime to first batch (fresh source and pipeline, median of 5, grain with workers: of 3; "
        "in this already-warm process):"
    )
    ttfb = time_to_first_batch(paths)
    w = max([len(name) for _, name, _ in ttfb] + [20])
    for _, name, secs in ttfb:
        print(f"  {name:<{w}s} {secs * 1e3:>9.1f} ms")

    per_core = raw_per_core(paths, raw_ids[: args.records])
    print(f"raw reader + parse, one process per core, no pipeline (median of 3): {per_core:,.0f} rec/s")
    print_summary(results, ttfb, costs, per_core)

    # RUSAGE_CHILDREN is left out: a child started by fork + exec inherits the parent's high-water mark
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"whole run, peak RSS of this process alone (ru_maxrss): {self_rss:,.0f} MiB")
    left = leftover_children(wait=5.0)
    print(
        f"WARNING: {len(left)} child process(es) still alive: {'; '.join(left)}"
        if left
        else "child processes: none left"
    )
    print(f"total time {time.perf_counter() - t_start:.0f}s")
    print(common.command_line())


if __name__ == "__main__":
    main()
