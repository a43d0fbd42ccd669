"""Reliability: what quern was put through, and what held. Prints a table of tried / held.

Scenarios (each trial is independent; seeds make a run repeatable):

* ``worker kill``: a full epoch (finite stream) with 2 workers while 1-2 worker
  processes are SIGKILLed at random times; held when the records came out
  exactly as with ``num_workers=0`` (none lost, none duplicated, same order).
* ``parent kill``: a process iterating with 2 workers is SIGKILLed at a random
  time; held when its workers are gone within 10 s (their memfd shared memory
  goes with them: it has no name anywhere) and nothing named quern is in /dev/shm.
* ``ctrl-c storm``: SIGINT every 0.5-20 ms at a process iterating with 2 workers
  that catches ``KeyboardInterrupt``, then calls ``close()`` (still under the
  storm); held when no worker is alive right after ``close()`` returns.
* ``fork``: a process forked from one iterating with 2 workers calls ``next()``
  on the inherited iterator; held when the child gets a ``RuntimeError`` and the
  parent's iterator goes on with the right batches.
* ``truncated <format>`` / ``corrupted <format>``: a data file (ArrayRecord;
  Parquet with and without page checksums; zarr v3 with the crc32c codec and
  zarr v2 without a checksum) cut at a random offset, or with 1-16 random bytes
  overwritten; held when reading every record either raises an error naming the
  file or returns exactly the original records (the damage hit bytes that hold
  no data): never other data. Formats without a checksum cannot hold for every
  overwrite (:data:`KNOWN_LIMITS`): the table shows how often they do.
* ``malformed config``: a valid config mutated at random (keys dropped, renamed
  or added, values of the wrong type, garbage, deep nesting, an alias bomb);
  held when ``load_config`` returns a pipeline or raises ``ConfigError`` with a
  message under 20 KB, in under 10 s.

Run:  .venv/bin/python benchmarks/faults.py [--trials N] [--seed S] [--only NAME,...]
Exit status 1 when a scenario outside KNOWN_LIMITS did not hold in every trial.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np

import quern

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --------------------------------------------------------------------------- data


def write_array_record(path: str, records: list[bytes], options: str = "group_size:1") -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(path, options)
    for r in records:
        w.write(r)
    w.close()


def id_records(n: int, width: int = 64) -> list[bytes]:
    """Record ``i``: ``i`` as int64 followed by ``width - 8`` bytes that depend on ``i``."""
    return [np.full(width // 8, i, dtype=np.int64).tobytes() for i in range(n)]


def slow_decode(rec: bytes) -> np.ndarray:
    """The record's id, after 0.3 ms of work: an epoch lasts long enough to kill workers in it."""
    time.sleep(0.0003)
    return np.frombuffer(rec, dtype=np.int64)[:1]


# --------------------------------------------------------------------------- scenarios


def worker_kill(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    path = os.path.join(tmp, "ids.array_record")
    n = 3000
    write_array_record(path, id_records(n))
    pipe = (
        quern.Pipeline.from_source(quern.sources.ArrayRecordSource(path), seed=7, num_epochs=1)
        .shuffle()
        .map(slow_decode)
        .batch(50)
    )
    want = np.concatenate([b.reshape(-1) for b in pipe.iterator()])
    held, kills = 0, 0
    for _ in range(trials):
        got = []
        with pipe.iterator(num_workers=2) as it:
            it.wait_for_workers(60)
            times = sorted(rng.uniform(0.05, 0.8) for _ in range(rng.randint(1, 2)))
            start = time.monotonic()

            def killer(it=it, times=times, start=start) -> None:
                nonlocal kills
                for t in times:
                    time.sleep(max(0.0, start + t - time.monotonic()))
                    pids = it.worker_pids
                    if pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(rng.choice(pids), signal.SIGKILL)
                            kills += 1

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            for batch in it:
                got.append(np.array(batch).reshape(-1))
            thread.join()
        out = np.concatenate(got) if got else np.zeros(0, np.int64)
        held += int(out.shape == want.shape and bool((out == want).all()))
    return trials, held, f"{kills} SIGKILLs during {trials} epochs of {n} records; held = same records, same order"


_CHILD_PRELUDE = """
import os, sys, time, signal
import numpy as np
sys.path.insert(0, {here!r})
import quern
from faults import id_records, slow_decode, write_array_record
path = sys.argv[1]
pipe = (quern.Pipeline.from_source(quern.sources.ArrayRecordSource(path), seed=3)
        .shuffle().map(slow_decode).batch(50))
"""


def _child(script: str) -> str:
    return _CHILD_PRELUDE.format(here=HERE) + textwrap.dedent(script)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def parent_kill(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    path = os.path.join(tmp, "ids.array_record")
    if not os.path.exists(path):
        write_array_record(path, id_records(3000))
    script = _child("""
        it = pipe.iterator(num_workers=2)
        it.wait_for_workers(60)
        print(" ".join(map(str, it.worker_pids)), flush=True)
        while True:
            next(it)
    """)
    held = 0
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for _ in range(trials):
        proc = subprocess.Popen([sys.executable, "-c", script, path], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        left = [p for p in pids if _alive(p)] + [f for f in shm_after - shm_before if "quern" in f]
        held += int(len(pids) == 2 and not left)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    return trials, held, "held = both workers gone within 10 s, nothing new in /dev/shm"


def ctrl_c_storm(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    path = os.path.join(tmp, "ids.array_record")
    if not os.path.exists(path):
        write_array_record(path, id_records(3000))
    # The child's SIGINT handler raises KeyboardInterrupt only while a quern call runs ("armed"):
    # the storm interrupts quern's code at any point, never the harness's own loop.
    script = _child("""
        armed = False

        def on_sigint(signum, frame):
            if armed:
                raise KeyboardInterrupt

        def call(fn):
            global armed
            try:
                armed = True
                fn()
                return True
            except KeyboardInterrupt:
                return False
            finally:
                armed = False

        signal.signal(signal.SIGINT, on_sigint)
        seen, box = set(), []
        while not call(lambda: box.append(pipe.iterator(num_workers=2))):
            pass
        it = box[0]
        print("ready", flush=True)
        deadline = time.monotonic() + float(sys.argv[2])
        interrupted = 0
        while time.monotonic() < deadline:
            seen.update(it.worker_pids)
            interrupted += not call(lambda: next(it))
        seen.update(it.worker_pids)
        while not call(it.close):
            interrupted += 1
        alive = []
        for p in seen:
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(p)
            except FileNotFoundError:
                pass
        print("ALIVE", len(alive), "SEEN", len(seen), "INTERRUPTED", interrupted, flush=True)
    """)
    held, tried, signals, interrupted, harness = 0, 0, 0, 0, 0
    for _ in range(trials * 3):
        if tried == trials:
            break
        proc = subprocess.Popen(
            [sys.executable, "-c", script, path, "1.0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # "ready": its handler for Ctrl-C is installed
        while proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
                signals += 1
            time.sleep(rng.uniform(0.0005, 0.02))
        out = proc.stdout.read().split()
        if len(out) != 6 or out[0] != "ALIVE":  # the harness itself was hit between two calls: not a trial
            harness += 1
            continue
        tried += 1
        interrupted += int(out[5])
        held += int(out[1] == "0" and int(out[3]) >= 2)
    notes = f"{signals} SIGINTs, {interrupted} calls interrupted; held = no worker alive right after close()"
    return tried, held, notes + (f"; {harness} runs lost to the harness" if harness else "")


def fork(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    path = os.path.join(tmp, "ids.array_record")
    if not os.path.exists(path):
        write_array_record(path, id_records(3000))
    script = _child("""
        it = pipe.iterator(num_workers=2)
        for _ in range(int(sys.argv[2])):
            next(it)
        pid = os.fork()
        if pid == 0:
            try:
                next(it)
                os._exit(1)   # the child must not be able to use its parent's iterator
            except RuntimeError:
                os._exit(0)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        step = it.step
        ok = all(np.array_equal(next(it), pipe.batch_at(s)) for s in range(step, step + 5))
        it.close()
        print("CHILD", os.waitstatus_to_exitcode(status), "PARENT", ok, flush=True)
    """)
    held = 0
    for _ in range(trials):
        try:
            out = subprocess.run(
                [sys.executable, "-c", script, path, str(rng.randint(0, 30))],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.split()
        except subprocess.TimeoutExpired:
            out = []
        held += int(out == ["CHILD", "0", "PARENT", "True"])
    return trials, held, "held = the child gets RuntimeError, the parent goes on with the right batches"


# ---- damaged files


KINDS = {
    "array_record": "ArrayRecord (riegeli chunks carry hashes)",
    "parquet": "Parquet written with page checksums (write_page_checksum=True)",
    "parquet-nocrc": "Parquet without page checksums (pyarrow's default)",
    "zarr3": "zarr v3 with the crc32c codec",
    "zarr": "zarr v2 (blosc; no checksum)",
}
KNOWN_LIMITS = {"corrupted parquet-nocrc", "corrupted zarr"}
"""Rows that cannot hold: the format has no checksum, so some byte changes decode to other values."""


def _records_of(kind: str, path: str) -> list:
    if kind == "array_record":
        return list(quern.sources.ArrayRecordSource(path).read_many(np.arange(500)))
    if kind.startswith("parquet"):
        src = quern.sources.ParquetSource(path)
        return [r["x"].tolist() for r in src.read_many(np.arange(len(src)))]
    ts_src = quern.sources.TensorStoreSource(path)
    return [r.tolist() for r in ts_src.read_many(np.arange(len(ts_src)))]


def _write(kind: str, path: str) -> None:
    rows = [list(range(i, i + 1 + i % 7)) for i in range(500)]
    if kind == "array_record":
        write_array_record(path, [np.asarray(r, np.int64).tobytes() for r in rows])
    elif kind.startswith("parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"x": rows}), path, row_group_size=100, write_page_checksum=kind == "parquet")
    else:
        import tensorstore as ts

        arr = np.arange(500 * 8, dtype=np.int64).reshape(500, 8)
        spec = {"driver": kind, "kvstore": {"driver": "file", "path": path}}
        extra = {}
        if kind == "zarr3":
            codecs = [{"name": "bytes"}, {"name": "zstd"}, {"name": "crc32c"}]
            extra["codec"] = ts.CodecSpec({"driver": "zarr3", "codecs": codecs})
        layout = ts.ChunkLayout(chunk_shape=[50, 8])
        ts.open(spec, create=True, dtype=ts.int64, shape=arr.shape, chunk_layout=layout, **extra).result().write(
            arr
        ).result()


def _files(kind: str, path: str) -> list[str]:
    if not kind.startswith("zarr"):
        return [path]
    return sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names if f not in (".zarray", "zarr.json")
    )


def damaged(kind: str, how: str) -> Callable[[int, random.Random, str], tuple[int, int, str]]:
    def run(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
        clean = os.path.join(tmp, f"clean.{kind}")
        if not os.path.exists(clean):
            _write(kind, clean)
        want = _records_of(kind, clean)
        held, caught, same = 0, 0, 0
        for t in range(trials):
            path = os.path.join(tmp, f"{how}-{t}.{kind}")
            (shutil.copytree if kind.startswith("zarr") else shutil.copy)(clean, path)
            target = rng.choice(_files(kind, path))
            size = os.path.getsize(target)
            with open(target, "r+b") as f:
                if how == "truncated":
                    f.truncate(rng.randrange(0, max(size, 1)))
                else:  # somewhere in the bytes before any trailing zero padding (ArrayRecord pads to 64 KiB)
                    used = len(f.read().rstrip(b"\0"))
                    at = rng.randrange(0, max(used - 1, 1))
                    f.seek(at)
                    f.write(bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))))
            try:
                got = _records_of(kind, path)
            except Exception as e:  # an error is held only when it names the file
                names = os.path.basename(path) in str(e) or os.path.basename(target) in str(e)
                caught += names
                held += names
                continue
            same += got == want
            held += got == want
        return trials, held, f"{caught} errors naming the file, {same} reads of the original data"

    return run


# ---- configs


def _mutations(rng: random.Random, data_glob: str) -> dict | str:
    base = {
        "source": {"type": "array_record", "paths": data_glob},
        "seed": 1,
        "shuffle": "global",
        "transforms": [{"name": "decode", "kwargs": {"dtype": "int64"}}],
        "batch": {"size": 10},
    }
    choice = rng.randrange(9)
    cfg: dict = json.loads(json.dumps(base))
    keys = ["source", "seed", "shuffle", "transforms", "batch"]
    junk = [None, -1, 2**70, 1.5, "x" * rng.randint(0, 5000), [], {}, [[[]]], True, {"a": {"b": {"c": 1}}}]
    if choice == 0:
        cfg.pop(rng.choice(keys))
    elif choice == 1:
        cfg[rng.choice(keys)] = rng.choice(junk)
    elif choice == 2:
        cfg["sauce" if rng.random() < 0.5 else f"k{rng.randrange(1000)}"] = rng.choice(junk)
    elif choice == 3:
        cfg["source"][rng.choice(["type", "paths", "name", "bogus"])] = rng.choice(junk)
    elif choice == 4:
        cfg["transforms"][0][rng.choice(["name", "fn", "kwargs", "kind"])] = rng.choice(junk)
    elif choice == 5:  # deep nesting, as text (json.dumps itself would hit the recursion limit)
        depth = rng.randint(10, 100_000)
        cfg["seed"] = "@@"
        return json.dumps(cfg).replace('"@@"', "[" * depth + "1" + "]" * depth)
    elif choice == 6:
        return "".join(rng.choice("{}[]:,- \n\"'&*!abc") for _ in range(rng.randint(1, 400)))
    elif choice == 7:  # an alias bomb
        lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
        for i in range(1, 9):
            lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
        return "\n".join(lines) + "\nsource: *a8\n"
    else:
        cfg["transforms"][0] = {"fn": rng.choice(["os:system", "builtins:exec", ".foo:bar", "x:__import__"])}
    return cfg


def _load_one(cfg: dict | str, tmp: str) -> str:
    path = os.path.join(tmp, "c.yaml")
    with open(path, "w") as f:
        f.write(cfg if isinstance(cfg, str) else json.dumps(cfg))
    code = textwrap.dedent(f"""
        import quern, sys
        try:
            quern.load_config({path!r})
            print("OK")
        except quern.ConfigError as e:
            print("CONFIGERROR", len(str(e)))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10).stdout.split()
    except subprocess.TimeoutExpired:
        return "timeout"
    if out == ["OK"]:
        return "ok"
    if len(out) == 2 and out[0] == "CONFIGERROR" and int(out[1]) < 20_000:
        return "error"
    return "other"


def malformed_config(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    path = os.path.join(tmp, "cfg-data.array_record")
    if not os.path.exists(path):
        write_array_record(path, id_records(100))
    outcomes: dict[str, int] = {}
    for _ in range(trials):
        outcome = _load_one(_mutations(rng, path), tmp)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    held = outcomes.get("ok", 0) + outcomes.get("error", 0)
    return trials, held, ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))


SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {
    "worker kill": worker_kill,
    "parent kill": parent_kill,
    "ctrl-c storm": ctrl_c_storm,
    "fork": fork,
    **{f"{how} {kind}": damaged(kind, how) for kind in KINDS for how in ("truncated", "corrupted")},
    "malformed config": malformed_config,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per scenario (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    print(f"{'scenario':22s} {'tried':>6s} {'held':>6s}  notes")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rng = random.Random(f"{args.seed}:{name}")
            t0 = time.monotonic()
            tried, held, notes = SCENARIOS[name](args.trials, rng, tmp)
            failed += 0 if name in KNOWN_LIMITS else tried - held
            print(f"{name:22s} {tried:6d} {held:6d}  {notes} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
