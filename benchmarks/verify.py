"""Verify: what the ledger costs, how fast digests are, how fast ``quern verify`` and ``where`` are.

What is measured
----------------
**1. Digest throughput** (GB/s of batch bytes, one core, this thread): the row digests of
:mod:`quern.pipeline.integrity.batch_digest` of two batches, ``tokens``: 256 rows of ``{"tokens": (512,)
int32, "length": int32}`` (the vs_grain batch, 513 KiB) and ``images``: 64 rows of ``(224, 224,
3)`` uint8 (9.2 MiB). First the part of quern's scheme that depends on the hash: the rows of each
leaf whose rows are over 16 bytes (the rest is vectorised NumPy), hashed with one Python call per
row with xxHash's XXH3-128 (what quern does without its C library), with quern's C loop
(``rowhash.rows_digests``: one call per leaf; the line above the tables says whether it is
built), and with hashlib's blake2b (digest_size 16), a call per row. Then ``digests_of``
itself (the row digests and the leaf digests, as lists of hex strings) and the whole ledger
fields (``ledger.step_fields``: the JSON text too), in microseconds per batch: what is over the
hashing is the scheme's own cost. The lowest of 5 medians of ``--reps`` calls each, the figures
taking turns (hot caches: the batch was just hashed).

**2. Ledger cost on the vs_grain pipeline** (``benchmarks/vs_grain.py``'s quern pipeline:
ArrayRecord, global shuffle, ``decode(int32)``, ``pad(512)``, ``batch(256)``, over its data,
made if missing): records/s of ``pipe.iterator()`` without and with ``ledger=PATH`` (a file
under a temporary folder), ``num_workers`` 0 and 2; then the same with vs_grain's CPU-heavy
per-record transform (``heavy``, about 50-80 µs per record), 2 workers. Each run: a fresh
iterator (workers started), ``--warmup`` batches, then ``next()`` for at least the run's
seconds; rounds of the two configs in turn (every second round in reverse order): with 0
workers ``--runs0`` rounds of ``--seconds0`` (300 x 0.1 s: this machine's speed drifts by 10-20%
from second to second, so many short paired runs are what resolves a cost of about 1%), with
workers ``--runs`` rounds of ``--seconds`` (12 x 1 s: starting the workers takes a second).
Reported: the median records/s and the spread (lowest, highest); the cost as ``1 - with /
without`` of the medians with a 90% bootstrap interval (rounds resampled as pairs), the median
and range of each round's pair; the digest stage's share of the stage seconds
(``it.stats()["stages"]["digest"]``: the time the digests take where the batches are made, the
workers' own with 2 workers), and the CPU time of this process per batch over the timed run
(``time.process_time``: all the work with 0 workers, the parent's share with 2). Then the
compute path alone: the CPU time of the process (``time.process_time``: the reader's threads
too) per step of making the batches (``execute.step_results``, 16 steps per bulk read), and
the wall time of digesting each right after it is made (``ledger.step_fields``, as a worker
does: caches cold), median and quartiles over ``--path-steps`` steps, and of digesting the last
batch of each 16 again (hot).

**2b. Where the ledger's time goes** (0 workers): the CPU time per batch of each part of the
ledger in a running iterator of the vs_grain pipeline (on the prefetch thread, ``made_of``: taking
each batch's leaves, the C digests, the hex digits of the chunk's row digests; on the consumer's
thread, ``LedgerWriter.add_made`` with ``_write``; the ledger is the two together), each function
wrapped with a timer of the calling thread's CPU (about 1 µs a call), as a share of the process's CPU
per batch; the median of
3 runs of ``--parts-seconds``, with the machine's idle share (``/proc/stat``). Unlike the records/s
of part 2, these figures hardly move with the machine's drift; but they are not its cost in
records/s: work on the consumer's thread runs while the prefetch thread waits for its reads.
Last, the bound: the C row hash of one batch already in the cache, as a share of a batch's wall
time (nothing else of the ledger; no placement or cache miss can make hashing every byte cheaper).

**2c. The floor** (0 workers): records/s with only the row hash of every batch (``batch_digest._hashed``:
the leaves taken and every row of every leaf over 16 bytes hashed, no seeds, no text, no write),
in three places: on the prefetch thread as each batch is made (a ``map_batch``), on the
consumer's thread after each ``next()``, and on a thread of its own fed by the consumer; against
no ledger and the ledger, ``--floor-runs`` interleaved rounds of ``--seconds0``. What any design
that hashes every byte must pay, wherever it hashes.

**2d. One running iterator** (0 workers): records/s of blocks of 32 batches of one iterator with a
ledger, which is taken away for the blocks without it (``--block-rounds`` rounds of nine blocks:
no ledger, the row hash alone on the consumer's thread, the ledger, the ledger with each batch
hashed as it is yielded (the placement before the digests moved to the prefetch thread), the
ledger's digests alone on the prefetch thread (no lines, no writes); and the first four with a
consumer that copies each batch into buffers of its own, as moving a batch to a device does, the
costs then against that consumer without a ledger). Whether the prefetch thread digests applies
to the chunks it starts after a change, so the batches already made or in flight then are taken
untimed first. No iterator starts in a timed block (part 2 and 2c start one per run of 0.1 s), so
the transients of starting one do not enter.

**3. quern verify**: ``quern.verify.compare_topologies`` of the vs_grain pipeline over
``--verify-steps`` steps, hosts 1 and 2, workers 0 and 2 (one reference and four topologies),
and ``check_ledger`` of a ledger of as many steps: wall seconds and steps/s (steps computed,
the reference's included).

**4. where**: queries/s of ``pipe.where(record)`` for random records: a plain stream of
``N = 10**9`` records (global shuffle, batch 256, 3 epochs), and ``N = 10**6`` for a packed
stream (``pack(2048, lengths=array)``, lognormal lengths) and a mixture of two components of
``N / 2`` each (``component=``). The packing plan is made once before timing.

Nothing is asserted. Run (about 12 minutes on 2 cores; ``QUERN_NATIVE=0`` in the environment
measures the Python path):

    .venv/bin/python benchmarks/verify.py [--runs0 300] [--seconds0 0.1] [--runs 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import common
import numpy as np
import xxhash

import quern
import quern.pipeline.execute
import quern.verify
from quern.pipeline.integrity import batch_digest, digesting, ledger, rowhash
from quern.pipeline.iterate import threads

VS_GRAIN_RECORDS = 200_000


# --------------------------------------------------------------------------- 1. digest throughput


def _batches() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        "tokens (256 x 512 int32 + length)": {
            "tokens": rng.integers(1, 32000, (256, 512), dtype=np.int32),
            "length": rng.integers(64, 513, 256, dtype=np.int32),
        },
        "images (64 x 224x224x3 uint8)": {"image": rng.integers(0, 256, (64, 224, 224, 3), dtype=np.uint8)},
    }


def _row_calls(batch: dict[str, np.ndarray], digest: Callable[[Any], bytes]) -> list[bytes]:
    """The hash-dependent part of quern's scheme: one call per row of each leaf whose rows are over 16 bytes."""
    return _per_leaf(batch, lambda m: b"".join(map(digest, m)))


def _per_leaf(batch: dict[str, np.ndarray], rows: Callable[[np.ndarray], bytes]) -> list[bytes]:
    """``rows(matrix)`` of each leaf whose rows are over 16 bytes, as a (rows, bytes) matrix."""
    n = len(next(iter(batch.values())))
    out = []
    for k in sorted(batch):
        m = np.ascontiguousarray(batch[k]).reshape(n, -1)
        if m.nbytes > 16 * n:
            out.append(rows(m))
    return out


def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """The median seconds of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Sized:
    batch_size = 256
    num_steps = None


def digest_throughput(reps: int, rounds: int = 5) -> dict[str, Any]:
    print("\n## 1. Digest throughput (one core)\n")
    print(
        common.markdown_header(
            [
                "batch",
                "MiB",
                "XXH3-128, a call per row: GB/s (µs)",
                "XXH3-128, C loop: GB/s (µs)",
                "blake2b GB/s",
                "digests_of µs (GB/s)",
                "ledger fields µs",
            ]
        )
    )
    blake = lambda b: hashlib.blake2b(b, digest_size=16).digest()  # noqa: E731
    batches = _batches()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:  # warm up: caches, plans, the allocator
        for batch in batches.values():
            ledger.step_fields(_Sized, batch, 0, 0, 1)
    figures: dict[tuple[str, str], float] = {}
    for _ in range(rounds):  # the figures take turns: a slow spell of the machine hits one round of each
        for name, batch in batches.items():
            for key, fn, n in (
                ("x", lambda b=batch: _row_calls(b, xxhash.xxh3_128_digest), reps),
                ("c", lambda b=batch: _per_leaf(b, rowhash.rows_digests), reps),
                ("b", lambda b=batch: _row_calls(b, blake), max(3, reps // 10)),
                ("d", lambda b=batch: batch_digest.digests_of(b), reps),
                ("f", lambda b=batch: ledger.step_fields(_Sized, b, 0, 0, 1), reps),
            ):
                m = _median_seconds(fn, n)
                figures[name, key] = min(figures.get((name, key), m), m)
    out = {}
    for name, batch in batches.items():
        nbytes = sum(a.nbytes for a in batch.values())
        x, c, b, d, f = (figures[name, k] for k in "xcbdf")
        out[name] = {
            "bytes": nbytes,
            "xxh3_gbs": nbytes / x / 1e9,
            "xxh3_calls_us": x * 1e6,
            "xxh3_c_loop_gbs": nbytes / c / 1e9,
            "xxh3_c_loop_us": c * 1e6,
            "blake2b_gbs": nbytes / b / 1e9,
            "digests_of_us": d * 1e6,
            "fields_us": f * 1e6,
        }
        print(
            common.markdown_row(
                [
                    name,
                    f"{nbytes / 2**20:.2f}",
                    f"{nbytes / x / 1e9:.2f} ({x * 1e6:,.0f})",
                    f"{nbytes / c / 1e9:.2f} ({c * 1e6:,.0f})",
                    f"{nbytes / b / 1e9:.2f}",
                    f"{d * 1e6:,.0f} ({nbytes / d / 1e9:.1f})",
                    f"{f * 1e6:,.0f}",
                ]
            )
        )
    return out


# --------------------------------------------------------------------------- 2. ledger cost


def _vs_grain_pipeline(heavy: bool = False) -> Any:
    import vs_grain  # the same data and pipeline

    paths = vs_grain.make_data(VS_GRAIN_RECORDS)
    common.warm_page_cache(paths)
    return vs_grain.quern_pipeline(paths, heavy_work=heavy)


def _interval(on: list[float], off: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of the cost ``1 - median(on) / median(off)``, rounds resampled as pairs."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(on), np.asarray(off)
    picks = rng.integers(0, len(a), (draws, len(a)))
    costs = 1 - np.median(a[picks], axis=1) / np.median(b[picks], axis=1)
    lo, hi = np.percentile(costs, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def ledger_cost(
    pipe: Any, plans: dict[int, tuple[int, float]], warmup: int, folder: str, what: str = ""
) -> dict[str, Any]:
    """Records/s with and without a ledger; ``plans``: workers -> (rounds, seconds per run)."""
    print(f"\n## 2. Ledger cost on the vs_grain pipeline{what}\n")
    stages: dict[str, list[float]] = {}
    cpu: dict[tuple[int, bool], list[float]] = {}  # CPU seconds of this process per batch, per round

    def case(workers: int, with_ledger: bool, seconds: float) -> Callable[[], float]:
        key = f"w{workers}-{'on' if with_ledger else 'off'}"

        def run() -> float:
            path = os.path.join(folder, f"{key}-{time.monotonic_ns()}.jsonl") if with_ledger else None
            it = common.started(pipe.iterator(num_workers=workers, ledger=path))
            try:
                for _ in range(warmup):
                    next(it)
                calls = [0]

                def step() -> Any:
                    calls[0] += 1
                    return next(it)

                c0 = time.process_time()
                rate = common.rate(step, seconds, size=lambda b: len(b["length"]))
                cpu.setdefault((workers, with_ledger), []).append((time.process_time() - c0) / calls[0])
                st = it.stats()["stages"]
                if with_ledger and st:
                    stages.setdefault(key, []).append(st.get("digest", 0.0) / max(sum(st.values()), 1e-12))
            finally:
                it.close()
            if path:
                os.remove(path)
            return rate

        return run

    got: dict[tuple[int, bool], list[float]] = {}
    for w, (runs, seconds) in plans.items():  # each worker count its own rounds (runs of 0 workers start fast)
        cases = [((w, on), case(w, on, seconds)) for on in (False, True)]
        got.update(common.interleaved(cases, runs, alternate=True))
    print(common.markdown_header(["workers", "ledger", "rounds x s", "records/s (median)", "lowest", "highest"]))
    out: dict[str, Any] = {}
    for (w, on), rates in got.items():
        runs, seconds = plans[w]
        print(
            common.markdown_row(
                [
                    w,
                    "on" if on else "off",
                    f"{runs} x {seconds:g}",
                    f"{statistics.median(rates):,.0f}",
                    f"{min(rates):,.0f}",
                    f"{max(rates):,.0f}",
                ]
            )
        )
        out[f"w{w}-{'on' if on else 'off'}"] = rates
    print()
    print(
        common.markdown_header(
            [
                "workers",
                "cost (medians)",
                "90% interval (bootstrap)",
                "cost per round: median",
                "lowest",
                "highest",
                "digest share of stage time",
            ]
        )
    )
    for w in plans:
        off, on = got[(w, False)], got[(w, True)]
        cost = 1 - statistics.median(on) / statistics.median(off)
        lo, hi = _interval(on, off)
        per = [1 - a / b for a, b in zip(on, off)]
        share = statistics.median(stages.get(f"w{w}-on", [0.0]))
        out[f"w{w}-cost"] = {"cost": cost, "interval": [lo, hi], "per_round": per, "digest_share": share}
        print(
            common.markdown_row(
                [
                    w,
                    f"{cost * 100:+.2f}%",
                    f"{lo * 100:+.2f}% to {hi * 100:+.2f}%",
                    f"{statistics.median(per) * 100:+.2f}%",
                    f"{min(per) * 100:+.2f}%",
                    f"{max(per) * 100:+.2f}%",
                    f"{share * 100:.2f}%",
                ]
            )
        )
    print("\nCPU time of this process per batch (all the work with 0 workers; the parent's with 2):\n")
    print(
        common.markdown_header(["workers", "ledger off µs/batch", "ledger on µs/batch", "cost (medians)", "per round"])
    )
    for w in plans:
        off, on = cpu[(w, False)], cpu[(w, True)]
        cost = statistics.median(on) / statistics.median(off) - 1
        per = sorted(a / b - 1 for a, b in zip(on, off))
        out[f"w{w}-cpu"] = {"off_us": [x * 1e6 for x in off], "on_us": [x * 1e6 for x in on], "cost": cost}
        print(
            common.markdown_row(
                [
                    w,
                    f"{statistics.median(off) * 1e6:,.0f} ({min(off) * 1e6:,.0f}-{max(off) * 1e6:,.0f})",
                    f"{statistics.median(on) * 1e6:,.0f} ({min(on) * 1e6:,.0f}-{max(on) * 1e6:,.0f})",
                    f"{cost * 100:+.2f}%",
                    f"median {statistics.median(per) * 100:+.2f}% ({per[0] * 100:+.2f}% to {per[-1] * 100:+.2f}%)",
                ]
            )
        )
    return out


def _hash_rows(batch: Any) -> Any:
    """``batch``, after hashing every row of its leaves of over 16 bytes a row (the C row hash), and nothing else.

    The ledger hashes the same rows inside one C call that also folds the seeds and makes the leaf digests.
    """
    batch_digest._hashed(*batch_digest._prepare(batch, "batch"))
    return batch


def _hash_queued(jobs: queue.SimpleQueue[Any]) -> None:
    """Hash the rows of each batch put on ``jobs`` (:func:`_hash_rows`) until a ``None``."""
    for batch in iter(jobs.get, None):
        _hash_rows(batch)


def hash_floor(pipe: Any, runs: int, seconds: float, warmup: int, folder: str) -> dict[str, Any]:
    """Records/s with only the row hash of every batch, in three places, against no ledger and the ledger.

    The row hash (``batch_digest._hashed``: the leaves taken, every row of every leaf over
    16 bytes hashed by the C loop; no seeds, no text, no write) is what any design that hashes every
    byte must do. Three places: on the prefetch thread as each batch is made (a ``map_batch``),
    on the consumer's thread after each ``next()``, and on a thread of its own fed by the
    consumer. 0 workers, fresh iterators, the cases taking turns.
    """
    print("\n## 2c. The floor: the row hash alone, 0 workers\n")
    hashed_pipe = pipe.map_batch(_hash_rows)

    def case(kind: str) -> Callable[[], float]:
        def run() -> float:
            path = os.path.join(folder, f"floor-{time.monotonic_ns()}.jsonl") if kind == "ledger" else None
            it = common.started((hashed_pipe if kind == "prefetch" else pipe).iterator(num_workers=0, ledger=path))
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            worker = None
            if kind == "thread":
                worker = threading.Thread(target=_hash_queued, args=(jobs,))
                worker.start()
            try:
                for _ in range(warmup):
                    next(it)
                if kind == "consumer":
                    return common.rate(lambda: _hash_rows(next(it)), seconds, size=lambda b: len(b["length"]))
                if kind == "thread":

                    def step() -> Any:
                        batch = next(it)
                        jobs.put(batch)
                        return batch

                    return common.rate(step, seconds, size=lambda b: len(b["length"]))
                return common.rate(lambda: next(it), seconds, size=lambda b: len(b["length"]))
            finally:
                if worker is not None:
                    jobs.put(None)
                    worker.join()
                it.close()
                if path:
                    os.remove(path)

        return run

    kinds = {
        "off": "no ledger, no hash",
        "prefetch": "the row hash on the prefetch thread, as each batch is made (`map_batch`)",
        "consumer": "the row hash on the consumer's thread, after each `next()`",
        "thread": "the row hash on a thread of its own, fed by the consumer",
        "ledger": "the ledger (`ledger=PATH`)",
    }
    got = common.interleaved([(k, case(k)) for k in kinds], runs, alternate=True)
    off = got["off"]
    print(common.markdown_header(["case", "records/s (median)", "cost (medians)", "90% interval (bootstrap)"]))
    out: dict[str, Any] = {}
    for k, what in kinds.items():
        cost = 1 - statistics.median(got[k]) / statistics.median(off)
        lo, hi = _interval(got[k], off) if k != "off" else (0.0, 0.0)
        out[k] = {"rates": got[k], "cost": cost, "interval": [lo, hi]}
        shown = "" if k == "off" else f"{cost * 100:+.2f}%"
        spread = "" if k == "off" else f"{lo * 100:+.2f}% to {hi * 100:+.2f}%"
        print(common.markdown_row([what, f"{statistics.median(got[k]):,.0f}", shown, spread]))
    print(f"\n{runs} rounds of {seconds:g} s per case, fresh iterators, {warmup} untimed batches each.")
    return out


def compute_path(pipes: dict[str, Any], steps: int) -> dict[str, Any]:
    """CPU per step of making a batch; wall time of digesting it right after (cold) and again (hot)."""
    print(f"\n### The compute path: making the batch vs digesting it ({steps} steps)\n")
    print(
        common.markdown_header(
            ["pipeline", "batch CPU µs/step", "digest µs cold: median (quartiles)", "hot", "cold / batch CPU"]
        )
    )
    out = {}
    for name, pipe in pipes.items():
        list(quern.pipeline.execute.step_results(pipe, range(4)))  # warm
        make, cold, hot = 0.0, [], []
        for first in range(4, 4 + steps, 16):
            t = time.process_time()
            for r in quern.pipeline.execute.step_results(pipe, range(first, min(first + 16, 4 + steps))):
                make += time.process_time() - t
                t0 = time.perf_counter()
                ledger.step_fields(pipe, r.batch, r.step, 0, 1)  # as a worker does, right after the step
                cold.append(time.perf_counter() - t0)
                t = time.process_time()
            for _ in range(8):
                t0 = time.perf_counter()
                ledger.step_fields(pipe, r.batch, r.step, 0, 1)
                hot.append(time.perf_counter() - t0)
        batch_us = make / steps * 1e6
        q = [float(np.percentile(cold, p)) * 1e6 for p in (25, 50, 75)]
        h = statistics.median(hot) * 1e6
        out[name] = {"batch_us": batch_us, "cold_us": q, "hot_us": h, "share": q[1] / batch_us}
        print(
            common.markdown_row(
                [
                    name,
                    f"{batch_us:,.0f}",
                    f"{q[1]:,.0f} ({q[0]:,.0f}-{q[2]:,.0f})",
                    f"{h:,.0f}",
                    f"{q[1] / batch_us:.2%}",
                ]
            )
        )
    return out


# --------------------------------------------------------------------------- 3. quern verify


def verify_speed(pipe: Any, steps: int, folder: str) -> dict[str, Any]:
    print(f"\n## 3. quern verify ({steps} steps)\n")
    t0 = time.perf_counter()
    result = quern.verify.compare_topologies(pipe, steps, hosts=[1, 2], workers=[0, 2])
    topo = time.perf_counter() - t0
    assert result.ok, result.lines()
    computed = steps * (1 + 4)
    path = os.path.join(folder, "run.jsonl")
    with pipe.iterator(num_workers=2, ledger=path) as it:
        for _ in range(steps):
            next(it)
    t0 = time.perf_counter()
    checked = quern.verify.check_ledger(pipe, path, num_workers=2)
    check = time.perf_counter() - t0
    assert checked.ok, checked.lines()
    print(common.markdown_header(["check", "seconds", "steps/s"]))
    print(
        common.markdown_row(
            ["compare_topologies: hosts 1,2 x workers 0,2 (+ the reference)", f"{topo:.1f}", f"{computed / topo:,.1f}"]
        )
    )
    print(common.markdown_row(["check_ledger, 2 workers", f"{check:.1f}", f"{steps / check:,.1f}"]))
    return {"compare_topologies_s": topo, "steps_computed": computed, "check_ledger_s": check, "steps": steps}


# --------------------------------------------------------------------------- 4. where


class _Huge:
    """A source of ``n`` records that is never read (where() reads nothing)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        raise AssertionError("where() read a record")

    def identity(self) -> dict[str, Any]:
        return {"type": "Huge", "n": self.n}


class _Docs:
    """Documents of the given lengths (read only by the length check of ``pack``)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Any:
        return {"tokens": np.zeros(int(self.lengths[i]), dtype=np.int32)}

    def identity(self) -> dict[str, Any]:
        return {"type": "Docs", "n": len(self.lengths)}


def _queries(fn: Callable[[int], Any], n: int, seconds: float) -> float:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, n, 100_000).tolist()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or count < 20:
        fn(ids[count % len(ids)])
        count += 1
    return count / (time.perf_counter() - t0)


def where_speed(seconds: float, folder: str) -> dict[str, Any]:
    print("\n## 4. where() queries/s\n")
    plain = quern.Pipeline.from_source(_Huge(10**9), seed=0, num_epochs=3).shuffle().batch(256)
    n = 10**6
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(5.5, 1.0, n), 1, 16384).astype(np.int64)
    t0 = time.perf_counter()
    packed = (
        quern.Pipeline.from_source(_Docs(lengths), seed=0)
        .shuffle()
        .pack(2048, key="tokens", lengths=lengths, cache_dir=folder)
        .batch(8)
    )
    packed.where(0)  # the plan of the first epoch, made once
    plan = time.perf_counter() - t0
    half = [quern.Pipeline.from_source(_Huge(n // 2), seed=s).shuffle() for s in (1, 2)]
    mixture = quern.mix({"a": half[0], "b": half[1]}, weights={"a": 0.7, "b": 0.3}, seed=3).batch(256)
    cases = [
        ("plain, N = 10**9, global shuffle, 3 epochs", lambda r: plain.where(r, epochs=3), 10**9),
        ("packed, N = 10**6 (best_fit, 2048)", lambda r: packed.where(r), n),
        ("mixture, 2 x N/2 = 10**6, component a", lambda r: mixture.where(r, component="a"), n // 2),
    ]
    print(common.markdown_header(["stream", "queries/s", "µs/query"]))
    out: dict[str, Any] = {"packing_plan_s": plan}
    for name, fn, size in cases:
        q = _queries(fn, size, seconds)
        out[name] = q
        print(common.markdown_row([name, f"{q:,.0f}", f"{1e6 / q:,.1f}"]))
    print(f"\n(the packing plan of the first epoch, made once before timing: {plan:.1f} s)")
    return out


def ledger_blocks(pipe: Any, rounds: int, block: int, folder: str) -> dict[str, Any]:
    """Records/s of one running iterator (0 workers), blocks of batches with the ledger off, on, or parts of it.

    One iterator with a ledger; for each block of ``block`` batches its ledger is taken away (off),
    kept (on; the lines kept from the last block written before the block starts), kept with the
    prefetch thread not digesting (each batch hashed as it is yielded, the design before), taken away
    with the row hash of each batch done on the consumer's thread after ``next()``, or taken away with
    the prefetch thread still making each chunk's digests (the ledger's digests, no lines or writes). The
    off, hash and both ledger cases again with a consumer that copies each batch into buffers of its own
    after ``next()`` (and after the hash), as moving a batch to a device does. Whether the prefetch
    thread digests applies to the chunks it starts after the change, so after each change the
    batches already made or in flight are taken untimed first. No iterator starts inside a timed
    block, and the blocks of a round are next to each other in time.
    """
    print(f"\n## 2d. One running iterator, blocks of {block} batches, 0 workers\n")
    it = common.started(pipe.iterator(num_workers=0, ledger=os.path.join(folder, "blocks.jsonl")))
    writer, feed = it._ledger, it._feed
    kinds = {  # those digesting on the prefetch thread last: one change a round (every second round reversed)
        "off": "no ledger",
        "hash": "the row hash alone, on the consumer's thread",
        "off+copy": "no ledger; the consumer copies each batch",
        "hash+copy": "the row hash alone; the consumer copies each batch",
        "ledger@yield": "the ledger, each batch hashed as it is yielded (on the consumer's thread, as before)",
        "ledger@yield+copy": "the same; the consumer copies each batch",
        "digests": "the ledger's digests alone, on the prefetch thread (no lines, no writes)",
        "ledger+copy": "the ledger; the consumer copies each batch",
        "ledger": "the ledger",
    }
    got: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        staging = {k: np.empty_like(v) for k, v in next(it).items()}  # the consumer's buffers
        for _ in range(20):
            next(it)
        for r in range(rounds):
            for k in list(kinds)[:: 1 if r % 2 == 0 else -1]:
                digests = k.startswith(("ledger", "digests")) and not k.startswith("ledger@yield")
                if feed.digesting != digests:
                    feed.digesting = digests
                    it._ledger = None
                    flow = it.stats()["host_prefetch"]
                    for _ in range(flow["ready"] + flow["in_flight"]):
                        next(it)
                it._ledger = writer if k.startswith("ledger") else None
                writer.flush()
                rows, t0 = 0, time.perf_counter()
                for _ in range(block):
                    batch = next(it)
                    if k.startswith("hash"):
                        _hash_rows(batch)
                    if k.endswith("+copy"):
                        for key, value in batch.items():
                            np.copyto(staging[key], value)
                    rows += len(batch["length"])
                got[k].append(rows / (time.perf_counter() - t0))
    finally:
        it._ledger = writer
        it.close()
    print(common.markdown_header(["case", "records/s (median)", "cost (medians)", "90% interval", "per pair: median"]))
    out: dict[str, Any] = {}
    for k, what in kinds.items():
        base = got["off+copy" if k.endswith("+copy") else "off"]
        cost = 1 - statistics.median(got[k]) / statistics.median(base)
        lo, hi = _interval(got[k], base) if not k.startswith("off") else (0.0, 0.0)
        per = statistics.median(1 - a / b for a, b in zip(got[k], base))
        out[k] = {"rates": got[k], "cost": cost, "interval": [lo, hi], "per_pair": per}
        shown = ["", "", ""] if k.startswith("off") else [f"{cost:+.2%}", f"{lo:+.2%} to {hi:+.2%}", f"{per:+.2%}"]
        print(common.markdown_row([what, f"{statistics.median(got[k]):,.0f}", *shown]))
    print(
        f"\n{rounds} rounds, the cases in turn (every second round reversed); the costs with a copying consumer are "
        "against the copying consumer without a ledger."
    )
    return out


_PARTS = [  # (owner, attribute, what): the ledger's work with 0 workers, in the order it runs
    (digesting, "_prepare", "the batch's leaves and layout (`_prepare`), on the prefetch thread"),
    (
        rowhash,
        "batch_digests_into",
        "the C digests: row hash, seeds, leaf digests (`rowhash.batch_digests_into`), on the prefetch thread",
    ),
    (digesting.Digesting, "finish_views", "hex digits of a chunk's row digests (`Digesting.finish_views`)"),
    (threads, "made_of", "`made_of`: the three above, per batch of the chunks made (the prefetch thread)"),
    (ledger.LedgerWriter, "_write", "`LedgerWriter._write` (the lines' pieces, `writev`)"),
    (ledger.LedgerWriter, "add_made", "`LedgerWriter.add_made`: the line as the batch is yielded, with the writes"),
]
_LEDGER = (_PARTS[3][2], _PARTS[5][2])  # the parts that together are the whole ledger (one per thread)


def _idle_ticks() -> tuple[int, int] | None:
    """(idle, all) CPU ticks of the machine since boot (``/proc/stat``; ``None`` elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return ticks[3] + ticks[4], sum(ticks)


def ledger_parts(pipe: Any, rounds: int, seconds: float, folder: str) -> dict[str, Any]:
    """The CPU time per batch of each part of the ledger in a running iterator (0 workers).

    Each part's function is wrapped with a timer of the calling thread's CPU (``time.thread_time``;
    the wrapper adds about 1 µs a call); the iterator runs ``seconds`` after 20 untimed batches,
    ``rounds`` times; the median per part. Beside it: the process's CPU per batch and the machine's
    idle share over the same seconds (``/proc/stat``).
    """
    print("\n## 2b. Where the ledger's time goes, 0 workers (CPU in a running iterator)\n")
    spent: dict[str, list[float]] = {what: [] for _, _, what in _PARTS}
    totals: list[tuple[float, float, float | None]] = []  # (process CPU per batch, wall per batch, idle share)
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in _PARTS]
    for _ in range(rounds):
        acc = dict.fromkeys(spent, 0.0)
        for (owner, name, fn), (_, _, what) in zip(originals, _PARTS):
            setattr(owner, name, _cpu_timed(fn, acc, what))
        try:
            path = os.path.join(folder, f"parts-{time.monotonic_ns()}.jsonl")
            it = common.started(pipe.iterator(num_workers=0, ledger=path))
            try:
                for _ in range(20):
                    next(it)
                for k in acc:
                    acc[k] = 0.0
                idle0, c0, t0, n = _idle_ticks(), time.process_time(), time.perf_counter(), 0
                while time.perf_counter() - t0 < seconds:
                    next(it)
                    n += 1
                wall, cpu, idle1 = time.perf_counter() - t0, time.process_time() - c0, _idle_ticks()
            finally:
                it.close()
            os.remove(path)
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)
        share = None if idle0 is None or idle1 is None else (idle1[0] - idle0[0]) / max(idle1[1] - idle0[1], 1)
        totals.append((cpu / n, wall / n, share))
        for k, v in acc.items():
            spent[k].append(v / n)
    cpu_batch = statistics.median(t[0] for t in totals)
    print(common.markdown_header(["part", "CPU µs per batch", "share of the process's CPU"]))
    out: dict[str, Any] = {}
    for what, values in spent.items():
        us = statistics.median(values) * 1e6
        out[what] = us
        print(common.markdown_row([what, f"{us:,.1f}", f"{us / (cpu_batch * 1e6):.2%}"]))
    out["the ledger"] = sum(out[what] for what in _LEDGER)
    print(
        common.markdown_row(
            [
                "**the ledger** (`made_of` and `add_made`)",
                f"{out['the ledger']:,.1f}",
                f"{out['the ledger'] / (cpu_batch * 1e6):.2%}",
            ]
        )
    )
    wall = statistics.median(t[1] for t in totals)
    shares = [t[2] for t in totals if t[2] is not None]
    idle = f"; the machine idle {statistics.median(shares):.0%} of the time" if shares else ""
    print(
        f"\nThe process: {cpu_batch * 1e6:,.0f} µs of CPU per batch in {wall * 1e6:,.0f} µs of wall time "
        f"({cpu_batch / wall:.2f} cores){idle}. Median of {rounds} runs of {seconds:g} s."
    )
    out.update(cpu_per_batch_us=cpu_batch * 1e6, wall_per_batch_us=wall * 1e6)
    hot = _hot_hash_seconds(pipe.batch_at(0), 500)
    out["hot_hash_us"] = hot * 1e6
    print(
        f"The bound of any design that hashes every byte: the C row hash of one batch already in the cache "
        f"(the same batch, 500 calls, the median) takes {hot * 1e6:.1f} µs, {hot / wall:.2%} of a batch's wall "
        "time above, with nothing else of the ledger (no leaves, seeds, text or write)."
    )
    return out


def _hot_hash_seconds(batch: dict[str, np.ndarray], reps: int) -> float:
    """The median seconds of the C row hash of ``batch``'s leaves of over 16 bytes a row, hot in the cache."""
    _per_leaf(batch, rowhash.rows_digests)  # the library loaded, the batch in the cache
    return _median_seconds(lambda: _per_leaf(batch, rowhash.rows_digests), reps)


def _cpu_timed(fn: Callable[..., Any], acc: dict[str, float], what: str) -> Callable[..., Any]:
    """``fn`` adding the calling thread's CPU seconds of each call to ``acc[what]``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[what] += time.thread_time() - t0

    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--runs0", type=int, default=300, help="interleaved rounds of the ledger cost, 0 workers (default 300)"
    )
    ap.add_argument("--seconds0", type=float, default=0.1, help="timed seconds per run, 0 workers (default 0.1)")
    ap.add_argument(
        "--runs", type=int, default=12, help="interleaved rounds of the ledger cost with workers (default 12)"
    )
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per run with workers (default 1)")
    ap.add_argument(
        "--workers",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 2],
        help="worker counts of the ledger cost, comma-separated (default 0,2)",
    )
    ap.add_argument("--warmup", type=int, default=5, help="untimed batches per ledger-cost run (default 5)")
    ap.add_argument(
        "--floor-runs", type=int, default=150, help="interleaved rounds of part 2c, 0 workers (default 150)"
    )
    ap.add_argument(
        "--block-rounds", type=int, default=400, help="rounds of part 2d, blocks of 32 batches (default 400)"
    )
    ap.add_argument("--parts-seconds", type=float, default=3.0, help="timed seconds per run of part 2b (default 3)")
    ap.add_argument("--reps", type=int, default=200, help="calls per digest figure (default 200)")
    ap.add_argument("--path-steps", type=int, default=160, help="steps of the compute-path figure (default 160)")
    ap.add_argument("--verify-steps", type=int, default=32, help="steps of the quern verify figures (default 32)")
    ap.add_argument("--where-seconds", type=float, default=1.0, help="timed seconds per where() figure (default 1)")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["digests", "ledger", "floor", "parts", "blocks", "heavy", "path", "verify", "where"],
        help="skip a part (repeatable)",
    )
    args = common.parse_args(ap)
    assert args is not None
    t_start = time.perf_counter()
    print("# Verify: ledger cost, digest throughput, quern verify, where\n")
    print(common.command_line())
    print(common.machine_line(xxhash=xxhash.VERSION))
    print(f"row hash: {'the C loop' if rowhash.is_native() else 'a Python call per row: ' + rowhash.native_why()}")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="quern-bench-verify-") as folder:
        if "digests" not in args.skip:
            figures["digests"] = digest_throughput(args.reps)
        pipe = (
            _vs_grain_pipeline() if {"ledger", "floor", "parts", "blocks", "path", "verify"} - set(args.skip) else None
        )
        if "ledger" not in args.skip:
            plans = {w: (args.runs0, args.seconds0) if w == 0 else (args.runs, args.seconds) for w in args.workers}
            figures["ledger"] = ledger_cost(pipe, plans, args.warmup, folder)
        if "floor" not in args.skip:
            figures["hash_floor"] = hash_floor(pipe, args.floor_runs, args.seconds0, args.warmup, folder)
        if "parts" not in args.skip:
            figures["ledger_parts"] = ledger_parts(pipe, 3, args.parts_seconds, folder)
        if "blocks" not in args.skip:
            figures["ledger_blocks"] = ledger_blocks(pipe, args.block_rounds, 32, folder)
        heavy = _vs_grain_pipeline(heavy=True) if {"heavy", "path"} - set(args.skip) else None
        if "heavy" not in args.skip:
            what = " with its CPU-heavy transform (--heavy of vs_grain.py), 2 workers"
            figures["ledger_heavy"] = ledger_cost(heavy, {2: (args.runs, args.seconds)}, 2, folder, what)
        if "path" not in args.skip:
            figures["compute_path"] = compute_path({"vs_grain": pipe, "vs_grain --heavy": heavy}, args.path_steps)
        if "verify" not in args.skip:
            figures["verify"] = verify_speed(pipe, args.verify_steps, folder)
        if "where" not in args.skip:
            figures["where"] = where_speed(args.where_seconds, folder)
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s")
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
