"""Observability: what the stage timings cost, and what the adaptive host prefetch window buys.

What is measured
----------------
**1. Cost of the stage timings** (``pipe.iterator(timings=True)``, the default, against
``timings=False``): records/s of the same pipeline as fast as possible (``next()`` in a loop, no
training step), with ``num_workers=0`` (one prefetch thread) and ``num_workers=2``, for

* **light**: ``Pipeline.from_source({"x": arange(--records)}, seed=0).shuffle().batch(32)
  .map_batch(light)`` (``light``: ``x * 2 + 1``, vectorised): reading and collating 32 int64s is
  nearly free, so the per-step cost of the clock is as visible as it can be;
* **arrayrecord**: ``from_source(ArrayRecordSource(...), seed=0).shuffle().map(decode(int32))
  .map(pad(128)).batch(32)`` over 100,000 records of 32..256 int32 tokens in 4 shards (made once
  under ``benchmarks/data/observability/``).

Each run: a new iterator, (with workers: ``wait_for_workers``), 50 warm-up steps, then ``next()``
for ``--seconds``. ``--rounds`` rounds, on and off in each (on/off, then off/on, ...). Reported:
the median records/s of each, the median of the rounds' off / on ratios and the cost in %
(``1 - on / off``), the mean time of one ``next()`` in microseconds, and the CPU time per step of
this process and the worker processes (``time.process_time`` and ``/proc/PID/task/*/schedstat``),
which other load on the machine disturbs less than wall time.

Then the per-step cost directly, on the compute path alone (what a prefetch thread or a worker
runs): ``execute.batches_at`` of the same 16-step chunks with a timings dict and with ``None``,
alternating chunk by chunk on this thread (``--chunks`` chunks each, median of 3), CPU
(``time.thread_time``) and wall microseconds per step. The clock's own cost is printed first:
nanoseconds per ``Clock.lap`` with a dict (on) and with ``None`` (off).

**2. Adaptive vs fixed host prefetch on a step-time trace with bursts.** A loader whose batches
take ``--load-ms`` ms each (``map_batch(slow)``: ``time.sleep`` of that long, as a decode that
releases the GIL, then ``x * 2 + 1``), ``read_ahead=1`` so that ``prefetch=k`` keeps k batches
ahead (``num_workers=0``; with ``num_workers=2``, k tasks of 1 step per worker). A training loop
that follows a fixed trace: steps of ``--step-ms`` ms (``time.sleep`` to a deadline counted from
the return of ``next()``: the CPU is free, as during a device step), except a burst of ``--burst``
steps of ``--burst-ms`` ms every ``--every`` steps (at the end of each period: a stretch where
the training outruns the loader). Two traces: bursts of ``--burst`` steps and of ``--short-burst``
steps (shorter than the adaptive window: the case the rule ``max(2 x step / load, 5)`` is for).
The same pipeline and seed for ``prefetch=1``, ``2`` (the fixed default depth), ``5`` and
``None`` (adaptive), in ``--trace-rounds`` rounds (the second in reverse order); with
``num_workers=2`` (worker processes, on 2 cores) the first trace, one round. One row per run:
the seconds spent in ``next()`` after the first batch (own measure) and
``stats()["data_wait"]["total"]``, the mean and median wait per step, the steps that waited over
1 ms, the wait inside bursts, ``stats()["bubble_rate_total"]``, the final
``stats()["host_prefetch"]`` ``depth`` (the most batches kept ahead: with workers, ``prefetch``
tasks of 1 step per worker, i.e. 2 x ``prefetch``) and ``window`` (0: fixed; with the range it
took, sampled every 8 steps), the wall time, the trace's own step time as run (wall less wait,
per step), the first batch's wait (left out of the other figures), and whether every batch
equals the first run's (a blake2b digest of every batch). Then the mean data wait of fixed
``prefetch=2`` over adaptive.

Nothing is asserted; it prints markdown tables. Run:

    .venv/bin/python benchmarks/observability.py [--seconds 0.5] [--rounds 8] [--steps 400]

(``--help`` lists the trace's knobs.)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import time
from typing import Any

import common
import numpy as np

import quern
from quern.pipeline import execute
from quern.pipeline.core.timing import Clock
from quern.pipeline.iterate.iterator import THREAD_READ_STEPS

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "observability")
AR_META = {"records": 100_000, "shards": 4, "lengths": [32, 256], "seed": 0, "dtype": "int32", "format": 1}
BATCH = 32
WAIT_MS = 1.0  # a step "waited" when its next() took longer than this


# --------------------------------------------------------------------------- transforms (module level: picklable)


def light(batch: dict) -> dict:
    """A cheap vectorised batch transform."""
    return {"x": batch["x"] * 2 + 1}


def slow(batch: dict, seconds: float) -> dict:
    """A batch transform that takes ``seconds`` without holding the GIL (as a C decode would)."""
    time.sleep(seconds)
    return {"x": batch["x"] * 2 + 1}


# --------------------------------------------------------------------------- data


def arrayrecord_paths() -> list[str]:
    """Write (or reuse) the ArrayRecord shards of the arrayrecord pipeline; their paths."""
    n, shards = AR_META["records"], AR_META["shards"]
    paths = [os.path.join(DATA, f"tokens-{i:05d}-of-{shards:05d}.array_record") for i in range(shards)]
    lo, hi = AR_META["lengths"]
    took = common.token_shards(DATA, AR_META, [(paths, (lo, hi))], n, AR_META["seed"])
    if took is not None:
        print(f"made {n:,} records in {shards} shards under {DATA} in {took:.1f} s", flush=True)
    return paths


# --------------------------------------------------------------------------- 1. cost of the stage timings


def lap_ns(on: bool, laps: int = 1_000_000) -> float:
    """Nanoseconds per ``Clock.lap`` with a dict (``on``) or ``None``, over 4 stage names."""
    clock = Clock({} if on else None)
    names = ["read", "map[0] decode", "map[1] pad", "collate"]
    t0 = time.perf_counter()
    for _ in range(laps // 4):
        for name in names:
            clock.lap(name)
    return (time.perf_counter() - t0) / laps * 1e9


def direct(pipe: quern.Pipeline, chunk: int, chunks: int) -> tuple[float, float, float, float]:
    """The compute path alone, on this thread: ``execute.batches_at`` of the same ``chunk`` steps with a
    timings dict and without, alternating, for ``chunks`` chunks; (on, off) CPU microseconds per step
    (``time.thread_time``) and (on, off) wall microseconds per step."""
    cpu = {True: 0.0, False: 0.0}
    wall = {True: 0.0, False: 0.0}
    for c in range(chunks + 2):
        first = (c % 64) * chunk
        for on in (True, False) if c % 2 else (False, True):
            c0, w0 = time.thread_time(), time.perf_counter()
            execute.batches_at(pipe, first, chunk, 0, 1, {} if on else None)
            if c >= 2:  # two warm-up chunks
                cpu[on] += time.thread_time() - c0
                wall[on] += time.perf_counter() - w0
    n = chunks * chunk / 1e6
    return cpu[True] / n, cpu[False] / n, wall[True] / n, wall[False] / n


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of this process (all its threads) and of the processes ``pids`` (all their threads, from
    ``/proc/PID/task/*/schedstat``: nanoseconds on a CPU)."""
    total = time.process_time()
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError):
            pass
    return total


def throughput(pipe: quern.Pipeline, workers: int, timings: bool, seconds: float) -> tuple[float, float, float]:
    """(records/s, microseconds per ``next()``, CPU microseconds per step of this process and the
    workers) as fast as possible, after 50 warm-up steps."""
    with common.started(pipe.iterator(num_workers=workers, timings=timings)) as it:
        for _ in range(50):
            next(it)
        pids = it.worker_pids
        n, cpu0, t0 = 0, cpu_seconds(pids), time.perf_counter()
        while True:
            for _ in range(16):
                next(it)
            n += 16
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        cpu = cpu_seconds(pids) - cpu0
        stages = it.stats()["stages"]
        if bool(stages) != timings:
            raise RuntimeError(f"timings={timings} but stats()['stages'] = {stages}")
        return n * BATCH / dt, dt / n * 1e6, cpu / n * 1e6


def part1(args: argparse.Namespace) -> None:
    print("\n## 1. Cost of the stage timings (timings=True vs timings=False), as fast as possible\n")
    on_ns = statistics.median(lap_ns(True) for _ in range(3))
    off_ns = statistics.median(lap_ns(False) for _ in range(3))
    print(
        f"Clock.lap: {on_ns:.0f} ns with timings (a clock read and a dict update), {off_ns:.0f} ns "
        f"without (median of 3 x 1,000,000 laps)\n"
    )
    ids = {"x": np.arange(args.records, dtype=np.int64)}
    cases = [("light", quern.Pipeline.from_source(ids, seed=0).shuffle().batch(BATCH).map_batch(light))]
    if not args.no_arrayrecord:
        src = quern.sources.ArrayRecordSource(arrayrecord_paths())
        cases.append(
            (
                "arrayrecord",
                quern.Pipeline.from_source(src, seed=0)
                .shuffle()
                .map(quern.transforms.decode(np.int32))
                .map(quern.transforms.pad(128))
                .batch(BATCH),
            )
        )
    print(
        f"{args.rounds} rounds of {args.seconds:g} s per run, on and off in each (on/off, then off/on, ...). "
        "rec/s: median over the runs; off / on: median of the rounds' ratios (paired), cost = 1 - on / off; "
        "us/step: median mean time of one next(); CPU us/step: CPU time of this process and the workers per "
        "step (less sensitive to other load than wall time); runs: records/s of each run, thousands\n"
    )
    header = ["pipeline", "workers", "on: rec/s", "off: rec/s", "off / on", "cost", "on: us/step", "off: us/step"]
    header += ["on: CPU us/step", "off: CPU us/step", "CPU cost", "runs on", "runs off"]
    print(common.markdown_header(header, left=(0, 11, 12)))
    for name, pipe in cases:
        for workers in (0, 2):
            both = [(t, functools.partial(throughput, pipe, workers, t, args.seconds)) for t in (True, False)]
            runs = common.interleaved(both, args.rounds, alternate=True)

            def med(timings: bool, k: int, runs: dict[bool, list[tuple[float, float, float]]] = runs) -> float:
                return statistics.median(x[k] for x in runs[timings])

            ratio = statistics.median(off[0] / on[0] for on, off in zip(runs[True], runs[False]))
            cpu_on, cpu_off = med(True, 2), med(False, 2)
            row = [name, workers, f"{med(True, 0):,.0f}", f"{med(False, 0):,.0f}", f"{ratio:.3f}"]
            row += [f"{(1 - 1 / ratio) * 100:+.1f}%", f"{med(True, 1):.1f}", f"{med(False, 1):.1f}"]
            row += [f"{cpu_on:.1f}", f"{cpu_off:.1f}", f"{(cpu_on / cpu_off - 1) * 100:+.1f}%"]
            row += [common.join_runs((x[0] / 1000 for x in runs[t]), ".0f", " ") for t in (True, False)]
            print(common.markdown_row(row), flush=True)
    print(
        "\nThe compute path alone (what a prefetch thread or a worker runs per chunk): execute.batches_at of the "
        f"same {THREAD_READ_STEPS}-step chunks with a timings dict and with None, alternating chunk by chunk on "
        f"this thread, {args.chunks} chunks each; CPU time of the thread (time.thread_time) and wall time\n"
    )
    header = ["pipeline", "on: CPU us/step", "off: CPU us/step", "CPU cost us/step", "CPU cost", "on: wall us/step"]
    print(common.markdown_header([*header, "off: wall us/step", "wall cost"]))
    for name, pipe in cases:
        reps = [direct(pipe, THREAD_READ_STEPS, args.chunks) for _ in range(3)]
        c_on, c_off, w_on, w_off = (statistics.median(r[k] for r in reps) for k in range(4))
        row = [name, f"{c_on:.1f}", f"{c_off:.1f}", f"{c_on - c_off:+.2f}", f"{(c_on / c_off - 1) * 100:+.2f}%"]
        row += [f"{w_on:.1f}", f"{w_off:.1f}", f"{(w_on / w_off - 1) * 100:+.2f}%"]
        print(common.markdown_row(row), flush=True)


# --------------------------------------------------------------------------- 2. adaptive vs fixed prefetch


def trace(steps: int, step_ms: float, burst_ms: float, burst: int, every: int) -> list[float]:
    """Seconds of each training step: ``step_ms``, but the last ``burst`` of every ``every`` steps ``burst_ms``."""
    return [(burst_ms if i % every >= every - burst else step_ms) / 1000 for i in range(steps)]


def digest(batch: dict) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(batch):
        a = np.ascontiguousarray(batch[key])
        h.update(f"{key}:{a.dtype}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.digest()


def train(pipe: quern.Pipeline, prefetch: int | None, workers: int, steps: list[float]) -> dict[str, Any]:
    """Follow the trace ``steps`` with an iterator of ``prefetch`` (``None``: adaptive); figures of the run."""
    with common.started(pipe.iterator(num_workers=workers, prefetch=prefetch, read_ahead=1)) as it:
        waits, digests, windows = [], [], []
        t_start = time.perf_counter()
        for s, step_s in enumerate(steps):
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            waits.append(t1 - t0)
            digests.append(digest(batch))
            del batch
            if s % 8 == 0:
                windows.append(it.stats()["host_prefetch"]["window"])
            while (left := t1 + step_s - time.perf_counter()) > 0:
                time.sleep(left)
        wall = time.perf_counter() - t_start
        st = it.stats()
    return {"waits": np.array(waits), "digests": digests, "stats": st, "wall": wall, "windows": windows}


def part2(args: argparse.Namespace) -> None:
    print("\n## 2. Adaptive vs fixed host prefetch on a step-time trace with bursts\n")
    ids = {"x": np.arange(args.records, dtype=np.int64)}
    load = functools.partial(slow, seconds=args.load_ms / 1000)
    pipe = quern.Pipeline.from_source(ids, seed=0).shuffle().batch(BATCH).map_batch(load)
    variants: list[tuple[str, int | None]] = [
        ("prefetch=1", 1),
        ("prefetch=2 (fixed default)", 2),
        ("prefetch=5", 5),
        ("prefetch=None (adaptive)", None),
    ]
    traces = [
        (0, args.burst, args.trace_rounds),
        (0, args.short_burst, args.trace_rounds),
        (2, args.burst, 1),
    ]
    for workers, burst, rounds in traces:
        steps = trace(args.steps, args.step_ms, args.burst_ms, burst, args.every)
        in_burst = np.array([i % args.every >= args.every - burst for i in range(args.steps)])
        mean_step = sum(steps) / len(steps) * 1000
        print(
            f"\n### num_workers={workers}, read_ahead=1; {args.steps} steps of {args.step_ms:g} ms with a burst of "
            f"{burst} steps of {args.burst_ms:g} ms every {args.every} (mean step {mean_step:.2f} ms); loader "
            f"{args.load_ms:g} ms per batch (sleep){'' if workers else ', one thread'}; {rounds} round(s)\n"
        )
        cases = [(name, functools.partial(train, pipe, prefetch, workers, steps)) for name, prefetch in variants]
        runs = common.interleaved(cases, rounds, alternate=True)
        ref = runs[variants[0][0]][0]["digests"]
        header = ["prefetch", "round", "data wait s (own)", "stats data_wait total s", "mean / median wait ms"]
        header += [f"steps > {WAIT_MS:g} ms", "wait in bursts s", "bubble_rate_total", "depth", "window (last; range)"]
        print(common.markdown_header([*header, "wall s", "own step ms", "first batch ms", "batches"], left=(0, 13)))
        for name, _ in variants:
            for r, x in enumerate(runs[name]):
                w, st = x["waits"], x["stats"]
                win = st["host_prefetch"]["window"]
                wr = f"{min(x['windows'])}-{max(x['windows'])}" if win else "-"
                own = (x["wall"] - w.sum()) / len(w) * 1000  # the trace's steps as they were slept
                row = [name, r + 1, f"{w[1:].sum():.3f}", f"{st['data_wait']['total']:.3f}"]
                row += [f"{w[1:].mean() * 1000:.3f} / {np.median(w[1:]) * 1000:.3f}"]
                row += [f"{int((w[1:] > WAIT_MS / 1000).sum())} / {len(w) - 1}", f"{w[in_burst].sum():.3f}"]
                row += [f"{st['bubble_rate_total']:.4f}", st["host_prefetch"]["depth"], f"{win}; {wr}"]
                row += [f"{x['wall']:.2f}", f"{own:.2f}", f"{w[0] * 1000:.1f}"]
                row += ["= prefetch=1 round 1" if x["digests"] == ref else "DIFFER"]
                print(common.markdown_row(row), flush=True)

        fixed, adaptive = runs[variants[1][0]], runs[variants[3][0]]
        f_all, a_all = mean_wait(fixed, None), mean_wait(adaptive, None)
        f_b, a_b = mean_wait(fixed, in_burst), mean_wait(adaptive, in_burst)
        print(
            f"\nmean over rounds, {variants[1][0]} / {variants[3][0]}: data wait {f_all:.3f} / {a_all:.3f} s = "
            f"{f_all / a_all:.2f}x; in bursts {f_b:.3f} / {a_b:.3f} s = {f_b / max(a_b, 1e-9):.2f}x"
        )


def mean_wait(runs: list[dict[str, Any]], mask: np.ndarray | None) -> float:
    """Mean over ``runs`` of the seconds waited after the first batch (``mask``: only the steps it marks)."""
    return statistics.mean(float(x["waits"][1:].sum() if mask is None else x["waits"][mask].sum()) for x in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000, help="records of the in-memory source")
    ap.add_argument("--seconds", type=float, default=0.5, help="timed seconds per throughput run (default 0.5)")
    ap.add_argument("--rounds", type=int, default=8, help="on/off rounds per throughput case (default 8)")
    ap.add_argument("--chunks", type=int, default=400, help="chunks of the compute-path measure (default 400)")
    ap.add_argument("--no-arrayrecord", action="store_true", help="skip the ArrayRecord pipeline of part 1")
    ap.add_argument("--steps", type=int, default=400, help="steps per trace run (default 400)")
    ap.add_argument("--step-ms", type=float, default=12.0, help="a training step (default 12)")
    ap.add_argument("--burst-ms", type=float, default=0.5, help="a step in a burst (default 0.5)")
    ap.add_argument("--burst", type=int, default=10, help="steps per burst (default 10)")
    ap.add_argument("--short-burst", type=int, default=4, help="steps per burst, second trace (default 4)")
    ap.add_argument("--every", type=int, default=50, help="steps between burst starts (default 50)")
    ap.add_argument("--load-ms", type=float, default=4.0, help="loader time per batch (default 4)")
    ap.add_argument("--trace-rounds", type=int, default=2, help="rounds of each num_workers=0 trace (default 2)")
    ap.add_argument("--skip", choices=["1", "2"], help="skip part 1 or part 2")
    args = ap.parse_args()
    t_start = time.perf_counter()
    print("# Observability: stage timings cost, adaptive host prefetch\n")
    print(common.command_line())
    print("\n" + common.machine_line())
    if args.skip != "1":
        part1(args)
    if args.skip != "2":
        part2(args)
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
