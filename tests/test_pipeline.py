"""Tests of pipeline/dataset.py.

Pipeline: coverage, batch_at == iterator, host slices, explain, randomness, errors, resume."""

import json
import pickle
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern
from quern.pipeline.order import index


def _arrays(n=1000):
    return {"id": np.arange(n, dtype=np.int64), "x": np.arange(n, dtype=np.float32)[:, None] * np.ones(3, np.float32)}


def add_one(rec):
    return {**rec, "x": rec["x"] + 1}


def noisy(rec, rng):
    return {**rec, "noise": rng.random(2)}


def _pipe(n=1000, batch=64, seed=0, num_epochs=None, drop_remainder=True):
    p = quern.Pipeline.from_source(quern.sources.ArraySource(_arrays(n)), seed=seed, num_epochs=num_epochs)
    return p.shuffle().map(add_one).random_map(noisy).batch(batch, drop_remainder=drop_remainder)


@pytest.mark.parametrize("batch", [100, 64, 300, 7, 1000, 1500])
def test_one_epoch_covers_every_record_exactly_once(batch):
    n = 1000
    pipe = quern.Pipeline.from_source(_arrays(n), seed=3, num_epochs=1).shuffle().batch(batch, drop_remainder=False)
    ids = np.concatenate([pipe.batch_at(s)["id"] for s in range(pipe.num_steps)])
    assert np.array_equal(np.sort(ids), np.arange(n))
    assert not np.array_equal(ids, np.arange(n))  # it was shuffled


@pytest.mark.parametrize("batch", [64, 300])
def test_endless_stream_covers_each_epoch_once_and_batches_cross_epochs(batch):
    n = 1000
    pipe = quern.Pipeline.from_source(_arrays(n), seed=3).shuffle().batch(batch)
    steps = -(-3 * n // batch)
    stream = np.concatenate([pipe.batch_at(s)["id"] for s in range(steps)])
    for e in range(3):
        assert np.array_equal(np.sort(stream[e * n : (e + 1) * n]), np.arange(n))
    assert not np.array_equal(stream[:n], stream[n : 2 * n])


def test_drop_remainder_drops_only_the_last_partial_batch():
    pipe = quern.Pipeline.from_source(_arrays(1000), num_epochs=1).batch(300)
    assert pipe.num_steps == 3
    with pytest.raises(IndexError, match="step 3 is past the end"):
        pipe.batch_at(3)
    keep = quern.Pipeline.from_source(_arrays(1000), num_epochs=1).batch(300, drop_remainder=False)
    assert keep.num_steps == 4 and len(keep.batch_at(3)["id"]) == 100


@pytest.mark.parametrize("start", [0, 1, 5, 17])
@pytest.mark.parametrize("threads,prefetch,read_ahead", [(1, 1, 1), (1, 2, 8), (2, 3, 3)])
def test_iterator_equals_batch_at(start, threads, prefetch, read_ahead):
    pipe = _pipe()
    with pipe.iterator(start_step=start, num_threads=threads, prefetch=prefetch, read_ahead=read_ahead) as it:
        for s in range(start, start + 20):
            assert it.step == s
            assert_batches_equal(next(it), pipe.batch_at(s))


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_host_slices_concatenate_to_the_global_batch(hosts):
    pipe = _pipe(batch=64)
    for step in (0, 3, 40):
        whole = pipe.batch_at(step)
        parts = [pipe.batch_at(step, h, hosts) for h in range(hosts)]
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
        # and the iterator of each host yields its slice
        for h in range(hosts):
            with pipe.iterator(start_step=step, process_index=h, process_count=hosts) as it:
                assert_batches_equal(next(it), parts[h])


def test_partial_last_batch_is_split_by_host_rows():
    pipe = quern.Pipeline.from_source(_arrays(100), num_epochs=1).batch(64, drop_remainder=False)
    parts = [pipe.batch_at(1, h, 4)["id"] for h in range(4)]
    assert [len(p) for p in parts] == [16, 16, 4, 0]
    assert np.array_equal(np.concatenate(parts), pipe.batch_at(1)["id"])


def test_explain_names_the_records_in_each_row():
    pipe = _pipe()
    for step, h, hosts in [(0, 0, 1), (9, 1, 2), (123, 3, 4)]:
        batch = pipe.batch_at(step, h, hosts)
        rows = pipe.explain(step, h, hosts)
        assert all(len(r) == 1 and r[0][0] == "arrays" for r in rows)
        assert [r[0][1] for r in rows] == batch["id"].tolist()
        np.testing.assert_array_equal(batch["x"][:, 0], batch["id"] + 1)


def test_random_map_depends_on_position_only():
    pipe = _pipe()
    whole = pipe.batch_at(5)
    # same numbers whether computed as one host or as two
    halves = np.concatenate([pipe.batch_at(5, h, 2)["noise"] for h in range(2)])
    np.testing.assert_array_equal(whole["noise"], halves)
    # different positions get different numbers
    assert len(np.unique(whole["noise"][:, 0])) == len(whole["noise"])
    # the same record in another epoch (another position) gets different numbers
    n, b = 1000, 64
    first = {int(i): r for i, r in zip(whole["id"], whole["noise"])}
    later = pipe.batch_at(5 + n // b * 3)  # some step in a later epoch
    common = [k for k, i in enumerate(later["id"]) if int(i) in first]
    assert common and all(not np.array_equal(later["noise"][k], first[int(later["id"][k])]) for k in common)
    # and a different seed changes them
    assert not np.array_equal(_pipe(seed=1).batch_at(5)["noise"], whole["noise"])


def test_random_map_batch_keys_are_per_row_and_host_independent():
    seen = []

    def jitter(batch, keys):
        seen.append(keys)
        return {**batch, "u": quern.transforms.random.uniform(keys, (3,))}

    pipe = quern.Pipeline.from_source(_arrays(), seed=4).shuffle().batch(32).random_map_batch(jitter)
    whole = pipe.batch_at(2)["u"]
    parts = np.concatenate([pipe.batch_at(2, h, 4)["u"] for h in range(4)])
    np.testing.assert_array_equal(whole, parts)
    assert whole.shape == (32, 3) and len(np.unique(seen[0])) == 32


class HugeSource:
    """10**12 records, each its own index; never materialised."""

    def __len__(self):
        return 10**12

    def __getitem__(self, i):
        return np.int64(i)


def test_huge_source_batch_at_allocates_nothing_of_size_n():
    pipe = quern.Pipeline.from_source(HugeSource(), seed=1).shuffle().batch(256)
    tracemalloc.start()
    batch = pipe.batch_at(10**9)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 20 * 2**20  # bytes; N int64s would be 8 TB
    assert batch.shape == (256,) and len(np.unique(batch)) == 256
    assert [r[0][1] for r in pipe.explain(10**9)] == batch.tolist()


def test_fingerprint_is_stable_across_interpreters_and_sensitive_to_the_definition():
    code = (
        "import numpy as np, quern;"
        "p = quern.Pipeline.from_source({'a': np.arange(50)}, seed=7).shuffle()"
        ".map(quern.transforms.pad(8, key='a')).batch(10); print(p.fingerprint())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    base = quern.Pipeline.from_source({"a": np.arange(50)}, seed=7).shuffle()
    here = base.map(quern.transforms.pad(8, key="a")).batch(10)
    assert out.stdout.strip() == here.fingerprint()
    variants = [
        quern.Pipeline.from_source({"a": np.arange(50)}, seed=8)
        .shuffle()
        .map(quern.transforms.pad(8, key="a"))
        .batch(10),
        base.map(quern.transforms.pad(9, key="a")).batch(10),
        base.map(quern.transforms.pad(8, key="a")).batch(5),
        quern.Pipeline.from_source({"a": np.arange(1, 51)}, seed=7)
        .shuffle()
        .map(quern.transforms.pad(8, key="a"))
        .batch(10),
        quern.Pipeline.from_source({"a": np.arange(50)}, seed=7).map(quern.transforms.pad(8, key="a")).batch(10),
    ]
    assert len({v.fingerprint() for v in variants} | {here.fingerprint()}) == len(variants) + 1


def test_state_is_json_and_resume_is_exact():
    pipe = _pipe()
    with pipe.iterator(start_step=3) as it:
        for _ in range(4):
            next(it)
        state = json.loads(json.dumps(it.state()))
        expected = [next(it) for _ in range(3)]
    assert state["step"] == 7
    for k, want in enumerate(expected):
        assert_batches_equal(want, pipe.batch_at(7 + k))
    with pipe.resume(state) as it2:
        for want in expected:
            assert_batches_equal(next(it2), want)


def test_resume_refuses_a_changed_pipeline_unless_forced():
    state = {"step": 2, "fingerprint": _pipe(seed=0).fingerprint()}
    other = _pipe(seed=1)
    with pytest.raises(ValueError, match="fingerprint"):
        other.resume(state)
    with other.resume(state, force=True) as it:
        assert it.step == 2
    with pytest.raises(ValueError, match="'step'"):
        other.resume({"fingerprint": "x"})


def test_batches_at_equals_batch_at_step_by_step():
    pipe = quern.Pipeline.from_source(_arrays(100), num_epochs=1).shuffle().map(add_one).batch(24, drop_remainder=False)
    for h, hosts in [(0, 1), (3, 4)]:
        many = pipe.batches_at(1, 4, h, hosts)  # steps 1..4; step 4 is partial, host 3 has no rows in it
        for s, got in zip(range(1, 5), many):
            assert_batches_equal(got, pipe.batch_at(s, h, hosts))
    with pytest.raises(IndexError, match="step 5 is past the end"):
        pipe.batches_at(3, 3)


def _prefetch_threads():
    return {t for t in threading.enumerate() if t.name.startswith("quern-prefetch")}


def test_iterator_stops_at_the_end_and_closes_its_threads():
    pipe = quern.Pipeline.from_source(_arrays(100), num_epochs=2).shuffle().batch(30)
    before = _prefetch_threads()
    with pipe.iterator(num_threads=2) as it:
        got = [next(it)["id"]]
        ours = _prefetch_threads() - before
        assert ours  # the iterator's own threads, which closing must stop
        got += [b["id"] for b in it]
    assert len(got) == 6 and it.step == 6
    assert sorted(np.concatenate(got)[:100].tolist()) == list(range(100))
    assert not [t for t in ours if t.is_alive()]
    it2 = pipe.iterator(start_step=6)
    with pytest.raises(StopIteration):
        next(it2)
    it2.close()
    with pytest.raises(IndexError, match="past the end"):
        pipe.iterator(start_step=7)


def test_garbage_collected_iterator_stops_its_threads():
    import gc

    before = _prefetch_threads()
    it = _pipe().iterator(num_threads=2)
    next(it)
    ours = _prefetch_threads() - before
    assert ours  # the threads that collecting the iterator must stop
    del it
    gc.collect()
    for t in ours:
        t.join(timeout=10)
    assert not [t for t in ours if t.is_alive()]


def _fail_on_13(rec):
    if int(rec["id"]) == 13:
        raise ValueError("bad record")
    return rec


def test_a_failing_transform_names_step_stage_and_record():
    pipe = quern.Pipeline.from_source(_arrays(100)).map(_fail_on_13).batch(10)
    with pytest.raises(
        quern.StepError, match=r"step 1 .*map\[0\] _fail_on_13.*record 13 of source 'arrays'.*bad record"
    ):
        pipe.batch_at(1)
    it = pipe.iterator()
    next(it)
    with pytest.raises(quern.StepError, match="step 1"):
        next(it)
    assert it.step == 1  # nothing was skipped
    with pytest.raises(quern.StepError, match="step 1"):
        next(it)  # the step is retried, not skipped
    it.close()


def test_pickled_pipeline_gives_the_same_batches():
    pipe = _pipe()
    clone = pickle.loads(pickle.dumps(pipe))
    assert_batches_equal(clone.batch_at(11), pipe.batch_at(11))
    assert clone.fingerprint() == pipe.fingerprint()


def test_pipeline_is_immutable():
    base = quern.Pipeline.from_source(_arrays(10))
    shuffled = base.shuffle()
    assert base.stream.shuffle_mode is None and shuffled.stream.shuffle_mode == "global"
    with pytest.raises(AttributeError, match="seed"):  # dataclasses.FrozenInstanceError is one
        base.seed = 3
    assert base.seed == 0
    mapped = shuffled.map(add_one)  # a new pipeline; shuffled still has no map
    plain, plus_one = shuffled.batch(10).batch_at(0), mapped.batch(10).batch_at(0)
    np.testing.assert_array_equal(plain["x"][:, 0], plain["id"])
    np.testing.assert_array_equal(plus_one["x"][:, 0], plus_one["id"] + 1)


def test_block_shuffle_pipeline_covers_every_record():
    pipe = quern.Pipeline.from_source(_arrays(1000), seed=2, num_epochs=1).shuffle("block", block_size=50, window=3)
    ids = np.concatenate([pipe.batch(100).batch_at(s)["id"] for s in range(10)])
    assert np.array_equal(np.sort(ids), np.arange(1000))
    assert not np.array_equal(ids, np.arange(1000))  # shuffled...
    for g in range(1000 // 150):  # ...but each window of 3 * 50 positions reads exactly 3 blocks of 50 records
        assert len(np.unique(ids[g * 150 : (g + 1) * 150] // 50)) == 3


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda p: p.batch(0), ValueError, "global_batch_size must be >= 1"),
        (lambda p: p.batch(2.5), TypeError, "global_batch_size must be an integer"),
        (lambda p: p.batch(64).batch(64), ValueError, "already called"),
        (lambda p: p.map_batch(len), ValueError, "needs batch"),
        (lambda p: p.batch(8).random_map(noisy), ValueError, "random_map_batch"),
        (lambda p: p.map(add_one).shuffle(), ValueError, "shuffle"),
        (lambda p: p.shuffle("rows"), ValueError, "'global' or 'block'"),
        (lambda p: p.map(3), TypeError, "callable"),
        (lambda p: p.batch(64).batch_at(-1), ValueError, "step must be >= 0"),
        (lambda p: p.batch(64).batch_at(0, 0, 3), ValueError, "not divisible by the host count \\(process_count\\) 3"),
        (lambda p: p.batch(64).iterator(num_workers=-1), ValueError, "num_workers must be >= 0"),
        (lambda p: p.batch(64).iterator(num_workers=2, num_threads=2), ValueError, "num_threads=2 applies"),
        (lambda p: p.batch(64).iterator(process_count=3), ValueError, "not divisible"),
    ],
)
def test_bad_arguments_get_clear_errors(build, error, match):
    with pytest.raises(error, match=match):
        build(quern.Pipeline.from_source(_arrays(100)))


def test_dataset_smaller_than_a_batch():
    with pytest.raises(ValueError, match="fewer than one batch of 256"):
        quern.Pipeline.from_source(_arrays(100), num_epochs=1).batch(256)
    # endless streams simply wrap around
    batch = quern.Pipeline.from_source(_arrays(100)).shuffle().batch(256).batch_at(0)["id"]
    assert np.array_equal(np.bincount(batch[:200], minlength=100), np.full(100, 2))
    with pytest.raises(ValueError, match="empty"):
        quern.Pipeline.from_source({"a": np.zeros((0, 3))})
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\), got -5"):
        quern.Pipeline.from_source(_arrays(10), seed=-5)
    with pytest.raises(TypeError, match="seed must be an integer"):
        quern.Pipeline.from_source(_arrays(10), seed=1.5)


def test_map_after_batch_is_refused_with_a_pointer_to_map_batch():
    batched = quern.Pipeline.from_source(_arrays(20)).batch(5)
    with pytest.raises(ValueError, match=r"\bmap_batch"):  # map_batch itself, not only random_map_batch
        batched.map(lambda b: {"n": b["id"].sum()})
    with pytest.raises(ValueError, match="random_map_batch"):
        batched.random_map(noisy)
    # what the message points to does the job: a batch-level transform
    pipe = batched.map_batch(lambda b: {"n": b["id"].sum()})
    assert int(pipe.batch_at(1)["n"]) == 5 + 6 + 7 + 8 + 9


def test_grain_style_source_with_getitems():
    calls = []

    class Src:
        def __len__(self):
            return 50

        def __getitem__(self, i):
            raise AssertionError("__getitems__ should be used")

        def __getitems__(self, ids):
            calls.append(list(ids))
            return [np.int64(i * 10) for i in ids]

    pipe = quern.Pipeline.from_source(Src(), seed=1).shuffle().batch(10)
    out = pipe.batch_at(2)
    assert len(calls) == 1 and out.tolist() == [i * 10 for i in calls[0]]
    assert [r[0][1] for r in pipe.explain(2)] == calls[0]


def test_batch_records_are_the_index_modules_function_of_positions():
    # the records of a batch are exactly the index module's function of the step's positions
    pipe = _pipe()
    pos = pipe.positions(7)
    assert pos.tolist() == list(range(7 * 64, 8 * 64))
    want = index.epoch_record_ids(pos, 1000, 0, "global")
    np.testing.assert_array_equal(pipe.record_ids(pos), want)
    np.testing.assert_array_equal(pipe.batch_at(7)["id"], want)


def _fail_at_position_50(rec):
    if int(rec["id"]) == 50:
        raise ValueError("bad record 50")
    return rec


@pytest.mark.parametrize("read_ahead,prefetch", [(8, 1), (16, 2), (1, 3)])
def test_iterator_error_surfaces_at_exactly_its_step(read_ahead, prefetch):
    pipe = quern.Pipeline.from_source(_arrays(200)).map(_fail_at_position_50).batch(10)  # unshuffled: step 5
    with pipe.iterator(read_ahead=read_ahead, prefetch=prefetch) as it:
        for s in range(5):
            assert_batches_equal(next(it), pipe.batch_at(s))
        for _ in range(2):  # and again on retry: nothing skipped, nothing raised early
            with pytest.raises(quern.StepError, match=r"^step 5 .*record 50"):
                next(it)
            assert it.step == 5


SCALE = 2.0


def scaled(batch):
    return {"x": batch["x"] * SCALE}


def test_fingerprint_sees_code_and_the_globals_it_reads(monkeypatch):
    base = quern.Pipeline.from_source({"x": np.arange(10.0)}).batch(2)
    sqrt = base.map_batch(lambda b: {"x": np.sqrt(b["x"])})
    exp = base.map_batch(lambda b: {"x": np.exp(b["x"])})
    assert sqrt.fingerprint() != exp.fingerprint()
    before = base.map_batch(scaled).fingerprint()
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    assert base.map_batch(scaled).fingerprint() != before


def test_small_source_with_a_large_batch_covers_every_epoch():
    pipe = quern.Pipeline.from_source(np.arange(3), seed=1).shuffle().batch(3000)
    batch = pipe.batch_at(7)
    assert np.array_equal(np.bincount(batch, minlength=3), [1000, 1000, 1000])
    for e in range(0, 3000, 3):  # every epoch (3 consecutive positions) is a permutation
        assert sorted(batch[e : e + 3].tolist()) == [0, 1, 2]


def test_bare_array_source_rows_and_content_fingerprint():
    data = np.arange(100) * 10
    pipe = quern.Pipeline.from_source(data, seed=2).shuffle().batch(10)
    ids = [r[0][1] for r in pipe.explain(3)]
    np.testing.assert_array_equal(pipe.batch_at(3), data[ids])
    changed = data.copy()
    changed[50] += 1
    assert quern.Pipeline.from_source(changed, seed=2).shuffle().batch(10).fingerprint() != pipe.fingerprint()


def test_a_null_record_names_its_record_id():
    recs = [np.int64(i) for i in range(10)]
    recs[7] = None
    pipe = quern.Pipeline.from_source(recs).batch(5)
    with pytest.raises(quern.StepError, match=r"step 1 .*collate.* row 2 = record 7 .*None"):
        pipe.batch_at(1)


@pytest.mark.parametrize("args", [(0, 1.7, 2), (0, "1", 2), (0, True, 2), (0, 0, 2.0)])
def test_host_arguments_must_be_integers(args):
    with pytest.raises(TypeError, match="must be an integer"):
        _pipe().batch_at(*args)


def test_steps_beyond_the_addressable_stream_are_refused():
    with pytest.raises(IndexError, match=r"step 576460752303423488 is beyond"):
        quern.Pipeline.from_source(HugeSource()).batch(8).batch_at(2**59)


def test_collate_keeps_namedtuples():
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    batch = quern.collate([Pair(np.arange(2), 1.5), Pair(np.arange(2) + 1, 2.5)])
    assert type(batch) is Pair
    np.testing.assert_array_equal(batch.a, [[0, 1], [1, 2]])
    np.testing.assert_array_equal(batch.b, [1.5, 2.5])


def _skewed(n=2000):
    """Records whose length grows with the id: contiguous host slices of an unshuffled
    pipeline get very uneven token counts."""
    lengths = (np.arange(n) % 200 + 1).astype(np.int64)
    return {"id": np.arange(n, dtype=np.int64), "length": lengths}, lengths


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_balanced_host_slices_even_out_tokens(hosts):
    data, lengths = _skewed()
    plain = quern.Pipeline.from_source(data, seed=1).batch(64)
    balanced = plain.balance_hosts(lengths)
    assert balanced.fingerprint() != plain.fingerprint()
    for step in [0, 3, 17]:
        rows = [balanced.batch_at(step, h, hosts) for h in range(hosts)]
        assert all(len(r["id"]) == 64 // hosts for r in rows)
        # the same records as the global batch, each once
        ids = np.sort(np.concatenate([r["id"] for r in rows]))
        np.testing.assert_array_equal(ids, np.sort(plain.batch_at(step)["id"]))
        sums = [int(r["length"].sum()) for r in rows]
        assert max(sums) - min(sums) <= lengths.max()
        contiguous = [int(plain.batch_at(step, h, hosts)["length"].sum()) for h in range(hosts)]
        assert max(contiguous) - min(contiguous) > lengths.max()  # the problem it solves
        # the same on every call, and what the iterator (with workers) yields
        assert [r["id"].tolist() for r in rows] == [
            balanced.batch_at(step, h, hosts)["id"].tolist() for h in range(hosts)
        ]
    with balanced.iterator(start_step=3, process_index=1, process_count=hosts, num_workers=1) as it:
        np.testing.assert_array_equal(next(it)["id"], balanced.batch_at(3, 1, hosts)["id"])


def test_balance_hosts_checks_its_lengths():
    data, lengths = _skewed(100)
    pipe = quern.Pipeline.from_source(data).batch(10)
    with pytest.raises(ValueError, match="one integer length per record"):
        pipe.balance_hosts(lengths[:50])
    with pytest.raises(ValueError, match="one integer length per record"):
        pipe.balance_hosts(lengths.astype(np.float32))
    with pytest.raises(ValueError, match="record 3 has -1"):
        pipe.balance_hosts(np.where(np.arange(100) == 3, -1, lengths))
