"""Tests of pipeline/workers/.

Worker processes: bit-identical output for every worker count, faults, clean shutdown.

Every expected batch comes from ``pipe.batch_at`` computed in this process; the
iterator's batches come from real worker processes (``stats()`` shows which
process computed each step). Leak checks look at the real system: this
process's children (psutil), ``/dev/shm`` and ``/proc/<pid>/maps``.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from helpers import assert_batches_equal, write_array_record

import quern
from quern import WorkerError

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- transforms (module level: workers import them)


def jitter(rec, rng):
    return {**rec, "noise": rng.normal(size=2).astype(np.float32)}


def add_stats(batch):
    return {**batch, "total": batch["tokens"].sum(axis=1, dtype=np.int64)}


def fail_on_record(rec):
    if rec["id"] == 140:
        raise ValueError("record 140 is bad")
    return rec


def fail_on_big_batch(batch):
    if batch["id"].max() > 900:
        raise KeyError("too big")
    return batch


def die_on_record(rec):
    if rec["id"] == 77 and os.environ.get("QUERN_TEST_PARENT") != str(os.getpid()):
        os.kill(os.getpid(), signal.SIGKILL)  # only in a worker
    return rec


# --------------------------------------------------------------------------- helpers


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _memfd_maps(pid: int, inodes: bool = False) -> list[tuple[int, ...]]:
    """(start, end) of the ``memfd:quern`` mappings of process ``pid`` (and the
    inode of the memory file, which is the same in every process that maps it).

    For this process, garbage is collected first: batches an earlier test left in a reference
    cycle (a caught exception's traceback, say) hold their mappings only until then."""
    if pid == os.getpid():
        gc.collect()
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "memfd:quern" in line:
                fields = line.split()
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16)) + ((int(fields[4]),) if inodes else ()))
    return out


def _arrays(n=1000):
    return {"id": np.arange(n, dtype=np.int64), "x": np.arange(2 * n, dtype=np.float32).reshape(n, 2)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three ArrayRecord shards of variable-length int32 token records (1000 in all)."""
    d = tmp_path_factory.mktemp("ar")
    rng = np.random.default_rng(5)
    paths = []
    for k, n in enumerate([400, 350, 250]):
        p = d / f"tokens-{k}.array_record"
        write_array_record(
            p, [rng.integers(1, 1000, size=int(rng.integers(1, 60)), dtype=np.int32).tobytes() for _ in range(n)]
        )
        paths.append(str(p))
    return paths


def _token_pipe(paths, seed=0, num_epochs=None, batch=16, drop_remainder=True):
    src = quern.sources.ArrayRecordSource(paths)
    return (
        quern.Pipeline.from_source(src, seed=seed, num_epochs=num_epochs)
        .shuffle()
        .map(quern.transforms.decode(np.int32))
        .map(quern.transforms.pad(32))
        .random_map(jitter)
        .batch(batch, drop_remainder=drop_remainder)
        .map_batch(add_stats)
    )


def _started(it, timeout=60):
    assert it.wait_for_workers(timeout), "workers did not start"
    return it


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("start", [0, 5, 1001])
def test_every_worker_count_gives_batch_at(shards, start):
    pipe = _token_pipe(shards, seed=11)
    want = [pipe.batch_at(s) for s in range(start, start + 40)]
    for w in [0, 1, 2, 3]:
        with pipe.iterator(start_step=start, num_workers=w, read_ahead=3) as it:
            if w:
                _started(it)
            got = [next(it) for _ in range(40)]
            stats = it.stats()
        for s, (g, e) in enumerate(zip(got, want), start):
            assert_batches_equal(g, e, f"num_workers={w} step {s}")
        if w:  # the steps really came from the workers, each from its own
            assert stats["computed_in_parent"] == 0
            assert all(n > 0 for n in stats["delivered_by_worker"]), stats


class Squares:
    """grain's data-source protocol: any object with ``__len__`` and ``__getitem__``."""

    def __len__(self):
        return 500

    def __getitem__(self, i):
        return {"id": np.int64(i), "sq": np.float64(i) ** 2}


@pytest.mark.parametrize("kind", ["parquet", "zarr", "sequence"])
def test_other_sources_through_workers(kind, tmp_path):
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for k in range(2):
            table = pa.table({"id": np.arange(k * 300, (k + 1) * 300), "v": [[float(i)] * (i % 5) for i in range(300)]})
            pq.write_table(table, tmp_path / f"part-{k}.parquet", row_group_size=64)
        src = quern.sources.ParquetSource(str(tmp_path / "*.parquet"))
        pipe = quern.Pipeline.from_source(src, seed=5).shuffle("block").map(quern.transforms.pad(4, key="v"))
    elif kind == "zarr":
        import tensorstore as ts

        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "z")}}
        arr = ts.open(
            spec, create=True, dtype=ts.int32, shape=[700, 3], chunk_layout=ts.ChunkLayout(chunk_shape=[50, 3])
        ).result()
        arr.write(np.arange(2100, dtype=np.int32).reshape(700, 3)).result()
        pipe = quern.Pipeline.from_source(quern.sources.TensorStoreSource(spec), seed=5).shuffle()
    else:
        pipe = quern.Pipeline.from_source(Squares(), seed=5).shuffle()
    pipe = pipe.batch(32)
    with pipe.iterator(num_workers=2, start_step=3) as it:
        _started(it)
        for s in range(3, 43):
            assert_batches_equal(next(it), pipe.batch_at(s), f"{kind} step {s}")
        assert it.stats()["computed_in_parent"] == 0


class GatedIdentity:
    """A batch transform that does nothing, but whose unpickling in another process
    waits until the file ``gate`` exists: no worker can start (the fork server loads
    the pipeline first) before the test opens the gate, however fast workers start."""

    def __init__(self, gate):
        self.gate, self.parent = str(gate), os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        deadline = time.monotonic() + 60  # never a worker stuck for good
        while os.getpid() != self.parent and not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)

    def __call__(self, batch):
        return batch


def with_pid(batch):
    """Adds the id of the process that computed the batch, one per row."""
    return {**batch, "pid": np.full(len(batch["tokens"]), os.getpid(), np.int64)}


def test_no_step_runs_in_the_parent(shards, tmp_path):
    """Not even while the workers start: the first batches wait for them (here held
    at start-up by a gate that opens only after next() has been called)."""
    gate = tmp_path / "gate"
    pipe = _token_pipe(shards, seed=2).map_batch(GatedIdentity(gate)).map_batch(with_pid)
    opener = threading.Timer(0.3, gate.touch)
    with pipe.iterator(num_workers=2) as it:
        opener.start()
        try:
            got = [next(it) for _ in range(40)]  # the first one waits for the gate
        finally:
            opener.cancel()
        stats, workers = it.stats(), set(it.worker_pids)
    assert gate.exists()
    pids = {int(p) for g in got for p in g["pid"]}
    assert os.getpid() not in pids and pids <= workers and len(pids) == 2, (pids, workers)
    for s, g in enumerate(got):
        want = pipe.batch_at(s)
        assert_batches_equal(
            {k: v for k, v in g.items() if k != "pid"}, {k: v for k, v in want.items() if k != "pid"}, f"step {s}"
        )
    assert stats["computed_in_parent"] == 0
    assert sum(stats["delivered_by_worker"]) >= 40 and all(n >= 20 for n in stats["delivered_by_worker"]), stats


class StartsAThread:
    """A record transform whose unpickling starts a thread (as importing some modules
    does): the fork server, which loads the pipeline, then has a thread it did not
    start itself, and must not fork."""

    def __init__(self):
        self.name = "starts a thread"  # a state, so that unpickling calls __setstate__

    def __setstate__(self, state):
        self.__dict__.update(state)
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()

    def __call__(self, rec):
        return rec


@pytest.mark.parametrize("threads", [False, True])
def test_workers_are_forked_by_a_fork_server_unless_it_has_threads(threads):
    """Workers are forked from one fresh interpreter (the fork server, a child of this
    process), never from this process; if loading the pipeline started a thread
    there, each worker is a fresh interpreter instead. Either way a killed worker is
    replaced and the batches are the same."""
    pipe = quern.Pipeline.from_source(_arrays(), seed=0)
    pipe = (pipe.map(StartsAThread()) if threads else pipe).batch(10)
    children = _children()
    with pipe.iterator(num_workers=2, read_ahead=2) as it:
        _started(it)
        got = [next(it) for _ in range(10)]
        servers = {psutil.Process(p).ppid() for p in it.worker_pids}
        assert len(servers) == 1 and servers <= _children() - children and os.getpid() not in servers
        entry = "workers.worker import main" if threads else "workers.forkserver import serve"
        assert all(entry in " ".join(psutil.Process(p).cmdline()) for p in it.worker_pids)
        victim = psutil.Process(it.worker_pids[0])
        victim.kill()
        victim.wait(30)  # gone (reaped by the fork server), so the pool must see it
        got += [next(it) for _ in range(30)]
        assert it.stats()["worker_restarts"] == 1 and victim.pid not in it.worker_pids
    for s, g in enumerate(got):
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")
    assert _children() == children


def test_host_slices_and_a_partial_last_batch(shards):
    pipe = _token_pipe(shards, seed=4, num_epochs=2, batch=48, drop_remainder=False)
    assert pipe.num_steps == 42  # 2000 records / 48, the last batch has 32 rows
    for h in range(2):
        with pipe.iterator(process_index=h, process_count=2, num_workers=2, read_ahead=4) as it:
            _started(it)
            got = list(it)
        assert len(got) == 42
        for s, g in enumerate(got):
            assert_batches_equal(g, pipe.batch_at(s, h, 2), f"host {h} step {s}")
    assert got[-1]["tokens"].shape == (8, 32)  # host 1's share of the last batch's 32 rows


def test_held_batches_are_never_overwritten(shards):
    pipe = _token_pipe(shards, seed=6)
    with pipe.iterator(num_workers=2, prefetch=1, read_ahead=2) as it:  # 4 slots: each reused many times
        _started(it)
        held = [next(it) for _ in range(60)]
        os.kill(it.worker_pids[0], signal.SIGKILL)  # its slots stay valid for the batches held
        held += [next(it) for _ in range(20)]
        assert it.stats()["worker_restarts"] == 1  # the kill did happen while batches were held
    for s, g in enumerate(held):  # also after close()
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")
    del g, held
    assert _memfd_maps(os.getpid()) == []  # dropping the batches unmaps their shared memory


def odd_structures(rec):
    i = int(rec["id"])
    return {
        "nested": {"a": rec["x"], "b": (rec["id"], np.float64(i) / 3)},
        "text": f"record-{i}",  # collates to an object array: travels inside the pickle
        "strided": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2] + i,  # non-contiguous
        "big": np.full((100, 50), i, np.float32),
    }


def test_any_batch_structure_travels(shards):
    pipe = quern.Pipeline.from_source(_arrays(), seed=1).shuffle().map(odd_structures).batch(10)
    with pipe.iterator(num_workers=2, start_step=3) as it:
        _started(it)
        for s in range(3, 23):
            got = next(it)
            assert_batches_equal(got, pipe.batch_at(s), f"step {s}")
            assert got["text"].dtype == object
            assert got["big"].flags.writeable and got["big"].flags.c_contiguous


def test_source_arrays_reach_workers_through_one_shared_copy():
    n = 1 << 20  # 8 MiB of int64
    pipe = quern.Pipeline.from_source({"id": np.arange(n, dtype=np.int64)}, seed=0).shuffle().batch(64)
    with pipe.iterator(num_workers=2) as it:
        _started(it)
        for s in range(10):
            assert_batches_equal(next(it), pipe.batch_at(s))
        # each worker maps the one shared copy of the array: the same memory file as the
        # parent's (same inode), big enough to hold it
        big = [
            {ino for lo, hi, ino in _memfd_maps(pid, inodes=True) if hi - lo >= n * 8}
            for pid in [os.getpid(), *it.worker_pids]
        ]
        assert len(big) == 3 and set.intersection(*big), big


def test_shared_memory_is_bounded_by_workers_times_slots(shards):
    pipe = _token_pipe(shards)
    W, prefetch, read_ahead = 2, 2, 3
    with pipe.iterator(num_workers=W, prefetch=prefetch, read_ahead=read_ahead) as it:
        _started(it)
        for _ in range(100):
            next(it)
        slots = _memfd_maps(os.getpid())
        # one mapping per slot plus the shared pipeline definition, whatever the number of steps:
        # prefetch * read_ahead slots in flight per worker, plus one for the batch the caller
        # still holds while asking for the next one
        assert len(slots) <= W * (prefetch * read_ahead + 1) + 1
        assert len(slots) >= W * read_ahead
    assert _memfd_maps(os.getpid()) == []


def widen(batch):
    """8 MiB per batch of 64 rows."""
    return {"big": np.repeat(batch["x"][:, :1], 32768, axis=1)}


BUDGET = 256 << 20  # the iterator's documented bound on the slots of the default task size


def test_default_task_size_keeps_slots_within_the_budget():
    pipe = quern.Pipeline.from_source(_arrays(), seed=0).batch(64).map_batch(widen)
    batch_bytes = 64 * 32768 * 4
    # the premise: tasks of the largest default size (2 workers * prefetch 2 * 64 steps of 8 MiB
    # = 2 GiB) would take several times the budget, so the default must be lowered to fit
    with pipe.iterator(num_workers=2) as it:
        _started(it)
        for _ in range(120):
            next(it)
        mapped = sum(hi - lo for lo, hi in _memfd_maps(os.getpid()))
        assert_batches_equal(next(it), pipe.batch_at(120))
    assert mapped <= BUDGET + 2 * batch_bytes + (1 << 20)  # + one held batch per worker


def test_workers_open_files_lazily(shards):
    """Starting a worker reads no file: the pipeline arrives with its index, and a
    worker opens a file when it first reads from it."""
    pipe = _token_pipe(shards)
    with pipe.iterator(num_workers=2) as it:
        _started(it)
        for pid in it.worker_pids:
            assert not [f for f in psutil.Process(pid).open_files() if f.path.endswith(".array_record")]
        for _ in range(40):
            next(it)
        for pid in it.worker_pids:
            assert {f.path for f in psutil.Process(pid).open_files()} >= set(shards)


class Scaler:
    """A transform that reuses a preallocated scratch array (800 KB: it travels to the
    workers through shared memory, and must be writable there as it is here)."""

    def __init__(self):
        self.scratch = np.zeros(100_000)

    def __call__(self, batch):
        out = self.scratch[: batch["x"].size].reshape(batch["x"].shape)
        np.multiply(batch["x"], 2, out=out)
        return {**batch, "x2": out.copy()}


def test_arrays_of_the_pipeline_are_writable_in_workers():
    pipe = quern.Pipeline.from_source(_arrays(), seed=0).batch(10).map_batch(Scaler())
    with pipe.iterator(num_workers=2) as it:
        _started(it)
        for s in range(10):
            assert_batches_equal(next(it), pipe.batch_at(s))


def test_memory_of_batches_held_then_dropped_is_given_back(shards):
    W, prefetch, read_ahead = 2, 2, 2
    with _token_pipe(shards).iterator(num_workers=W, prefetch=prefetch, read_ahead=read_ahead) as it:
        _started(it)
        held = [next(it) for _ in range(100)]
        assert len(_memfd_maps(os.getpid())) > 100  # each held batch keeps its slot
        del held
        for _ in range(30):
            next(it)
        assert len(_memfd_maps(os.getpid())) <= W * (prefetch * read_ahead + 2) + 1


_SCRIPT_STDOUT = """
import os
import numpy as np, quern

def shout(batch):
    print("computed", int(batch["id"][0]), "in", os.getpid())
    return batch

if __name__ == "__main__":
    pipe = quern.Pipeline.from_source({"id": np.arange(1000)}, seed=0).batch(10).map_batch(shout)
    with pipe.iterator(num_workers=2) as it:
        it.wait_for_workers(60)
        for _ in range(20):
            next(it)
    print("parent", os.getpid(), flush=True)
"""

_SCRIPT_MAIN_CLASSES = """
from typing import NamedTuple
import numpy as np, quern

class Pair(NamedTuple):
    a: np.ndarray
    b: np.ndarray

class Oops(Exception):
    pass

def to_pair(rec):
    return Pair(rec["x"], rec["x"] * 2)

def check(batch):
    if int(batch.a[0]) >= 500:
        raise Oops("five hundred")
    return batch

if __name__ == "__main__":
    pipe = quern.Pipeline.from_source({"x": np.arange(1000)}, seed=0).map(to_pair).batch(100).map_batch(check)
    with pipe.iterator(num_workers=2) as it:
        it.wait_for_workers(60)
        for s in range(5):
            batch = next(it)
            assert type(batch) is Pair and np.array_equal(batch.b, pipe.batch_at(s).b), s
        try:
            next(it)
        except quern.StepError as e:
            cause = e.__cause__
            print(f"step {it.step}: cause {cause!r}, the script's own class: {type(cause) is Oops}, "
                  f"computed in the parent: {it.stats()['computed_in_parent']}")
"""

_SCRIPT_FD_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))  # far below what the default slots would take
sys.path.insert(0, {tests!r})
import numpy as np
from helpers import assert_batches_equal
from test_workers import _token_pipe

pipe = _token_pipe({shards!r})
with pipe.iterator(num_workers=2) as it:
    it.wait_for_workers(60)
    for s in range(300):
        assert_batches_equal(next(it), pipe.batch_at(s), f"step {{s}}")
print("ok", it.stats()["computed_in_parent"])
"""


def _run_script(tmp_path, text, env=None):
    script = tmp_path / "script.py"
    script.write_text(text)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_what_workers_print_reaches_the_parents_stdout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout is a pipe: block-buffered
    out = _run_script(tmp_path, _SCRIPT_STDOUT, env)
    parent = int(re.search(r"^parent (\d+)$", out, re.MULTILINE).group(1))
    printers = {}  # first id of a batch -> the processes that printed it
    for first, pid in re.findall(r"^computed (\d+) in (\d+)$", out, re.MULTILINE):
        printers.setdefault(int(first), set()).add(int(pid))
    assert set(range(0, 200, 10)) <= set(printers), out
    pids = set().union(*printers.values())
    assert parent not in pids and len(pids) == 2, (parent, printers)  # the workers' output, both of them


def test_classes_of_the_main_script_in_batches_and_errors(tmp_path):
    out = _run_script(tmp_path, _SCRIPT_MAIN_CLASSES).strip()
    assert out == "step 5: cause Oops('five hundred'), the script's own class: True, computed in the parent: 0"


def test_a_low_limit_of_open_files_is_respected(tmp_path, shards):
    out = _run_script(tmp_path, _SCRIPT_FD_LIMIT.format(tests=str(REPO / "tests"), shards=shards))
    assert out.strip() == "ok 0"


# --------------------------------------------------------------------------- faults


def test_sigkilled_worker_is_replaced_and_output_is_unchanged(shards):
    pipe = _token_pipe(shards, seed=9)
    with pipe.iterator(num_workers=2, read_ahead=4) as it:
        _started(it)
        got = [next(it) for _ in range(10)]
        victim = it.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        got += [next(it) for _ in range(60)]
        assert victim not in it.worker_pids and len(it.worker_pids) == 2
        assert it.stats()["worker_restarts"] == 1
    for s, g in enumerate(got):
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", ["map", "map_batch"])
def test_raising_transform_names_step_host_records_and_stage(stage):
    pipe = quern.Pipeline.from_source(_arrays(), seed=0)
    pipe = pipe.map(fail_on_record).batch(50) if stage == "map" else pipe.batch(50).map_batch(fail_on_big_batch)
    bad_step = 140 // 50 if stage == "map" else 901 // 50  # host 1 has rows 25..49 of each step
    with pipe.iterator(num_workers=2, process_index=1, process_count=2) as it:
        _started(it)
        for _ in range(bad_step):
            next(it)
        with pytest.raises(quern.StepError) as info:
            next(it)
        msg = str(info.value)
        assert f"step {bad_step} (host 1 of 2)" in msg
        assert f"stage {stage}[0]" in msg
        assert "traceback:" in msg and "Traceback (most recent call last)" in msg
        if stage == "map":
            assert "record 140" in msg and isinstance(info.value.__cause__, ValueError)
        else:
            assert "records arrays [925, 926" in msg and isinstance(info.value.__cause__, KeyError)
        assert it.step == bad_step  # asking again retries the same step
        with pytest.raises(quern.StepError, match=f"step {bad_step} "):
            next(it)
        assert it.stats()["computed_in_parent"] == 0


@pytest.mark.timeout(60)
def test_read_error_in_a_worker_names_step_and_file(shards, tmp_path):
    damaged = tmp_path / "damaged.array_record"
    rng = np.random.default_rng(0)
    write_array_record(damaged, [rng.bytes(2000) for _ in range(100)])
    data = bytearray(damaged.read_bytes())
    for i in range(80_000, 80_064):  # inside record ~40's chunk; header and footer intact
        data[i] ^= 0xFF
    damaged.write_bytes(bytes(data))
    pipe = quern.Pipeline.from_source(quern.sources.ArrayRecordSource([shards[0], str(damaged)]), seed=0).batch(50)
    with pipe.iterator(num_workers=2, start_step=6) as it:  # step 8 = records 400..449 = damaged.array_record 0..49
        _started(it)
        next(it), next(it)
        with pytest.raises(quern.StepError) as info:
            next(it)
        assert it.step == 8
        with pytest.raises(quern.StepError, match="step 8 "):  # asking again fails the same way
            next(it)
    msg = str(info.value)
    assert "step 8 (host 0 of 1), stage 'read'" in msg and "damaged.array_record" in msg


_SCRIPT_EXITS = """
import ctypes, os, sys
import numpy as np, quern

def leave(rec):
    if int(rec["id"]) == 160:  # step 3 (batches of 50): worker 1's with 2 workers
        how = os.environ["HOW"]
        if how == "os._exit":
            os._exit(3)
        if how == "sys.exit":
            sys.exit(3)
        ctypes.string_at(0)  # segfault
    return rec

if __name__ == "__main__":
    parent = os.getpid()
    pipe = quern.Pipeline.from_source({"id": np.arange(1000)}, seed=0).map(leave).batch(50)
    with pipe.iterator(num_workers=2) as it:
        for s in range(3):
            assert np.array_equal(next(it)["id"], np.arange(50 * s, 50 * s + 50)), s
        try:
            next(it)
        except quern.WorkerError as e:
            print(f"step {it.step}: WorkerError: {e}")
        print("restarts", it.stats()["worker_restarts"], "in parent", it.stats()["computed_in_parent"])
        for _ in range(2):  # asking again tries again, and fails the same way
            try:
                next(it)
            except quern.WorkerError as e:
                print(f"again at step {it.step}: {str(e).split(';')[0]}")
    print("alive", os.getpid() == parent)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["os._exit", "sys.exit", "segfault"])
def test_a_transform_that_ends_its_process_never_ends_the_parent(tmp_path, how):
    """A step whose transform calls os._exit or sys.exit, or crashes, takes down the
    worker that computes it (3 times), never the training process: a WorkerError at
    exactly that step, and the same when asked again."""
    out = _run_script(tmp_path, _SCRIPT_EXITS, env=dict(os.environ, HOW=how))
    end = "exited with status 3" if how != "segfault" else "was killed by SIGSEGV"
    lines = out.strip().splitlines()
    assert re.fullmatch(
        rf"step 3: WorkerError: worker 1 \(pid \d+\) {end}; it died 3 times in a row without delivering a step "
        r"\(host 0 of 1, steps in progress: \[3(, \d+)*\]\); see its output above",
        lines[0],
    ), out
    assert lines[1] == "restarts 2 in parent 0", out
    assert len(lines) == 5 and all(re.fullmatch(rf"again at step 3: worker 1 \(pid \d+\) {end}", x) for x in lines[2:4])
    assert lines[4] == "alive True", out


@pytest.mark.timeout(90)
def test_worker_that_keeps_dying_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("QUERN_TEST_PARENT", str(os.getpid()))
    children = _children()
    pipe = quern.Pipeline.from_source(_arrays(), seed=0).map(die_on_record).batch(50)
    with pipe.iterator(num_workers=2, start_step=1) as it:  # record 77 is in step 1, worker 1's
        _started(it)
        with pytest.raises(
            WorkerError, match=r"worker 1 .*killed by SIGKILL.*3 times in a row.*steps in progress: \[1,"
        ):
            next(it)
    assert _children() == children  # closed cleanly after the error
    assert _memfd_maps(os.getpid()) == []


def test_a_killed_fork_server_is_replaced_with_its_workers(shards):
    """The fork server dies (the OOM killer, say): its workers die with it; a new
    server and new workers take over, and the batches are the same."""
    children, shm = _children(), _shm()
    pipe = _token_pipe(shards, seed=12)
    with pipe.iterator(num_workers=2, read_ahead=2) as it:
        _started(it)
        got = [next(it) for _ in range(10)]
        old = it.worker_pids
        server = psutil.Process(psutil.Process(old[0]).ppid())
        assert server.pid in _children() - children
        server.kill()
        server.wait(30)
        got += [next(it) for _ in range(40)]
        assert it.stats()["worker_restarts"] >= 2 and not set(old) & set(it.worker_pids)
        assert all(p not in old for p in it.worker_pids) and len(it.worker_pids) == 2
    for s, g in enumerate(got):
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")
    del g, got  # the batches held their slots
    _assert_clean(children, shm, old)


class ExitsWhenLoaded:
    """A transform whose unpickling ends the process (in any process but the test's)."""

    def __init__(self):
        self.parent = os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.parent:
            os._exit(7)

    def __call__(self, rec):
        return rec


@pytest.mark.timeout(60)
def test_a_fork_server_that_dies_loading_the_pipeline_is_an_error():
    children = _children()
    pipe = quern.Pipeline.from_source(_arrays(), seed=0).map(ExitsWhenLoaded()).batch(10)
    with pipe.iterator(num_workers=2) as it:
        for _ in range(2):  # for good: no endless restarts
            with pytest.raises(
                WorkerError, match=r"could not start: their fork server \(pid \d+\) exited with status 7"
            ):
                next(it)
    assert _children() == children


class HoldsALock:
    """A transform quern can fingerprint (it says what it does) but not pickle (a lock)."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def fingerprint(self):
        return "identity, guarded by a lock"

    def __call__(self, rec):
        return rec


def test_unpicklable_pipeline_fails_at_once():
    pipe = quern.Pipeline.from_source(_arrays(), seed=0).map(HoldsALock()).batch(10)
    assert_batches_equal(
        pipe.batch_at(3), quern.Pipeline.from_source(_arrays(), seed=0).batch(10).batch_at(3)
    )  # fine here
    before = _children()
    with pytest.raises(TypeError, match=r"cannot be sent to worker processes.*lock.*num_workers=0"):
        pipe.iterator(num_workers=2)
    assert _children() == before


@pytest.mark.timeout(60)
def test_worker_that_cannot_load_the_pipeline_reports_why(tmp_path, monkeypatch):
    mod = tmp_path / "vanishing_module.py"
    mod.write_text("def ident(rec):\n    return rec\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_module

    pipe = quern.Pipeline.from_source(_arrays(), seed=0).map(vanishing_module.ident).batch(10)
    mod.unlink()  # the workers cannot import it any more
    with pipe.iterator(num_workers=1) as it:
        with pytest.raises(WorkerError, match="could not start.*ModuleNotFoundError.*vanishing_module"):
            it.wait_for_workers(30)
        for _ in range(2):  # and from then on, every time: no endless restarts
            with pytest.raises(WorkerError, match="could not start"):
                next(it)
        assert it.worker_pids == []
    sys.modules.pop("vanishing_module", None)


# --------------------------------------------------------------------------- nothing left behind


def _assert_clean(before_children, before_shm, pids):
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"workers {pids} still alive"
        time.sleep(0.05)
    assert _children() == before_children
    assert _shm() == before_shm
    assert _memfd_maps(os.getpid()) == []


def test_the_end_of_the_stream_leaves_nothing(shards):
    children, shm = _children(), _shm()
    pipe = _token_pipe(shards, num_epochs=1, batch=100)
    it = _started(pipe.iterator(num_workers=2))
    pids = it.worker_pids
    assert len(pids) == 2 and set(pids) <= _children()
    assert len(list(it)) == 10
    _assert_clean(children, shm, pids)  # StopIteration freed the workers, without close()
    assert it.stats()["workers"] == 2 and it.state()["step"] == 10


@pytest.mark.parametrize("how", ["close", "gc"])
def test_close_or_garbage_collection_leaves_nothing(shards, how):
    children, shm = _children(), _shm()
    it = _token_pipe(shards).iterator(num_workers=3)
    _started(it)
    next(it)
    pids = it.worker_pids
    if how == "close":
        it.close()
        it.close()  # idempotent
        assert it.worker_pids == []
        with pytest.raises(RuntimeError, match="closed"):
            next(it)
    else:
        del it
        gc.collect()
    _assert_clean(children, shm, pids)


@pytest.mark.filterwarnings("ignore:os.fork")
def test_a_forked_child_closing_its_copy_leaves_the_workers_alone(shards):
    pipe = _token_pipe(shards, seed=4)
    with pipe.iterator(num_workers=2) as it:
        _started(it)
        got = [next(it)]
        pid = os.fork()
        if pid == 0:  # the child closes its copy of the iterator, as its exit would
            it.close()
            os._exit(0)
        os.waitpid(pid, 0)
        assert all(psutil.pid_exists(p) for p in it.worker_pids)
        got += [next(it) for _ in range(20)]
        assert it.stats()["worker_restarts"] == 0
    for s, g in enumerate(got):
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")


def test_keyboard_interrupt_in_the_loop(shards):
    children, shm = _children(), _shm()
    pipe = _token_pipe(shards, seed=3)
    it = _started(pipe.iterator(num_workers=2))
    pids = it.worker_pids
    try:
        for _batch in it:  # the last batch stays held, as in a real loop
            if it.step == 30:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    # the iterator is still usable after the interrupt...
    assert_batches_equal(next(it), pipe.batch_at(30))
    # ...and dropping it (as unwinding a program does) cleans up
    del it, _batch
    gc.collect()
    _assert_clean(children, shm, pids)


def slow_batch(batch):
    time.sleep(0.2)
    return batch


def test_ctrl_c_while_waiting_inside_next(shards):
    pipe = _token_pipe(shards, seed=8).map_batch(slow_batch)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pipe.iterator(num_workers=2, read_ahead=2) as it:
            _started(it)
            got = [next(it)]
            interrupted = 0
            for _ in range(5):  # interrupt next() while it waits for a worker
                signal.setitimer(signal.ITIMER_REAL, 0.05)
                try:
                    got.append(next(it))
                except KeyboardInterrupt:
                    interrupted += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            assert interrupted >= 1
            got += [next(it) for _ in range(3)]
    finally:
        signal.signal(signal.SIGALRM, old)
    for s, g in enumerate(got):
        assert_batches_equal(g, pipe.batch_at(s), f"step {s}")


def test_jax_and_threads_in_the_parent_are_safe(shards):
    """Workers are fresh interpreters, never forks of this multi-threaded process."""
    import threading
    import warnings

    import jax.numpy as jnp

    assert float(jnp.ones(3).sum()) == 3.0  # the XLA runtime and its threads are up
    stop = threading.Event()
    busy = threading.Thread(target=lambda: stop.wait(30), daemon=True)
    busy.start()
    pipe = _token_pipe(shards, seed=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # JAX warns when a process that runs it forks
            with pipe.iterator(num_workers=2) as it:
                _started(it)
                for s in range(20):
                    assert_batches_equal(next(it), pipe.batch_at(s))
    finally:
        stop.set()
    assert not [w for w in caught if "fork" in str(w.message)]


_CHILD = textwrap.dedent(
    """
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, should it not end
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever the test process ignores
    sys.path.insert(0, {tests!r})
    from test_workers import _token_pipe
    it = _token_pipe({shards!r}).iterator(num_workers=2)
    it.wait_for_workers(60)
    print(*it.worker_pids, flush=True)
    for batch in it:
        if it.step == 20 and {mode!r} == "exit":
            sys.exit(0)  # leaves the iterator open
        if it.step == 20:
            print("iterating", flush=True)  # and go on until stopped
    """
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["exit", "ctrl-c", "sigkill"])
def test_a_process_that_iterates_leaves_nothing_when_it_ends(shards, mode):
    """The program exits without closing its iterator; or Ctrl-C (SIGINT to its whole
    process group, as a terminal sends it) interrupts it mid-iteration; or it is
    SIGKILLed, and then its workers notice and exit by themselves."""
    shm = _shm()
    code = _CHILD.format(tests=str(REPO / "tests"), shards=shards, mode=mode)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        if mode != "exit":
            assert proc.stdout.readline().strip() == "iterating"
            if mode == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.kill()
        try:  # both pipes drained meanwhile: a child blocked writing to a full pipe would look stuck
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # its threads' stacks, to stderr
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            pytest.fail(f"the program did not end within 90 s ({mode}); where it was:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if mode == "exit":
        assert proc.returncode == 0 and "Traceback" not in err, err
    elif mode == "ctrl-c":
        assert proc.returncode == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err
        assert err.count("Traceback") == 1, err  # the parent's only: workers ignore SIGINT
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their parent ({mode})"
        time.sleep(0.1)
    assert _shm() == shm
