"""The preprocessing service on Ray (``quern.RayService``): what scale-out buys and what it costs.

What is measured (one run; nothing is asserted)
-----------------------------------------------
A Ray head is started here (``ray start --head --block`` on 127.0.0.1, its own temporary folder and ports,
its processes pinned to one set of cores with ``sched_setaffinity``); the trainer (this process) connects to it.

1. **CPU-heavy pipeline, the trainer on one core.** The vs_grain token pipeline plus a map of about 1 ms of
   NumPy work per record (``heavy``, calibrated at the start), batches of 32. The trainer is pinned to core 0;
   the cluster's actors to core 1. Records/s through the service (1 actor) vs the trainer's own workers
   (``num_workers`` 1 and 2, which inherit its one core) and vs the trainer alone (``num_workers=0``). The
   ratio is the point: the service adds the cores of other machines.
2. **Light pipeline** (the vs_grain work, batches of 256, no pinning, 2 actors on the 2 cores): records/s and
   the trainer's CPU seconds per batch through the service vs 2 local workers. The trainer's CPU per batch is
   the figure that predicts scale-out: one trainer core receives at most ``1 / cpu_per_batch`` batches/s.
3. **Time to first batch**: from ``pipe.iterator(service=svc)`` to its first batch (actors started and
   the pipeline loaded in them), vs ``pipe.iterator(num_workers=2)``.
4. **Receive rate**: batches of 256 x 512 int32 (0.5 MiB) from an in-memory source (almost no work per batch)
   through 2 actors: the MiB/s and batches/s the trainer receives, and its CPU per batch.
5. **Hedging trace**: 2 actors, one of which sleeps 1 s in each of its units from a point on (a marker file);
   seconds per step without and with hedging, the hedges counted, and every batch checked against ``batch_at``.

Run::

    .venv/bin/python benchmarks/service.py            # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import common
import numpy as np

import quern

RECORDS = 200_000  # the vs_grain data set
HEAVY_BATCH = 32
HEAVY_STEPS = 128  # timed steps: many units (16 steps each), so what was computed ahead does not count much
HEAVY_WARMUP = 32  # steps first: the units computed while the first batch was awaited are drained
LIGHT_BATCH = 256
LIGHT_ROUNDS = 5  # interleaved runs of the light pipeline, each way


def heavy(record: dict, rounds: int) -> dict:
    """About ``rounds`` x 12 µs of NumPy work on the tokens; adds a ``score``."""
    x = record["tokens"].astype(np.float32)
    for _ in range(rounds):
        x = np.sort(np.cumsum(x * np.float32(1e-3)) % np.float32(7.0))
    return {**record, "score": np.float32(x[-1])}


def sleepy(batch: dict, folder: str) -> dict:
    """Sleeps 1 s when this process's marker file exists (the straggler of the hedging trace)."""
    if os.path.exists(os.path.join(folder, f"slow-{os.getpid()}")):
        time.sleep(1.0)
    return batch


def token_pipeline(paths: list[str], batch: int, rounds: int = 0) -> quern.Pipeline:
    pipe = (
        quern.Pipeline.from_source(quern.sources.ArrayRecordSource(paths), seed=0)
        .shuffle()
        .map(quern.transforms.decode(np.int32))
        .map(quern.transforms.pad(512))
    )
    if rounds:
        pipe = pipe.map(functools.partial(heavy, rounds=rounds))
    return pipe.batch(batch)


def calibrate(paths: list[str], target_ms: float = 1.0) -> tuple[int, float]:
    """Rounds of ``heavy`` for about ``target_ms`` per record, and the measured ms."""
    rows = token_pipeline(paths, 64).batch_at(0)
    recs = [{"tokens": t, "length": n} for t, n in zip(rows["tokens"], rows["length"])]

    def ms(rounds: int) -> float:
        t0 = time.perf_counter()
        for r in recs:
            heavy(r, rounds)
        return (time.perf_counter() - t0) / len(recs) * 1e3

    rounds = 10
    for _ in range(3):  # rescale until the measured cost is near the target
        got = min(ms(rounds) for _ in range(3))
        rounds = max(1, round(rounds * target_ms / got))
    return rounds, min(ms(rounds) for _ in range(3))


# --------------------------------------------------------------------------- the cluster


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Head:
    """A Ray head on 127.0.0.1 (``ray start --head --block``), its processes on ``cores``."""

    def __init__(self, cpus: int, cores: set[int]) -> None:
        self.tmp = tempfile.mkdtemp(prefix="qb", dir="/tmp")
        port, *others = _free_ports(9)
        names = [
            "dashboard-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
            "node-manager-port",
            "object-manager-port",
            "ray-client-server-port",
        ]
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            f"--num-cpus={cpus}",
            "--object-store-memory=400000000",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={self.tmp}",
            *(f"--{n}={p}" for n, p in zip(names, others)),
        ]
        self.log = open(os.path.join(self.tmp, "head.log"), "wb")
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )
        self.address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in open(os.path.join(self.tmp, "head.log"), errors="replace").read():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Ray head did not start:\n" + open(os.path.join(self.tmp, "head.log")).read())
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# --------------------------------------------------------------------------- measurements


def run(pipe: Any, steps: int, warmup: int, **options: Any) -> dict[str, float]:
    """records/s, trainer CPU µs per batch and time to first batch of ``pipe.iterator(**options)``."""
    t0 = time.perf_counter()
    it = pipe.iterator(**options)
    try:
        first = next(it)
        ttfb = time.perf_counter() - t0
        for _ in range(warmup):
            next(it)
        rows = len(first["length"])
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            next(it)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        service = it.stats().get("service")
    finally:
        it.close()
    return {
        "records_s": steps * rows / wall,
        "batches_s": steps / wall,
        "cpu_us_per_batch": cpu / steps * 1e6,
        "first_batch_s": ttfb,
        "hedges": service["hedges"] if service else 0,
    }


def child(case: str, address: str, data: list[str], rounds: int, folder: str) -> dict[str, Any]:
    """One measurement in a fresh process (a trainer connecting to ``address``, or none for local cases)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    out: dict[str, Any] = {}
    if case.startswith("heavy"):
        os.sched_setaffinity(0, {0})  # the trainer (and its own workers) on core 0
        pipe = token_pipeline(data, HEAVY_BATCH, rounds)
        if case == "heavy-service":
            import ray

            with quern.RayService(address, num_actors=1) as svc:
                svc.attach(pipe)
                svc.wait_ready()
                pids = [ray.get(a.pid_of.remote()) for a in svc.actors]
                out["actor_cores_before"] = sorted(os.sched_getaffinity(pids[0]))
                for pid in pids:  # Ray's workers do not keep the head's affinity: pin the actor to core 1
                    os.sched_setaffinity(pid, {1})
                out.update(run(pipe, HEAVY_STEPS, HEAVY_WARMUP, service=svc))
        else:
            out = run(pipe, HEAVY_STEPS, HEAVY_WARMUP, num_workers=int(case.split("-")[1]))
    elif case.startswith("light"):
        pipe = token_pipeline(data, LIGHT_BATCH)
        if case == "light-service":
            with quern.RayService(address, num_actors=2) as svc:
                out = run(pipe, 300, 20, service=svc)
        else:
            out = run(pipe, 300, 20, num_workers=2)
    elif case == "receive":
        src = quern.sources.ArraySource(
            {"tokens": np.arange(8192 * 512, dtype=np.int32).reshape(8192, 512), "length": np.arange(8192)}
        )
        pipe = quern.Pipeline.from_source(src, seed=0).batch(LIGHT_BATCH)
        with quern.RayService(address, num_actors=2) as svc:
            out = run(pipe, 300, 20, service=svc)
        out["mib_s"] = out["batches_s"] * LIGHT_BATCH * 512 * 4 / 2**20
        import ray

        x = np.zeros(8 << 20, np.uint8)
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        t0 = time.perf_counter()
        for _ in range(20):
            ray.get(ray.put(x))
        out["put_get_mib_s"] = 20 * 8 / (time.perf_counter() - t0)
        ray.shutdown()
    elif case == "hedge":
        pipe = token_pipeline(data, LIGHT_BATCH).map_batch(functools.partial(sleepy, folder=folder))
        import ray

        for hedge in (None, 3.0):
            with quern.RayService(address, num_actors=2, hedge_after=hedge, hedge_min_s=0.2) as svc:
                with pipe.iterator(service=svc, read_ahead=4) as it:
                    for s in range(40):
                        b = next(it)
                        assert all(np.array_equal(b[k], v) for k, v in pipe.batch_at(s).items()), s
                    pid = ray.get(svc.actors[0].pid_of.remote())
                    open(os.path.join(folder, f"slow-{pid}"), "w").close()
                    times, last = [], time.perf_counter()
                    for s in range(40, 200):
                        b = next(it)
                        assert all(np.array_equal(b[k], v) for k, v in pipe.batch_at(s).items()), s
                        now = time.perf_counter()
                        times.append(now - last)
                        last = now
                    out["off" if hedge is None else "on"] = {
                        "seconds": sum(times),
                        "p50_ms": statistics.median(times) * 1e3,
                        "max_ms": max(times) * 1e3,
                        "hedges": it.stats()["service"]["hedges"],
                        "steps_s": len(times) / sum(times),
                    }
                os.remove(os.path.join(folder, f"slow-{pid}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = common.parse_args(ap, child)
    if args is None:
        return
    import vs_grain

    print("# Service: scale-out on Ray\n")
    print(common.machine_line(ray=__import__("ray").__version__), "\n")
    data = vs_grain.make_data(RECORDS)
    common.warm_page_cache(data)
    rounds, ms = calibrate(data)
    print(f"heavy: {rounds} rounds, {ms:.2f} ms per record (measured)\n")
    folder = tempfile.mkdtemp(prefix="qsvc")
    me = os.path.abspath(__file__)
    figures: dict[str, Any] = {"heavy_ms": ms}

    head = Head(cpus=1, cores={1})  # the actors on core 1
    try:
        print("## 1. CPU-heavy pipeline, the trainer pinned to core 0\n")
        print(common.markdown_header(["how", "records/s", "trainer CPU µs/batch", "first batch s"]))
        for case in ("heavy-0", "heavy-1", "heavy-2", "heavy-service"):
            r = common.run_child(me, [case, head.address, data, rounds, folder])
            figures[case] = r
            what = {
                "heavy-0": "trainer alone (num_workers=0)",
                "heavy-1": "its own workers, 1 (on its core)",
                "heavy-2": "its own workers, 2 (on its core)",
                "heavy-service": "service: 1 actor on core 1",
            }[case]
            print(
                common.markdown_row(
                    [what, f"{r['records_s']:,.0f}", f"{r['cpu_us_per_batch']:,.0f}", f"{r['first_batch_s']:.2f}"]
                )
            )
        best_local = max(figures[c]["records_s"] for c in ("heavy-0", "heavy-1", "heavy-2"))
        print(f"\nservice / best local on one core: {figures['heavy-service']['records_s'] / best_local:.2f}x\n")
    finally:
        head.stop()

    head = Head(cpus=2, cores={0, 1})
    try:
        print("## 2-4. Light pipeline (vs_grain work, 2 cores), time to first batch, receive rate\n")
        print(common.markdown_header(["how", "records/s: median (runs)", "trainer CPU µs/batch", "first batch s"]))
        light = {"light-2": "2 local workers", "light-service": "service: 2 actors"}
        got: dict[str, list[dict[str, float]]] = {case: [] for case in light}
        for k in range(LIGHT_ROUNDS):  # interleaved rounds, every second one in reverse order
            for case in list(light)[:: 1 if k % 2 == 0 else -1]:
                got[case].append(common.run_child(me, [case, head.address, data, rounds, folder]))
        for case, what in light.items():
            figures[case] = got[case]
            rates = [r["records_s"] for r in got[case]]
            cpu = statistics.median(r["cpu_us_per_batch"] for r in got[case])
            first = statistics.median(r["first_batch_s"] for r in got[case])
            runs = common.join_runs(rates)
            print(
                common.markdown_row([what, f"{statistics.median(rates):,.0f} ({runs})", f"{cpu:,.0f}", f"{first:.2f}"])
            )
        r = common.run_child(me, ["receive", head.address, data, rounds, folder])
        figures["receive"] = r
        print(
            f"\nreceive: {r['batches_s']:,.0f} batches/s of 0.5 MiB = {r['mib_s']:,.0f} MiB/s through 2 actors, "
            f"trainer CPU {r['cpu_us_per_batch']:,.0f} µs/batch; ray.put + ray.get of 8 MiB in one process: "
            f"{r['put_get_mib_s']:,.0f} MiB/s\n"
        )
        print("## 5. Hedging trace (2 actors, one sleeps 1 s per unit of 4 steps from step 40)\n")
        r = common.run_child(me, ["hedge", head.address, data, rounds, folder])
        figures["hedge"] = r
        print(common.markdown_header(["hedging", "steps/s", "median s/step (ms)", "slowest step (ms)", "hedges"]))
        for k in ("off", "on"):
            h = r[k]
            print(
                common.markdown_row([k, f"{h['steps_s']:.1f}", f"{h['p50_ms']:.1f}", f"{h['max_ms']:.0f}", h["hedges"]])
            )
    finally:
        head.stop()
        shutil.rmtree(folder, ignore_errors=True)
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
