"""Workers that fill the cores read ArrayRecord records on their own thread, not through the library's pool.

ArrayRecord's ``read(list)`` spreads a call's records over a pool of 64 threads that spin
while they wait; in worker processes that fill the cores (whose parallelism is the
processes') the records are read one by one with ``seek`` + ``read()`` instead
(``quern.pipeline.sources.reading``). The records are the same either way.
"""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
from helpers import assert_batches_equal, write_array_record
from remote_folder import prepared_folder

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.pipeline.sources import array_record, reading


@pytest.fixture
def shards(tmp_path):
    """Two files of 200 records each (up to 32 KiB): one record per chunk, and 16 records per chunk."""
    rng = np.random.default_rng(5)
    paths, records = [], []
    for k, options in enumerate(("group_size:1", "group_size:16")):
        recs = [rng.integers(0, 1000, int(rng.integers(1, 8192)), dtype=np.int32).tobytes() for _ in range(200)]
        p = tmp_path / f"part-{k}.array_record"
        write_array_record(p, recs, options)
        paths.append(str(p))
        records.extend(recs)
    return paths, records


@pytest.fixture
def in_caller():
    """This process reads as a worker process does, for the test's duration."""
    reading.use_library_threads(False)
    try:
        yield
    finally:
        reading.use_library_threads(True)


@pytest.fixture
def one_by_one(monkeypatch):
    """The files read a record at a time (their reader's options), counted."""
    seen: list[str] = []
    real = array_record._read_in_caller

    def counted(reader, local):
        seen.append(reader.writer_options_string())
        return real(reader, local)

    monkeypatch.setattr(array_record, "_read_in_caller", counted)
    return seen


def test_reads_one_by_one_give_the_records_of_a_bulk_read(shards, in_caller, one_by_one):
    """Ids in any order, repeated, across both files: the records the files hold. The file of one record per
    chunk is read a record at a time; the file of 16 records per chunk in bulk (a reader keeps its last chunk)."""
    paths, records = shards
    src = quern.sources.ArrayRecordSource(paths)
    rng = np.random.default_rng(0)
    for ids in (rng.integers(0, 400, 257), np.array([399, 0, 199, 200, 0, 17, 17]), np.arange(400)[::-1]):
        assert src.read_many(ids) == [records[i] for i in ids.tolist()]
    assert len(one_by_one) == 3 and all(o.startswith("group_size:1,") for o in one_by_one), one_by_one
    assert src.read_many(np.array([250, 201])) == [records[250], records[201]]  # the second file only
    assert len(one_by_one) == 3
    with pytest.raises(IndexError):
        src.read_many(np.array([400]))


def test_a_cached_remote_folder_reads_one_by_one_too(tmp_path, in_caller, one_by_one):
    """A prepared folder by ``file://`` URL, its shards fetched into the disk cache: the same records."""
    folder, want = prepared_folder(tmp_path, b"remote")
    src = quern.sources.ArrayRecordSource(f"file://{folder}", cache=ShardCache(tmp_path / "cache"))
    ids = np.random.default_rng(1).permutation(30)
    assert src.read_many(ids) == [want[i] for i in ids.tolist()]
    assert len(one_by_one) == len(src.paths)


def test_a_damaged_record_read_one_by_one_names_the_file(tmp_path, in_caller):
    """A record whose bytes are flipped fails the read naming the file, and the other records still read."""
    rng = np.random.default_rng(21)
    recs = [rng.bytes(2000) for _ in range(100)]
    good = tmp_path / "good.array_record"
    write_array_record(good, recs)
    data = bytearray(good.read_bytes())
    mid = len(data) * 2 // 5
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    bad = tmp_path / "flipped.array_record"
    bad.write_bytes(bytes(data))
    src = quern.sources.ArrayRecordSource(str(bad))
    with pytest.raises(quern.SourceError, match="flipped.array_record"):
        src.read_many(np.arange(100))
    assert src.read_many(np.array([99, 0])) == [recs[99], recs[0]]


@pytest.fixture
def two_cores():
    """This process (and the worker processes it starts) may run on two cores only, for the test's duration."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores and sched_setaffinity")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(before)[:2])
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_workers_that_fill_the_cores_read_on_their_own_thread(shards, two_cores, num_workers):
    """On 2 cores, the pool tells 2 workers to read on their own thread, and they do: ArrayRecord's pool threads
    spend nearly no CPU. 1 worker is told to keep the library's pool, which then has a core of its own. The
    batches equal ``batch_at``'s either way."""
    paths, _ = shards
    src = quern.sources.ArrayRecordSource(paths[0])  # one record per chunk
    pipe = quern.Pipeline.from_source(src, seed=1).shuffle().map(quern.transforms.decode(np.int32))
    pipe = pipe.map(quern.transforms.pad(16)).batch(8)  # reading is most of the work
    with pipe.iterator(num_workers=num_workers, read_ahead=8) as it:
        it.wait_for_workers()
        assert it._feed._procs._init.library_threads == (num_workers == 1)  # what the workers were told
        for step in range(500):  # 20 epochs
            batch = next(it)
            if step % 10 == 0:
                assert_batches_equal(batch, pipe.batch_at(step))
        if num_workers == 1:
            return
        time.sleep(0.2)  # the workers' last tasks done
        workers = [psutil.Process(pid) for pid in it.worker_pids]
        assert len(workers) == 2
        for w in workers:
            threads = w.threads()
            main = sum(t.user_time + t.system_time for t in threads if t.id == w.pid)
            others = sum(t.user_time + t.system_time for t in threads if t.id != w.pid)
            assert main > 0.02, (w.pid, threads)
            assert others < 0.1 * main, f"worker {w.pid}: its other threads spent {others:.3f} s, main {main:.3f} s"
