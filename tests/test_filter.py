"""Tests of pipeline/scan.py, pipeline/plan/survivors.py, pipeline/plan/indexfile.py and pipeline/streams/source.py
(a filtered source).

Pipeline.filter: the stream over the survivors, the verified on-disk cache, errors, the scan in processes.

Every expected set of survivors is computed here by brute force over the source's
values (``np.arange``), never by the code under test. Cache folders are
``tmp_path``; nothing is written under ``~/.cache``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from helpers import assert_batches_equal, assert_iterator_gives_batch_at, spy_scan_processes

import quern
from quern.pipeline.definition import scan
from quern.pipeline.order import survivors as sv

pytestmark = pytest.mark.timeout(120)

N = 1000

# Counts predicate calls made in this process. A module object: the fingerprint of a predicate
# describes the module-level values it reads by content (so a plain global counter would change
# the cache key at every call), but a module by its name only.
CALLS = types.ModuleType("quern_test_filter_calls")
CALLS.n = 0
CALLS.chunks = []


# --------------------------------------------------------------------------- transforms (module level: scan processes import them)


def plus_one(rec):
    return {"x": rec["x"] + 1}


def div3(rec):
    return rec["x"] % 3 == 0


def counting_div3(rec):
    CALLS.n += 1
    return rec["x"] % 3 == 0


def even(rec):
    return rec["x"] % 2 == 0


def mod7_is_3(rec):
    CALLS.n += 1
    return rec["x"] % 7 == 3


def fails_on_4321(rec):
    if rec["x"] == 4321:
        raise KeyError("no such thing")
    return True


def jitter(rec, rng):
    return {"x": rec["x"] + rng.integers(0, 2)}


class KeepMany:
    """A vectorised predicate: ``keep_many`` per chunk; calling it per record is a failure."""

    def __call__(self, rec):
        raise AssertionError("the per-record predicate was called although keep_many exists")

    def keep_many(self, records):
        CALLS.chunks.append(len(records))
        return np.asarray([r["x"] % 4 == 1 for r in records], dtype=bool)


# --------------------------------------------------------------------------- helpers


def _src(n=N, seed=0, num_epochs=None):
    return quern.Pipeline.from_source({"x": np.arange(n, dtype=np.int64)}, seed=seed, num_epochs=num_epochs)


def _kept_plus_one_div3(n=N):
    """Source ids whose ``x + 1`` is a multiple of 3 (brute force)."""
    ids = np.arange(n)
    return ids[(ids + 1) % 3 == 0]


def _pipe(cache, seed=0, num_epochs=None, batch=10, drop_remainder=True, n=N):
    return (
        _src(n, seed, num_epochs)
        .shuffle()
        .map(plus_one)
        .filter(div3, cache_dir=cache)
        .batch(batch, drop_remainder=drop_remainder)
    )


def _stream(pipe, steps=None):
    steps = pipe.num_steps if steps is None else steps
    return np.concatenate([pipe.batch_at(s)["x"] for s in range(steps)])


def _cache_files(cache):
    return sorted((cache / "filters").glob("*.survivors"))


# --------------------------------------------------------------------------- 1. the stream over the survivors


@pytest.mark.parametrize("batch", [10, 64, 333, 1000])
def test_one_epoch_yields_every_survivor_once_after_the_map(tmp_path, batch):
    pipe = _pipe(tmp_path, seed=3, num_epochs=1, batch=batch, drop_remainder=False)
    xs = _stream(pipe)
    want = _kept_plus_one_div3() + 1  # the predicate sees x + 1, so raw ids 2, 5, 8, ...
    assert len(want) == 333
    assert len(xs) == len(want)
    np.testing.assert_array_equal(np.sort(xs), want)  # each survivor exactly once, nothing else
    assert np.all(xs % 3 == 0)
    assert not np.array_equal(xs, want)  # shuffled, not in source order


def test_order_depends_on_the_seed_and_epochs_reshuffle(tmp_path):
    want = _kept_plus_one_div3() + 1
    m = len(want)
    one = _stream(_pipe(tmp_path, seed=1, batch=m), 3)  # endless: three epochs
    two = _stream(_pipe(tmp_path, seed=2, batch=m), 1)
    for e in range(3):
        np.testing.assert_array_equal(np.sort(one[e * m : (e + 1) * m]), want)
    assert not np.array_equal(one[:m], one[m : 2 * m])
    assert not np.array_equal(one[m : 2 * m], one[2 * m :])
    assert not np.array_equal(one[:m], two)
    np.testing.assert_array_equal(np.sort(two), want)


# --------------------------------------------------------------------------- 2. addressing: steps, explain, iterator, workers, hosts, resume


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_num_steps_counts_survivors(tmp_path, drop_remainder):
    m = len(_kept_plus_one_div3())  # 333
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=drop_remainder)
    total = 2 * m
    assert pipe.num_steps == (total // 10 if drop_remainder else -(-total // 10))
    assert pipe.num_steps == (66 if drop_remainder else 67)
    last = pipe.batch_at(pipe.num_steps - 1)["x"]
    assert len(last) == (10 if drop_remainder else total % 10)
    with pytest.raises(IndexError):
        pipe.batch_at(pipe.num_steps)
    xs = _stream(pipe)
    np.testing.assert_array_equal(np.sort(xs[:m]), _kept_plus_one_div3() + 1)  # epoch 1 complete


def test_explain_names_survivors_matching_batch_at(tmp_path):
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=False)
    kept = set(_kept_plus_one_div3().tolist())
    seen = []
    for s in range(pipe.num_steps):
        rows = pipe.explain(s)
        names = {name for [(name, _)] in rows}
        ids = np.asarray([i for [(_, i)] in rows])
        assert names == {"arrays"}
        assert set(ids.tolist()) <= kept
        np.testing.assert_array_equal(pipe.batch_at(s)["x"], ids + 1)
        seen.append(ids)
    seen = np.concatenate(seen)
    assert len(seen) == 2 * len(kept)
    np.testing.assert_array_equal(np.sort(seen[: len(kept)]), sorted(kept))


def test_iterator_equals_batch_at(tmp_path):
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=False)
    assert_iterator_gives_batch_at(pipe)


def test_worker_processes_give_the_same_batches(tmp_path):
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=False)
    with pipe.iterator(num_workers=2) as it:
        assert it.wait_for_workers(60), "workers did not start"
        got = [{k: np.array(v) for k, v in b.items()} for b in it]  # copies: slots are lent
    with pipe.iterator(num_workers=0) as it:
        want = list(it)
    assert len(got) == len(want) == pipe.num_steps
    for s, (g, w) in enumerate(zip(got, want)):
        assert_batches_equal(g, w, f"step {s}")


def test_host_slices_concatenate_to_the_global_batch(tmp_path):
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=False)
    for s in [0, 1, 33, pipe.num_steps - 1]:  # the last one is partial (6 rows)
        parts = [pipe.batch_at(s, h, 2)["x"] for h in range(2)]
        np.testing.assert_array_equal(np.concatenate(parts), pipe.batch_at(s)["x"])
        ids = [i for h in range(2) for [(_, i)] in pipe.explain(s, h, 2)]
        assert ids == [i for [(_, i)] in pipe.explain(s)]


def test_explain_of_a_host_with_no_rows_in_the_last_batch(tmp_path):
    """2 x 333 survivors, batch 12: the last batch has 6 rows, so of 4 hosts (3 rows each)
    hosts 2 and 3 have none there. batch_at gives them an empty slice; explain must give []."""
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=12, drop_remainder=False)
    s = pipe.num_steps - 1
    assert len(pipe.batch_at(s)["x"]) == 6
    parts = [pipe.batch_at(s, h, 4)["x"] for h in range(4)]
    assert [len(p) for p in parts] == [3, 3, 0, 0]
    np.testing.assert_array_equal(np.concatenate(parts), pipe.batch_at(s)["x"])
    rows = [pipe.explain(s, h, 4) for h in range(4)]
    assert rows[2] == rows[3] == []
    assert rows[0] + rows[1] == pipe.explain(s)


def test_resume_mid_epoch_gives_the_remaining_batches(tmp_path):
    pipe = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=False)
    with pipe.iterator() as it:
        for _ in range(20):  # 200 of 333 survivors: mid-epoch
            next(it)
        state = json.loads(json.dumps(it.state()))
        rest = list(it)
    assert state["step"] == 20
    again = _pipe(tmp_path, seed=5, num_epochs=2, batch=10, drop_remainder=False)  # rebuilt: from the cache
    with again.resume(state) as it:
        resumed = list(it)
    assert len(resumed) == len(rest) == again.num_steps - 20
    for s, (g, w) in enumerate(zip(resumed, rest), 20):
        assert_batches_equal(g, w, f"step {s}")
    other = _src(N, 5, 2).shuffle().map(plus_one).filter(even, cache_dir=tmp_path).batch(10, drop_remainder=False)
    with pytest.raises(ValueError, match="fingerprint"):
        other.resume(state)


# --------------------------------------------------------------------------- 3. the cache


def test_second_construction_reads_the_cache_not_the_predicate(tmp_path):
    CALLS.n = 0
    first = _src().map(plus_one).filter(counting_div3, cache_dir=tmp_path)
    assert CALLS.n == N  # built in this process (N < PROCESS_MIN): one call per record
    files = _cache_files(tmp_path)
    assert len(files) == 1
    second = _src().map(plus_one).filter(counting_div3, cache_dir=tmp_path)
    assert CALLS.n == N  # not called again
    np.testing.assert_array_equal(first.survivors, _kept_plus_one_div3())
    np.testing.assert_array_equal(second.survivors, _kept_plus_one_div3())
    assert _cache_files(tmp_path) == files


def test_cache_dir_defaults_to_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("QUERN_CACHE_DIR", str(tmp_path / "env"))
    pipe = _src().filter(div3)
    files = _cache_files(tmp_path / "env")
    assert len(files) == 1
    assert os.path.samefile(pipe.survivors.filename, files[0])


def test_survivors_are_a_read_only_int64_memmap_of_the_cache_file(tmp_path):
    pipe = _src().map(plus_one).filter(div3, cache_dir=tmp_path)
    [path] = _cache_files(tmp_path)
    ids = pipe.survivors
    assert isinstance(ids, np.memmap)
    assert ids.dtype == np.int64
    assert not ids.flags.writeable
    with pytest.raises(ValueError):
        ids[0] = 1
    assert os.path.samefile(ids.filename, path)
    assert path.stat().st_size == 128 + 8 * len(_kept_plus_one_div3())  # 8 bytes per survivor
    np.testing.assert_array_equal(ids, _kept_plus_one_div3())


def test_other_predicates_use_other_files(tmp_path):
    def keep_multiples(k):
        return lambda rec: rec["x"] % k == 0

    ids = np.arange(N)
    three = _src().filter(keep_multiples(3), cache_dir=tmp_path)
    five = _src().filter(keep_multiples(5), cache_dir=tmp_path)  # same code, another closure value
    assert len(_cache_files(tmp_path)) == 2
    ones = _src().filter(lambda rec: rec["x"] % 3 == 1, cache_dir=tmp_path)  # other code
    assert len(_cache_files(tmp_path)) == 3
    np.testing.assert_array_equal(three.survivors, ids[ids % 3 == 0])
    np.testing.assert_array_equal(five.survivors, ids[ids % 5 == 0])
    np.testing.assert_array_equal(ones.survivors, ids[ids % 3 == 1])
    mapped = _src().map(plus_one).filter(keep_multiples(3), cache_dir=tmp_path)  # another transform before it
    assert len(_cache_files(tmp_path)) == 4
    np.testing.assert_array_equal(mapped.survivors, _kept_plus_one_div3())


def test_the_cache_follows_the_data(tmp_path):
    """Same shape, same predicate, other contents: another key, and the right survivors."""
    ids = np.arange(N)
    one = _src().filter(div3, cache_dir=tmp_path)
    shifted = quern.Pipeline.from_source({"x": np.arange(N, dtype=np.int64) + 1}).filter(div3, cache_dir=tmp_path)
    assert len(_cache_files(tmp_path)) == 2
    np.testing.assert_array_equal(one.survivors, ids[ids % 3 == 0])
    np.testing.assert_array_equal(shifted.survivors, ids[(ids + 1) % 3 == 0])


def _flip_id_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)  # the low bit of the last id: 998 -> 999, still sorted and in range
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _flip_count(path):
    with open(path, "r+b") as f:
        f.seek(8)  # the survivor count M
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 8)


def _garbage(path):
    path.write_bytes(b"not a survivors file at all, but long enough to hold a header....." * 4)


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_flip_id_byte, _flip_count, _truncate, _garbage, _empty])
def test_a_damaged_cache_file_is_detected_and_rebuilt(tmp_path, damage, capfd):
    CALLS.n = 0
    pipe = _src().map(plus_one).filter(counting_div3, cache_dir=tmp_path)
    assert CALLS.n == N
    [path] = _cache_files(tmp_path)
    del pipe  # drop the memory map before damaging its file in place
    gc.collect()
    damage(path)
    assert sv.load(str(path), N)[0] is None
    CALLS.n = 0
    rebuilt = _src().map(plus_one).filter(counting_div3, cache_dir=tmp_path)
    assert CALLS.n == N  # scanned again
    np.testing.assert_array_equal(rebuilt.survivors, _kept_plus_one_div3())
    ids, why = sv.load(str(path), N)
    assert why == "verified"
    np.testing.assert_array_equal(ids, _kept_plus_one_div3())
    assert "not usable" in capfd.readouterr().err  # and said so


def test_survivors_file_format(tmp_path):
    """The documented layout, parsed here with struct and hashlib."""
    ids = np.asarray([3, 7, 8, 900], dtype=np.int64)
    path = tmp_path / "f.survivors"
    sv.store(str(path), ids, 1000)
    raw = path.read_bytes()
    magic, m, n, digest, key, pad = struct.unpack("<8sQQ32s32s40s", raw[:128])
    assert (magic, m, n, key, pad) == (b"QUERNSV2", 4, 1000, b"f".ljust(32, b"\0"), bytes(40))
    assert raw[128:] == ids.astype("<i8").tobytes()
    assert digest == hashlib.sha256(key + raw[128:]).digest()
    got, why = sv.load(str(path), 1000)
    assert why == "verified" and got.tolist() == [3, 7, 8, 900]
    assert sv.load(str(path), 999)[0] is None  # made for another candidate count


@pytest.mark.parametrize("bad", [[3, 3, 8], [8, 3, 9], [-1, 3], [3, 1000]])
def test_load_refuses_ids_out_of_order_or_range_even_with_a_good_checksum(tmp_path, bad):
    body = np.asarray(bad, dtype="<i8").tobytes()
    path = tmp_path / "f.survivors"
    key = b"f".ljust(32, b"\0")
    head = struct.pack("<8sQQ32s32s40x", b"QUERNSV2", len(bad), 1000, hashlib.sha256(key + body).digest(), key)
    path.write_bytes(head + body)
    ids, why = sv.load(str(path), 1000)
    assert ids is None and "strictly increasing" in why


_BUILDER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import quern
    cache, sync, me, other = sys.argv[1:5]
    open(os.path.join(sync, me), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(sync, other)) and time.monotonic() < deadline:
        time.sleep(0.002)

    def keep(rec):
        return rec["x"] % 7 == 3

    pipe = quern.Pipeline.from_source({"x": np.arange(30000)}).filter(keep, cache_dir=cache, num_workers=1)
    print(len(pipe.survivors), int(np.asarray(pipe.survivors).sum()))
    """
)


def test_concurrent_builders_both_succeed_and_the_file_verifies(tmp_path):
    cache, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, str(cache), str(sync), me, other],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for me, other in [("a", "b"), ("b", "a")]
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=100)
            assert p.returncode == 0, err
            outs.append(out.split())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ids = np.arange(30000)
    want = ids[ids % 7 == 3]
    assert outs == [[str(len(want)), str(int(want.sum()))]] * 2
    [path] = _cache_files(cache)
    assert sorted(os.listdir(cache / "filters")) == [path.name]  # no temporary file left behind
    got, why = sv.load(str(path), 30000)
    assert why == "verified"
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- 4. errors


def test_a_filter_that_keeps_nothing_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="keeps none of the 1000 records"):
        _src().filter(lambda rec: rec["x"] < 0, cache_dir=tmp_path)
    assert _cache_files(tmp_path) == []


@pytest.mark.parametrize("bad", [None, 1, np.array([True]), "yes"])
def test_a_predicate_returning_a_non_bool_is_a_scan_error(tmp_path, bad):
    def pred(rec):
        return bad if rec["x"] == 7 else True

    with pytest.raises(quern.ScanError) as e:
        _src().filter(pred, cache_dir=tmp_path)
    msg = str(e.value)
    assert "record 7" in msg and "'arrays'" in msg and "True or False" in msg
    assert _cache_files(tmp_path) == []


def test_a_predicate_that_raises_is_a_scan_error_with_its_cause(tmp_path):
    def pred(rec):
        if rec["x"] == 123:
            raise ZeroDivisionError("boom")
        return True

    with pytest.raises(quern.ScanError) as e:
        _src().map(plus_one).filter(pred, cache_dir=tmp_path)
    msg = str(e.value)
    assert "record 122" in msg and "'arrays'" in msg and "boom" in msg  # x + 1 == 123 is record 122
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_an_error_in_a_transform_before_the_filter_is_a_scan_error(tmp_path):
    def boom(rec):
        if rec["x"] == 77:
            raise RuntimeError("bad map")
        return rec

    with pytest.raises(quern.ScanError) as e:
        _src().map(boom).filter(div3, cache_dir=tmp_path)
    msg = str(e.value)
    assert "record 77" in msg and "'arrays'" in msg and "bad map" in msg
    assert isinstance(e.value.__cause__, RuntimeError)


class BadKeepMany:
    def __init__(self, kind):
        self.kind = kind

    def __call__(self, rec):
        return True

    def keep_many(self, records):
        if self.kind == "ints":
            return np.ones(len(records), dtype=np.int64)
        return np.ones(len(records) - 1, dtype=bool)


@pytest.mark.parametrize("kind", ["ints", "short"])
def test_keep_many_must_return_one_bool_per_record(tmp_path, kind):
    with pytest.raises(quern.ScanError, match="keep_many returned"):
        _src().filter(BadKeepMany(kind), cache_dir=tmp_path)


def test_filter_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match=r"filter\(\) after batch\(\)"):
        _src().batch(10).filter(div3, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="random_map"):
        _src().random_map(jitter).filter(div3, cache_dir=tmp_path)
    mixed = quern.mix({"a": _src(), "b": _src(seed=1)}, weights=[1, 1])
    with pytest.raises(ValueError, match="mixture"):
        mixed.filter(div3, cache_dir=tmp_path)
    with pytest.raises(TypeError, match="callable"):
        _src().filter("x > 3", cache_dir=tmp_path)
    assert not (tmp_path / "filters").exists()  # nothing was scanned


# --------------------------------------------------------------------------- 5. two filters


def test_two_filters_keep_the_records_passing_both(tmp_path):
    CALLS.n = 0
    pipe = (
        _src(num_epochs=1)
        .shuffle()
        .filter(even, cache_dir=tmp_path)
        .map(plus_one)
        .filter(counting_div3, cache_dir=tmp_path)
        .batch(16, drop_remainder=False)
    )
    ids = np.arange(N)
    want = ids[(ids % 2 == 0) & ((ids + 1) % 3 == 0)]  # the second predicate sees x + 1
    assert CALLS.n == N // 2  # the second scan only reads the first filter's survivors
    np.testing.assert_array_equal(pipe.survivors, want)
    xs = _stream(pipe)
    np.testing.assert_array_equal(np.sort(xs), want + 1)
    got = np.concatenate([[i for [(_, i)] in pipe.explain(s)] for s in range(pipe.num_steps)])
    np.testing.assert_array_equal(got + 1, xs)


# --------------------------------------------------------------------------- 6. keep_many


def test_keep_many_is_called_per_chunk(tmp_path):
    CALLS.chunks = []
    n = 10_000
    pipe = _src(n).filter(KeepMany(), cache_dir=tmp_path)
    k = scan.CHUNK
    assert CALLS.chunks == [k] * (n // k) + [n % k]
    ids = np.arange(n)
    np.testing.assert_array_equal(pipe.survivors, ids[ids % 4 == 1])


# --------------------------------------------------------------------------- 7. the scan in processes


def test_the_scan_in_processes_equals_the_scan_in_this_process(tmp_path, monkeypatch):
    n = 5000
    spawned = spy_scan_processes(monkeypatch)
    CALLS.n = 0
    here = _src(n).map(plus_one).filter(mod7_is_3, cache_dir=tmp_path / "here", num_workers=1)
    assert CALLS.n == n and spawned == []
    CALLS.n = 0
    there = _src(n).map(plus_one).filter(mod7_is_3, cache_dir=tmp_path / "there", num_workers=2)
    assert spawned == [2]
    assert CALLS.n == 0  # the predicate ran in the scan processes only
    ids = np.arange(n)
    want = ids[(ids + 1) % 7 == 3]
    np.testing.assert_array_equal(here.survivors, want)
    np.testing.assert_array_equal(there.survivors, want)
    [path] = _cache_files(tmp_path / "there")
    assert sv.load(str(path), n)[1] == "verified"


def test_a_failure_in_a_scan_process_is_a_scan_error_naming_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(scan, "PROCESS_MIN", 1000)
    with pytest.raises(quern.ScanError, match=r"record 4321 of source 'arrays'.*no such thing"):
        _src(5000).filter(fails_on_4321, cache_dir=tmp_path, num_workers=2)
    assert _cache_files(tmp_path) == []
