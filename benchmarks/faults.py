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
  storm); held when both workers ran and none is alive right after ``close()``
  returns (the storm lasts a second, longer on a loaded machine until both
  workers have started, at most a minute).
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

Remote storage (a static file server on 127.0.0.1 run by this process: Content-Length,
ETag, Last-Modified, Range requests; each trial has its own cache folder):

* ``manifest traversal``: a served prepared folder whose manifest is hostile, at
  random: a ``job`` with ``../`` (and a planted metadata file with a matching
  SHA-256), absolute, with a backslash or NUL; a metadata or shard file name with
  ``..``, absolute, NUL, backslashes, ``.``; or a link planted where the cache
  keeps a shard or metadata file, leading out of it (to another shard's bytes, or
  to nothing). Held when opening it, reading its metadata and every record gives a
  ``SourceError`` naming the URL or the name (or, for a planted link, the right
  records), and nothing outside the cache folder was written or changed.
* ``stale cache``: a served prepared folder prepared again with other data of the
  same sizes (or an ArrayRecord or Parquet file by URL rewritten) between two
  opens with one cache folder; held when the second open reads the new records.
* ``swapped cache``: two cached shards swapped (with or without their sidecar
  files), overwritten with another's bytes, replaced by a copy of or a hard link
  to another; held when both the open source and a new one read the right records
  or raise ``SourceError``: never another shard's records.
* ``cache hit cost``: the time of a cache hit (the check that the cached file is
  the one fetched) per shard, against an unchecked one, and per step of a
  pipeline reading 32 shards; held when every hit is one (nothing fetched again).
* ``stalled server``: a server that never answers (the manifest or a shard), sends
  the headers and half a body then nothing (a shard; a file by URL), or never
  accepts the connection; held when a ``SourceError`` naming the URL and the
  timeout comes within 3 x (connect + read timeout) x tries (timeouts of 1 s,
  1 retry); the notes give the median and the longest time to it.

Fresh processes and ``quern prepare``:

* ``definition mismatch``: a module global changed at run time (rebound, or a dict
  mutated) read by a filter over 200,000 records (scanned in 2 fresh processes) or
  by a map with ``num_workers=2``; held when an error names the global and no batch
  or survivor differs from the parent's definition.
* ``prepare input changed``: an input (a JSON-lines file, or a file of a folder)
  rewritten, appended to, truncated or replaced while ``quern prepare`` runs; held
  when it exits non-zero naming the file, with no ``manifest.json``.
* ``prepare kill -9``: ``quern prepare --workers 2`` SIGKILLed while its pool
  works; held when no process of its tree (pool workers, resource tracker) is
  alive 10 s later; the notes count the processes left.

The scenarios of issue 36 (live-stream commits, offset indexes, digests, ledgers, odd inputs)
are in ``faults_live.py``, ``faults_indexes.py``, ``faults_digests.py``, ``faults_ledgers.py``
and ``faults_inputs.py`` beside this file; their docstrings say what each one tries.

Run:  .venv/bin/python benchmarks/faults.py [--trials N] [--seed S] [--only NAME,...]
Exit status 1 when a scenario outside KNOWN_LIMITS did not hold in every trial.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import hashlib
import http.server
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import common
import faults_digests
import faults_indexes
import faults_inputs
import faults_ledgers
import faults_live
import numpy as np

import quern
import quern.pipeline.remote.cache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --------------------------------------------------------------------------- data


def id_records(n: int, width: int = 64) -> list[bytes]:
    """Record ``i``: ``i`` as int64 followed by ``width - 8`` bytes that depend on ``i``."""
    return [np.full(width // 8, i, dtype=np.int64).tobytes() for i in range(n)]


def ids_file(tmp: str, n: int = 3000) -> str:
    """``tmp/ids.array_record``: ``id_records(n)`` (written once); its path."""
    path = os.path.join(tmp, "ids.array_record")
    if not os.path.exists(path):
        common.write_array_record(path, id_records(n))
    return path


def slow_decode(rec: bytes) -> np.ndarray:
    """The record's id, after 0.3 ms of work: an epoch lasts long enough to kill workers in it."""
    time.sleep(0.0003)
    return np.frombuffer(rec, dtype=np.int64)[:1]


# --------------------------------------------------------------------------- scenarios


def worker_kill(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    n = 3000
    path = ids_file(tmp, n)
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
from faults import slow_decode
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
    path = ids_file(tmp)
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
    path = ids_file(tmp)
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
        start = time.monotonic()
        deadline, cap = start + float(sys.argv[2]), start + 60.0
        interrupted = 0
        # the storm lasts its seconds and, on a loaded machine, until both workers have been seen
        # (at most a minute): a trial checks what close() leaves of running workers, not how fast they start
        while time.monotonic() < deadline or (len(seen) < 2 and time.monotonic() < cap):
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
    path = ids_file(tmp)
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
        common.write_array_record(path, [np.asarray(r, np.int64).tobytes() for r in rows])
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
        common.write_array_record(path, id_records(100))
    outcomes: dict[str, int] = {}
    for _ in range(trials):
        outcome = _load_one(_mutations(rng, path), tmp)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    held = outcomes.get("ok", 0) + outcomes.get("error", 0)
    return trials, held, ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))


# ---- remote storage: an HTTP server on 127.0.0.1 run by this process


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET and HEAD of the files under the server's ``root`` (Content-Length, ETag, Last-Modified,
    Range requests answered 206; a missing file or a name leaving the folder 404), or a stall:
    ``server.stalls[path]`` is ``"silent"`` (the request is read and never answered) or
    ``"partial"`` (HEAD answered; GET sends the headers and half the body, then nothing)."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = urllib.parse.unquote(self.path.split("?", 1)[0])
        how = self.server.stalls.get(path)
        if how == "silent":
            self.server.stopping.wait(120)
            self.close_connection = True
            return
        parts = [p for p in path.split("/") if p]
        full = os.path.join(self.server.root, *parts) if parts else self.server.root
        if any(p in (".", "..") or "\\" in p or "\0" in p for p in parts) or not os.path.isfile(full):
            self.send_error(404)
            return
        st = os.stat(full)
        start, end = 0, st.st_size - 1
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        status = 200
        if m and (m.group(1) or m.group(2)):
            if m.group(1):
                start, end = int(m.group(1)), min(int(m.group(2) or end), end)
            else:
                start = max(0, st.st_size - int(m.group(2)))
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(max(0, end - start + 1)))
        self.send_header("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{st.st_size}")
        self.end_headers()
        if not body:
            return
        with open(full, "rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        if how == "partial":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.server.stopping.wait(120)
            self.close_connection = True
            return
        self.wfile.write(data)


class _Server(http.server.ThreadingHTTPServer):
    """A static file server of the folder ``root`` on a free port of 127.0.0.1 (``url``), in a
    thread of this process, with the stalls of :class:`_Handler`; ``close()`` ends the stalls too."""

    daemon_threads = True

    def __init__(self, root: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.stalls: dict[str, str] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rounds(rng: random.Random, cases: list, trials: int, first: int = 0) -> list:
    """``trials`` cases: rounds of every case once, each round in a random order but the
    first, which starts with the ``first`` cases in their order (the ones a short run must try)."""
    out: list = cases[:first] + rng.sample(cases[first:], len(cases) - first)
    while len(out) < trials:
        out += rng.sample(cases, len(cases))
    return out[:trials]


def _small_files(folder: str, seed: int, count: int = 24, size: int = 1000) -> None:
    """``count`` files of ``size`` random bytes (the same sizes for every seed)."""
    r = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        with open(os.path.join(folder, f"f{i:03d}.bin"), "wb") as f:
            f.write(r.randbytes(size))


def _prepared(tmp: str, seed: int, count: int = 24) -> str:
    """A folder written by ``quern prepare`` (``count`` records of 1000 random bytes, 8 a shard of
    128 KiB: shards of the same sizes for every seed), made once under ``tmp``; its path."""
    import quern.prepare

    out = os.path.join(tmp, f"prepared-{seed}-{count}")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        _small_files(os.path.join(tmp, f"prepared-in-{seed}-{count}"), seed, count)
        with contextlib.redirect_stderr(io.StringIO()):
            quern.prepare.prepare(
                os.path.join(tmp, f"prepared-in-{seed}-{count}"), out, shard_size="8KB", workers=0, progress=False
            )
    return out


def _manifest(folder: str) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def _all(src: Any) -> list[bytes]:
    """Every record of ``src``, as bytes."""
    return [bytes(r) for r in src.read_many(np.arange(len(src)))]


def _cache(folder: str, **kw: Any) -> Any:
    return quern.pipeline.remote.cache.ShardCache(folder, **kw)


def _tree(root: str, skip: str) -> dict[str, tuple]:
    """Everything under ``root`` but ``skip`` (a folder): relative path -> (kind, size, mtime_ns, link)."""
    out: dict[str, tuple] = {}
    for here, dirs, files in os.walk(root):
        if os.path.abspath(here) == os.path.abspath(skip):
            dirs[:] = []
            continue
        for n in dirs + files:
            p = os.path.join(here, n)
            if os.path.abspath(p) == os.path.abspath(skip):
                continue
            st = os.lstat(p)
            link = os.readlink(p) if os.path.islink(p) else None
            out[os.path.relpath(p, root)] = (
                st.st_mode >> 12,
                st.st_size if not os.path.isdir(p) else 0,
                st.st_mtime_ns if not os.path.isdir(p) else 0,
                link,
            )
    return out


def _entries(folder: str) -> dict[str, str]:
    """The cached files of ``folder`` by the base name they end with (``shard-00000-of-00003.array_record``)."""
    out = {}
    for n in os.listdir(folder):
        if not n.endswith((".lock", ".use", ".part", ".ok")) and os.path.isfile(os.path.join(folder, n)):
            out[n.split("-", 1)[1] if "-" in n else n] = os.path.join(folder, n)
    return out


def _entry_path(cache: Any, url: str, sha256: str) -> str:
    """Where ``cache`` keeps ``url`` (keyed by its SHA-256 where the cache does that)."""
    try:
        return cache.path(url, sha256)
    except TypeError:  # a cache keyed by URL alone
        return cache.path(url)


_TRAVERSALS = [  # the first 3: what issue 21 found open, tried first by every run
    "job ../ (with a planted metadata file)",
    "cached shard a link out",
    "cached metadata a link out",
    "job absolute",
    "job with a backslash or NUL",
    "metadata ../",
    "metadata absolute",
    "metadata NUL",
    "metadata backslashes",
    "metadata '..' or '.'",
    "shard ../",
    "shard absolute",
    "shard backslashes",
    "cached shard a dangling link out",
]


def manifest_traversal(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    base = os.path.join(tmp, "traversal")
    clean = _prepared(tmp, 0)
    other = _prepared(tmp, 1)
    want = _all(quern.sources.ArrayRecordSource(clean))
    served = os.path.join(base, "served")
    os.makedirs(served, exist_ok=True)
    held, outcomes = 0, {"refused": 0, "right records": 0}
    failures: list[str] = []
    with _Server(served) as srv:
        for t, how in enumerate(_rounds(rng, _TRAVERSALS, trials, first=3)):
            sandbox = os.path.join(base, f"t{t}")
            cache_dir = os.path.join(sandbox, "cache", "remote")
            os.makedirs(cache_dir)
            folder = os.path.join(served, f"t{t}")
            shutil.copytree(clean, folder)
            url = f"{srv.url}/t{t}"
            canary = os.path.join(sandbox, f"canary-{rng.randrange(10**6)}")
            with open(os.path.join(clean, "manifest.json")) as f:
                m = json.load(f)
            depth = len(os.path.relpath(cache_dir, sandbox).split(os.sep))
            up = "../" * (depth + 2)  # "metadata-" + job makes the first ".." part of a name
            k = rng.randrange(len(m["shards"]))
            names: list[str] = []
            if how.startswith("job ../"):
                planted = b"# planted by a hostile server\n"
                with open(os.path.join(folder, "metadata", "planted.pth"), "wb") as f:
                    f.write(planted)
                m["job"] = up + os.path.basename(canary)
                m["metadata"]["planted"] = {
                    "file": "metadata/planted.pth",
                    "dtype": "int64",
                    "sha256": hashlib.sha256(planted).hexdigest(),
                }
                names = [m["job"]]
            elif how == "job absolute":
                m["job"] = canary
                names = [canary]
            elif how == "job with a backslash or NUL":
                m["job"] = rng.choice(["..\\..\\..\\" + os.path.basename(canary), m["job"][:8] + "\0" + m["job"][8:]])
                names = [m["job"]]
            elif how.startswith("metadata"):
                file = {
                    "metadata ../": "metadata/" + "../" * rng.randint(1, depth + 4) + os.path.basename(canary),
                    "metadata absolute": canary,
                    "metadata NUL": "metadata/len\0gth.npy",
                    "metadata backslashes": "metadata\\..\\..\\" + os.path.basename(canary),
                    "metadata '..' or '.'": rng.choice(["metadata/..", "metadata/.", "metadata/", ".."]),
                }[how]
                m["metadata"]["length"]["file"] = file
                names = [file]
            elif how.startswith("shard"):
                file = {
                    "shard ../": rng.choice(["../", "sub/../../", "./../"]) + m["shards"][k]["file"],
                    "shard absolute": canary,
                    "shard backslashes": "..\\" + m["shards"][k]["file"],
                }[how]
                m["shards"][k]["file"] = file
                names = [file]
            with open(os.path.join(folder, "manifest.json"), "w") as f:
                json.dump(m, f)
            cache = _cache(cache_dir)
            if how.startswith("cached"):  # a link planted where the cache keeps an entry, leading out of it
                if "metadata" in how:
                    spec = m["metadata"]["length"]
                    entry = _entry_path(cache, f"{url}/{spec['file']}", spec["sha256"])
                else:
                    entry = _entry_path(cache, f"{url}/{m['shards'][k]['file']}", m["shards"][k]["sha256"])
                if "dangling" not in how:
                    src_file = os.path.join(other, m["shards"][(k + 1) % len(m["shards"])]["file"])
                    if "metadata" in how:
                        src_file = os.path.join(other, "metadata", "length.npy")
                    shutil.copy(src_file, canary)
                os.symlink(canary, entry)
                names = [os.path.basename(entry), os.path.basename(m["shards"][k]["file"]), "length.npy"]
            before = _tree(base, cache_dir)
            canary_there = os.path.lexists(canary)
            outcome, message = "accepted", ""
            try:
                src = quern.sources.ArrayRecordSource(url, cache=cache)
                src.metadata  # noqa: B018 (reads the metadata files into the cache)
                got = _all(src)
                outcome = "right records" if got == want else "other records"
            except quern.SourceError as e:
                message = str(e)
                shown = [url, *names, *(repr(n)[1:-1] for n in names)]
                outcome = "refused" if any(s and s in message for s in shown) else "refused without naming it"
            except Exception as e:
                outcome, message = f"{type(e).__name__}", str(e)
            after = _tree(base, cache_dir)
            outside = sorted(set(after.items()) ^ set(before.items()))
            ok = not outside and os.path.lexists(canary) == canary_there
            if ok and (outcome == "refused" or (outcome == "right records" and how.startswith("cached"))):
                held += 1
                outcomes[outcome] += 1
            else:
                wrote = f"; written outside the cache: {[p for p, _ in outside][:3]}" if outside else ""
                failures.append(f"{how}: {outcome} {message[:160]!r}{wrote}")
    notes = f"{min(trials, len(_TRAVERSALS))} of {len(_TRAVERSALS)} kinds of hostile name or link: "
    notes += f"{outcomes['refused']} refused naming the URL or name, {outcomes['right records']} right records"
    notes += "; held = SourceError naming it (or the right records), nothing written outside the cache folder"
    return trials, held, notes + ("; not held: " + " | ".join(failures[:4]) if failures else "")


def _write_parquet(path: str, values: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": values}), path, row_group_size=64, compression="none")


def _parquet_records(src: Any) -> list:
    return [int(r["x"]) for r in src.read_many(np.arange(len(src)))]


def _replace_folder(dst: str, src: str, rng: random.Random) -> None:
    """Make ``dst`` a copy of ``src``: files rewritten in place or replaced by a rename (at random)."""
    for here, _, files in os.walk(src):
        for n in files:
            s = os.path.join(here, n)
            d = os.path.join(dst, os.path.relpath(s, src))
            if rng.random() < 0.5:
                with open(s, "rb") as f, open(d, "r+b") as g:
                    g.write(f.read())
                    g.truncate()
            else:
                shutil.copy(s, d + ".new")
                os.replace(d + ".new", d)


def stale_cache(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    old, new = _prepared(tmp, 0), _prepared(tmp, 1)
    want_old, want_new = _all(quern.sources.ArrayRecordSource(old)), _all(quern.sources.ArrayRecordSource(new))
    sizes = [s["bytes"] for s in _manifest(old)["shards"]]
    same = sizes == [s["bytes"] for s in _manifest(new)["shards"]]
    served = os.path.join(tmp, "stale-served")
    os.makedirs(served, exist_ok=True)
    held, kinds, failures, same_size = 0, {}, [], 0
    with _Server(served) as srv:
        for t, kind in enumerate(
            _rounds(rng, ["prepared folder", "ArrayRecord file by URL", "Parquet file by URL"], trials)
        ):
            kinds[kind] = kinds.get(kind, 0) + 1
            cache_dir = os.path.join(tmp, f"stale-cache-{t}")
            try:
                if kind == "prepared folder":
                    folder = os.path.join(served, f"t{t}")
                    shutil.copytree(old, folder)
                    url = f"{srv.url}/t{t}"
                    first = _all(quern.sources.ArrayRecordSource(url, cache=_cache(cache_dir)))
                    _replace_folder(folder, new, rng)  # prepared again with other data: same names, same sizes
                    second = _all(quern.sources.ArrayRecordSource(url, cache=_cache(cache_dir)))
                    wants, same_size = (want_old, want_new), same_size + same
                elif kind == "ArrayRecord file by URL":
                    path = os.path.join(served, f"t{t}.array_record")
                    a = [rng.randbytes(100) for _ in range(50)]
                    b = [rng.randbytes(100) for _ in range(50)]
                    common.write_array_record(path, a)
                    size = os.path.getsize(path)
                    url = f"{srv.url}/t{t}.array_record"
                    first = _all(quern.sources.ArrayRecordSource([url], cache=_cache(cache_dir)))
                    common.write_array_record(path + ".new", b)
                    same_size += os.path.getsize(path + ".new") == size
                    _replace_folder_file(path + ".new", path, rng)
                    second = _all(quern.sources.ArrayRecordSource([url], cache=_cache(cache_dir)))
                    wants = (a, b)
                else:
                    path = os.path.join(served, f"t{t}.parquet")
                    a = rng.sample(range(10**9), 300)
                    b = rng.sample(range(10**9), 300)
                    _write_parquet(path, np.asarray(a, np.int64))
                    size = os.path.getsize(path)
                    url = f"{srv.url}/t{t}.parquet"
                    first = _parquet_records(quern.sources.ParquetSource(url, cache=_cache(cache_dir)))
                    _write_parquet(path + ".new", np.asarray(b, np.int64))
                    same_size += os.path.getsize(path + ".new") == size
                    _replace_folder_file(path + ".new", path, rng)
                    second = _parquet_records(quern.sources.ParquetSource(url, cache=_cache(cache_dir)))
                    wants = (a, b)
            except Exception as e:
                failures.append(f"{kind}: {type(e).__name__}: {str(e)[:160]}")
                continue
            if first == wants[0] and second == wants[1]:
                held += 1
            else:
                why = "the old records" if second == wants[0] else "other records"
                failures.append(f"{kind}: the second open read {why}")
    notes = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    notes += f" ({same_size} changed with every size the same); held = the second open reads the new records"
    return trials, held, notes + ("; not held: " + " | ".join(failures[:4]) if failures else "")


def _replace_folder_file(new: str, path: str, rng: random.Random) -> None:
    """Make ``path`` hold the bytes of ``new`` (removed): rewritten in place, or replaced by a rename."""
    if rng.random() < 0.5:
        with open(new, "rb") as f, open(path, "r+b") as g:
            g.write(f.read())
            g.truncate()
        os.remove(new)
    else:
        os.replace(new, path)


_SWAPS = [
    "two shard files swapped",
    "two shard files swapped with their sidecars",
    "a shard overwritten in place with another's bytes",
    "a shard replaced by a copy of another",
    "a shard replaced by a hard link to another",
]


def swapped_cache(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    clean = _prepared(tmp, 0)
    want = _all(quern.sources.ArrayRecordSource(clean))
    served = os.path.join(tmp, "swapped-served")
    os.makedirs(served, exist_ok=True)
    held, failures = 0, []
    outcomes = {"right records": 0, "SourceError": 0}
    with _Server(served) as srv:
        for t, how in enumerate(_rounds(rng, _SWAPS, trials)):
            shutil.copytree(clean, os.path.join(served, f"t{t}"))
            url = f"{srv.url}/t{t}"
            cache_dir = os.path.join(tmp, f"swapped-cache-{t}")
            src = quern.sources.ArrayRecordSource(url, cache=_cache(cache_dir))
            first = _all(src)
            shards = sorted(n for n in _entries(cache_dir) if n.startswith("shard-"))
            a, b = (_entries(cache_dir)[n] for n in rng.sample(shards, 2))
            if how.startswith("two shard files swapped"):
                pairs = [(a, b)] + ([(a + ".ok", b + ".ok")] if "sidecars" in how and os.path.exists(a + ".ok") else [])
                for x, y in pairs:
                    os.rename(x, x + ".swap")
                    os.rename(y, x)
                    os.rename(x + ".swap", y)
            elif how.endswith("in place with another's bytes"):
                with open(b, "rb") as f, open(a, "r+b") as g:
                    g.write(f.read())
                    g.truncate()
            elif how.endswith("a copy of another"):
                shutil.copy(b, a + ".new")
                os.replace(a + ".new", a)
            else:
                os.link(b, a + ".new")
                os.replace(a + ".new", a)
            good = first == want
            for reader in ("the open source", "a new source"):
                try:
                    s = (
                        src
                        if reader == "the open source"
                        else quern.sources.ArrayRecordSource(url, cache=_cache(cache_dir))
                    )
                    got = _all(s)
                    outcome = "right records" if got == want else "other records"
                except quern.SourceError:
                    outcome = "SourceError"
                if outcome == "other records":
                    good = False
                    failures.append(f"{how}: {reader} read another shard's records")
                else:
                    outcomes[outcome] += 1
            held += good
    notes = f"{outcomes['right records']} reads of the right records, {outcomes['SourceError']} SourceErrors"
    notes += " (an open and a new source per trial); held = never another shard's records"
    return trials, held, notes + ("; not held: " + " | ".join(failures[:4]) if failures else "")


def cache_hit_cost(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    """What a cache hit costs (the check that the cached file is still the one fetched), per shard
    and per step of a remote pipeline reading 32 shards, against an unchecked hit (an ``exists``
    and a touch, what a hit was before the check)."""
    folder = _prepared(tmp, 2, count=256)  # 32 shards of 8 records
    m = _manifest(folder)
    served = os.path.join(tmp, "hits-served")
    os.makedirs(served, exist_ok=True)
    if not os.path.exists(os.path.join(served, "p")):
        shutil.copytree(folder, os.path.join(served, "p"))
    held = 0
    per_hit, bare, hits_per_step, steps_remote, steps_local = [], [], [], [], []
    with _Server(served) as srv:
        url = f"{srv.url}/p"
        cache_dir = os.path.join(tmp, "hits-cache")
        cache = _cache(cache_dir)
        src = quern.sources.ArrayRecordSource(url, cache=cache)
        _all(src)  # every shard cached
        remote = quern.Pipeline.from_source(src, seed=3).shuffle().batch(32)
        local = quern.Pipeline.from_source(quern.sources.ArrayRecordSource(folder), seed=3).shuffle().batch(32)
        for _ in range(trials):
            s = m["shards"][rng.randrange(len(m["shards"]))]
            shard_url = f"{url}/{s['file']}"
            before = dict(cache.stats)
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                path = cache.get(shard_url, size=s["bytes"], sha256=s["sha256"])
                times.append(time.perf_counter() - t0)
            per_hit.append(float(np.median(times)))
            times = []
            for _ in range(200):  # the hit without a check: is it there, mark it used
                t0 = time.perf_counter()
                os.path.exists(path)
                os.utime(path)
                times.append(time.perf_counter() - t0)
            bare.append(float(np.median(times)))
            step = rng.randrange(0, 1000)
            h0 = cache.stats["hits"]
            t0 = time.perf_counter()
            for k in range(5):
                remote.batch_at(step + k)
            steps_remote.append((time.perf_counter() - t0) / 5)
            hits_per_step.append((cache.stats["hits"] - h0) / 5)
            t0 = time.perf_counter()
            for k in range(5):
                local.batch_at(step + k)
            steps_local.append((time.perf_counter() - t0) / 5)
            after = cache.stats
            held += after["misses"] == before["misses"] and after["bytes_fetched"] == before["bytes_fetched"]
    hit, unchecked = float(np.median(per_hit)) * 1e6, float(np.median(bare)) * 1e6
    hps = float(np.median(hits_per_step))
    notes = (
        f"a hit {hit:.0f} us per shard (unchecked exists+touch {unchecked:.0f} us: the check adds "
        f"{hit - unchecked:.0f} us); a step of 32 records from 32 shards: {hps:.0f} hits, +{hps * (hit - unchecked) / 1000:.2f} ms "
        f"of checks in a {float(np.median(steps_remote)) * 1000:.1f} ms step (local folder: "
        f"{float(np.median(steps_local)) * 1000:.1f} ms); held = every hit a hit (nothing fetched again)"
    )
    return trials, held, notes


_STALLS = [
    "manifest never answered",
    "shard never answered",
    "shard stalls mid-body",
    "file by URL stalls mid-body",
    "server never accepts",
]
STALL_TIMEOUTS = {"connect_timeout": 1.0, "read_timeout": 1.0, "retries": 1, "backoff": 0.1}


def stalled_server(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    clean = _prepared(tmp, 0)
    served = os.path.join(tmp, "stall-served")
    os.makedirs(served, exist_ok=True)
    c = STALL_TIMEOUTS
    tries = int(c["retries"]) + 1
    bound = 3 * (c["connect_timeout"] + c["read_timeout"]) * tries
    held, seconds, failures, kinds = 0, [], [], {}
    by_kind: dict[str, list[float]] = {}
    for t, how in enumerate(_rounds(rng, _STALLS, trials)):
        kinds[how] = kinds.get(how, 0) + 1
        shutil.copytree(clean, os.path.join(served, f"t{t}"))
        if how.startswith("file by URL"):
            common.write_array_record(os.path.join(served, f"t{t}.array_record"), id_records(2000))
        with contextlib.ExitStack() as stack:
            srv = stack.enter_context(_Server(served))
            shard = _manifest(clean)["shards"][0]["file"]
            url = f"{srv.url}/t{t}"
            stalled = {
                "manifest never answered": (f"/t{t}/manifest.json", "silent"),
                "shard never answered": (f"/t{t}/{shard}", "silent"),
                "shard stalls mid-body": (f"/t{t}/{shard}", "partial"),
                "file by URL stalls mid-body": (f"/t{t}.array_record", "partial"),
            }.get(how)
            if stalled is not None:
                srv.stalls[stalled[0]] = stalled[1]
                named = srv.url + stalled[0]
            else:  # a listening socket whose queue of connections is full: a connection is never made
                listener = stack.enter_context(socket.socket())
                listener.bind(("127.0.0.1", 0))
                listener.listen(0)
                port = listener.getsockname()[1]
                for _ in range(3):
                    filler = stack.enter_context(socket.socket())
                    filler.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        filler.connect(("127.0.0.1", port))
                url = f"http://127.0.0.1:{port}/t{t}"
                named = url
            box: list = []

            def attempt(url: str = url, how: str = how, box: list = box, t: int = t, base: str = srv.url) -> None:
                t0 = time.monotonic()
                try:
                    try:
                        cache = _cache(os.path.join(tmp, f"stall-cache-{t}"), **c)
                    except TypeError:  # a cache that takes no timeouts: its fetches wait as long as they wait
                        cache = _cache(os.path.join(tmp, f"stall-cache-{t}"), retries=1, backoff=0.1)
                    if how.startswith("file by URL"):
                        src = quern.sources.ArrayRecordSource([f"{base}/t{t}.array_record"], cache=cache)
                    else:
                        src = quern.sources.ArrayRecordSource(url, cache=cache)
                    _all(src)
                    box.append(("no error", "", time.monotonic() - t0))
                except Exception as e:
                    box.append((type(e).__name__, str(e), time.monotonic() - t0))

            thread = threading.Thread(target=attempt, daemon=True)
            thread.start()
            thread.join(bound + 10)
            if not box:
                failures.append(f"{how}: no answer within {bound + 10:g} s (a hang)")
                continue  # leaving the with stops the server: the read ends
        kind, message, took = box[0]
        seconds.append(took)
        by_kind.setdefault(how, []).append(took)
        cause = any(w in message.lower() for w in ("timeout", "timed out"))
        if kind == "SourceError" and named in message and cause and took <= bound:
            held += 1
        else:
            failures.append(f"{how}: {kind} after {took:.1f} s: {message[:200]!r}")
    c_text = f"connect_timeout={c['connect_timeout']:g} s, read_timeout={c['read_timeout']:g} s, retries={c['retries']}"
    figures = f"median {float(np.median(seconds)):.1f} s, max {max(seconds):.1f} s" if seconds else "no figure"
    notes = f"{figures} to the error ({c_text}; bound {bound:g} s); " + ", ".join(
        f"{v} {k}" + (f" (max {max(by_kind[k]):.1f} s)" if by_kind.get(k) else "") for k, v in sorted(kinds.items())
    )
    notes += "; held = SourceError naming the URL and the timeout within the bound"
    return trials, held, notes + ("; not held: " + " | ".join(failures[:4]) if failures else "")


_DEFINITION_CHILD = """
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import quern
mod = __import__(sys.argv[2])
kind, how, value, cache = sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
if how == "rebound":
    mod.THR = value
    name = mod.__name__ + ".THR"
else:
    mod.CFG["thr"] = value
    name = mod.__name__ + ".CFG"
n = 200_000
src = quern.sources.ArraySource({"x": np.arange(n, dtype=np.int64)})
out = {"name": name}
try:
    if kind == "filter":
        pipe = quern.Pipeline.from_source(src, seed=1, num_epochs=1).filter(
            mod.keep if how == "rebound" else mod.keep_cfg, cache_dir=cache, workers=2
        )
        out["kept"], out["want"] = pipe.stream_len, n - value
    else:
        pipe = quern.Pipeline.from_source(src, seed=1).shuffle().map(
            mod.shift if how == "rebound" else mod.shift_cfg
        ).batch(16)
        same = []
        with pipe.iterator(num_workers=2) as it:
            for s in range(4):
                same.append(bool(np.array_equal(next(it)["x"], pipe.batch_at(s)["x"])))
        out["same"] = same
except Exception as e:
    out["error"] = type(e).__name__ + ": " + " ".join(str(e).split())
print(json.dumps(out), flush=True)
"""

_DEFINITION_MODULE = '''
"""A configuration module whose globals the program changes after importing it."""
THR = 0
CFG = {"thr": 0}


def keep(rec):
    return bool(rec["x"] >= THR)


def keep_cfg(rec):
    return bool(rec["x"] >= CFG["thr"])


def shift(rec):
    return {"x": rec["x"] + THR}


def shift_cfg(rec):
    return {"x": rec["x"] + CFG["thr"]}
'''


def definition_mismatch(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    folder = os.path.join(tmp, "definition")
    os.makedirs(folder, exist_ok=True)
    held, failures, kinds, took = 0, [], {}, []
    kinds_hows = [(k, h) for k in ("filter (scan processes)", "map (num_workers=2)") for h in ("rebound", "mutated")]
    for t, (kind, how) in enumerate(_rounds(rng, kinds_hows, trials)):
        kinds[f"{kind.split()[0]} {how}"] = kinds.get(f"{kind.split()[0]} {how}", 0) + 1
        module = f"faults_cfg_{t}_{rng.randrange(10**6)}"
        with open(os.path.join(folder, module + ".py"), "w") as f:
            f.write(_DEFINITION_MODULE)
        value = rng.randrange(1, 199_999)
        args = [folder, module, kind.split()[0], how, str(value), os.path.join(folder, f"cache-{t}")]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _DEFINITION_CHILD, *args], capture_output=True, text=True, timeout=120
            )
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
            failures.append(f"{kind} {how}: no result ({type(e).__name__})")
            continue
        took.append(time.monotonic() - t0)
        wrong = out.get("kept", out.get("want")) != out.get("want") or not all(out.get("same", [True]))
        if "error" in out and f"`{out['name']}`" in out["error"] or ("error" in out and out["name"] in out["error"]):
            held += not wrong
            if wrong:
                failures.append(f"{kind} {how}: other batches before the error")
        elif "error" in out:
            failures.append(f"{kind} {how}: an error not naming {out['name']}: {out['error'][:200]}")
        else:
            got = (
                f"kept {out['kept']} of 200000 (the parent's definition keeps {out['want']})"
                if "kept" in out
                else f"batches equal to num_workers=0: {out['same']}"
            )
            failures.append(f"{kind} {how}: no error, {got}")
    notes = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    notes += f"; {float(np.median(took)):.1f} s a trial" if took else ""
    notes += _definition_check_cost()
    notes += "; held = an error naming the global, never other batches or survivors"
    return trials, held, notes + ("; not held: " + " | ".join(failures[:3]) if failures else "")


def _definition_check_cost() -> str:
    """What a fresh process's check of the definition costs, on a pipeline of 4 transforms."""
    try:
        from quern.pipeline.identity import samedef
    except ImportError:
        return ""
    import pickle

    pipe = (
        quern.Pipeline.from_source(quern.sources.ArraySource({"x": np.arange(1000)}), seed=0)
        .shuffle()
        .map(slow_decode)
        .map(id_records)
        .batch(10)
        .map_batch(np.asarray)
    )
    data = pickle.dumps(pipe)
    times = []
    for _ in range(20):
        loaded = pickle.loads(data)
        t0 = time.perf_counter()
        samedef.check_sent(loaded, "the benchmark")
        times.append(time.perf_counter() - t0)
    return f"; the check in a fresh process: {float(np.median(times)) * 1000:.2f} ms (a pipeline of 4 transforms)"


_SLOW_MAP = """\
import pathlib
import time


def f(x):
    wait = pathlib.Path("faults_slow.sleep")  # seconds per record (a file: a map may not read the environment)
    time.sleep(float(wait.read_text()) if wait.exists() else 0.0)
    return x
"""


def _prepare_command(inputs: str, out: str, workers: int, *extra: str) -> list[str]:
    """``python -m quern prepare`` of ``inputs`` with the slow map (``faults_slow:f``, in the folder it runs in)."""
    return [
        sys.executable, "-m", "quern", "prepare", inputs, "--output", out, "--map", "faults_slow:f",
        "--shard-size", "8KB", "--workers", str(workers), *extra,
    ]  # fmt: skip


def _slow_folder(folder: str, sleep: float) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "faults_slow.py"), "w") as f:
        f.write(_SLOW_MAP)
    with open(os.path.join(folder, "faults_slow.sleep"), "w") as f:
        f.write(str(sleep))


_CHANGES = ["rewritten, same size", "a line or bytes appended", "truncated", "replaced by a rename"]


def _change(path: str, how: str, rng: random.Random) -> None:
    with open(path, "rb") as f:
        data = f.read()
    if how == "rewritten, same size":
        new = bytes(c ^ 1 if c not in b'\n"{}:' else c for c in data)
        with open(path, "r+b") as f:
            f.write(new)
    elif how == "a line or bytes appended":
        with open(path, "ab") as f:
            f.write(b'{"text": "appended"}\n' if path.endswith(".jsonl") else b"appended")
    elif how == "truncated":
        cut = data.rfind(b"\n", 0, len(data) // 2) + 1 if path.endswith(".jsonl") else len(data) // 2
        with open(path, "r+b") as f:
            f.truncate(max(cut, 1))
    else:
        with open(path + ".new", "wb") as f:
            f.write(data.replace(b"a", b"b") if path.endswith(".jsonl") else rng.randbytes(len(data)))
        os.replace(path + ".new", path)


def prepare_input_changed(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    held, tried, lost, failures, kinds = 0, 0, 0, [], {}
    cases = _rounds(rng, [(k, c) for k in ("JSON lines", "a folder of small files") for c in _CHANGES], trials)
    for t in range(trials * 3):
        if tried == trials:
            break
        folder = os.path.join(tmp, f"prep-changed-{t}")
        _slow_folder(folder, 0.02)
        kind, how = cases[tried]
        if kind == "JSON lines":
            path = os.path.join(folder, "docs.jsonl")
            with open(path, "w") as f:
                for i in range(60):
                    f.write(json.dumps({"text": f"document {i} " + "a" * rng.randint(50, 150)}) + "\n")
            inputs, extra = path, ["--field", "text"]
        else:
            inputs = os.path.join(folder, "IN")
            _small_files(inputs, t, count=60, size=300)
            path = os.path.join(inputs, f"f{rng.randrange(60):03d}.bin")
            extra = []
        out = os.path.join(folder, "OUT")
        proc = subprocess.Popen(
            _prepare_command(inputs, out, 0, *extra),
            cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            plan = os.path.join(out, ".quern-prepare", "plan.json")
            while not os.path.exists(plan) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.4))  # reading the inputs (60 records, 20 ms each)
            if proc.poll() is not None:  # done before the change: not a trial
                lost += 1
                proc.communicate(timeout=60)
                continue
            _change(path, how, rng)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        tried += 1
        kinds[kind] = kinds.get(kind, 0) + 1
        named = os.path.basename(path) in err
        complete = os.path.exists(os.path.join(out, "manifest.json"))
        if proc.returncode not in (0, None) and proc.returncode > 0 and named and not complete:
            held += 1
        else:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            failures.append(
                f"{kind} {how}: exit {proc.returncode}, manifest {'written' if complete else 'absent'}: {last[:200]!r}"
            )
    notes = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    notes += f" ({min(tried, len(_CHANGES) * 2)} of {len(_CHANGES) * 2} kinds of input and change)"
    notes += "; held = non-zero exit naming the file, no manifest.json"
    notes += f"; {lost} runs done before the change (not trials)" if lost else ""
    return tried, held, notes + ("; not held: " + " | ".join(failures[:3]) if failures else "")


def prepare_kill(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    import psutil

    held, left_total, seen_total, failures, gone_in = 0, 0, 0, [], []
    for t in range(trials):
        folder = os.path.join(tmp, f"prep-kill-{t}")
        _slow_folder(folder, 0.05)
        _small_files(os.path.join(folder, "IN"), t, count=40, size=1500)
        out = os.path.join(folder, "OUT")
        proc = subprocess.Popen(
            _prepare_command("IN", out, 2), cwd=folder,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        tree: list = []
        try:
            parent = psutil.Process(proc.pid)
            done = os.path.join(out, ".quern-prepare", "done")
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:  # the pool is working: a shard is done
                if os.path.isdir(done) and os.listdir(done):
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            with contextlib.suppress(psutil.NoSuchProcess):
                tree = parent.children(recursive=True)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            t0 = time.monotonic()
            while any(_alive(p.pid) for p in tree) and time.monotonic() < t0 + 10:
                time.sleep(0.02)
            gone_in.append(time.monotonic() - t0)
            left = [p for p in tree if _alive(p.pid)]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        seen_total += len(tree)
        left_total += len(left)
        if tree and not left:
            held += 1
        else:
            names = []
            for p in left:
                with contextlib.suppress(psutil.Error):
                    names.append(" ".join(p.cmdline())[:80])
            failures.append(f"{len(left)} of {len(tree)} left: {names[:3]}" if tree else "no process of the pool seen")
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    notes = f"processes left: {left_total} (of {seen_total} under the {trials} prepares killed)"
    notes += f", all gone within {max(gone_in):.2f} s of its end" if gone_in and not left_total else ""
    notes += "; held = no process of its tree alive 10 s after kill -9"
    return trials, held, notes + ("; not held: " + " | ".join(failures[:3]) if failures else "")


SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {
    "worker kill": worker_kill,
    "parent kill": parent_kill,
    "ctrl-c storm": ctrl_c_storm,
    "fork": fork,
    **{f"{how} {kind}": damaged(kind, how) for kind in KINDS for how in ("truncated", "corrupted")},
    "malformed config": malformed_config,
    "manifest traversal": manifest_traversal,
    "stale cache": stale_cache,
    "swapped cache": swapped_cache,
    "cache hit cost": cache_hit_cost,
    "definition mismatch": definition_mismatch,
    "stalled server": stalled_server,
    "prepare input changed": prepare_input_changed,
    "prepare kill -9": prepare_kill,
    **faults_live.SCENARIOS,
    **faults_indexes.SCENARIOS,
    **faults_digests.SCENARIOS,
    **faults_ledgers.SCENARIOS,
    **faults_inputs.SCENARIOS,
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
