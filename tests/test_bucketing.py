"""Tests of pipeline/streams/bucketed.py.

Pipeline.bucket: every step a batch from one length bucket, padded to its bound (issue 12, point 5).

Record ``i`` holds ``LEN[i]`` copies of ``i``, so every row names its record and
its true length; expectations are computed here from ``LEN``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern

pytestmark = pytest.mark.timeout(120)

N = 600
LEN = (np.arange(N) * 7919) % 300 + 1  # 1..300 tokens
BOUNDS = [64, 128, 256]
SIZES = [24, 12, 6]


class Docs:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"tokens": np.full(int(LEN[i]), i, dtype=np.int32)}

    def identity(self):
        return {"type": "BucketDocs", "n": N}


def add_one(batch):
    return {**batch, "tokens": batch["tokens"] + 1}


def _pipe(tmp_path, **kw):
    base = quern.Pipeline.from_source(Docs(), seed=4).shuffle()
    return base.bucket(kw.pop("bounds", BOUNDS), kw.pop("sizes", SIZES), key="tokens", cache_dir=tmp_path, **kw)


def _bucket_of(length):
    return min(int(np.searchsorted(BOUNDS, length, side="left")), len(BOUNDS) - 1)


def test_every_step_is_one_bucket_padded_to_its_bound(tmp_path):
    pipe = _pipe(tmp_path)
    shapes = set()
    for s in range(60):
        b = pipe.batch_at(s)
        rows, width = b["tokens"].shape
        shapes.add((rows, width))
        bucket = BOUNDS.index(width)
        assert rows == SIZES[bucket]
        ids = b["tokens"][:, 0]
        for r, i in enumerate(ids.tolist()):
            assert _bucket_of(LEN[i]) == bucket, (s, i)
            n = min(int(LEN[i]), width)  # the last bucket truncates longer records
            assert b["length"][r] == n
            assert (b["tokens"][r, :n] == i).all() and (b["tokens"][r, n:] == 0).all()
    assert shapes == {(24, 64), (12, 128), (6, 256)}  # one static shape per bucket


def test_each_bucket_goes_through_its_records_once_per_epoch(tmp_path):
    pipe = _pipe(tmp_path)
    members = [np.flatnonzero([_bucket_of(x) == b for x in LEN]) for b in range(len(BOUNDS))]
    seen: list[list[int]] = [[] for _ in BOUNDS]
    for s in range(400):
        b = pipe.batch_at(s)
        seen[BOUNDS.index(b["tokens"].shape[1])].extend(b["tokens"][:, 0].tolist())
    for k, ids in enumerate(members):
        got = seen[k][: len(ids)]
        assert len(got) == len(ids) and sorted(got) == sorted(ids.tolist()), k  # the first epoch: each once
    # steps per bucket follow records per batch: each bucket's epoch takes the same number of steps
    steps = [len(x) / size for x, size in zip(seen, SIZES)]
    want = [len(m) / size for m, size in zip(members, SIZES)]
    assert np.allclose(np.asarray(steps) / sum(steps), np.asarray(want) / sum(want), atol=0.02)


def test_the_same_for_any_worker_or_host_count_and_on_resume(tmp_path):
    pipe = _pipe(tmp_path)
    want = [pipe.batch_at(s) for s in range(12)]
    with pipe.iterator(num_workers=2) as it:
        for s in range(6):
            assert_batches_equal(next(it), want[s], f"step {s}")
        state = it.state()
    with pipe.resume(state) as it:
        for s in range(6, 12):
            assert_batches_equal(next(it), want[s], f"step {s}")
    for s in range(6):
        parts = [pipe.batch_at(s, h, 2)["tokens"] for h in range(2)]
        assert np.array_equal(np.concatenate(parts), want[s]["tokens"])
    with pytest.raises(ValueError, match="divisible"):
        next(iter(_pipe(tmp_path, sizes=[24, 12, 5]).iterator(process_index=0, process_count=2)))


def test_bucketing_pads_less_than_one_bound_for_all(tmp_path):
    pipe = _pipe(tmp_path)
    real = slots = 0
    for s in range(200):
        b = pipe.batch_at(s)
        real += int(b["length"].sum())
        slots += b["tokens"].size
    unbucketed = 1 - LEN.mean() / LEN.max()  # every record padded to the longest
    assert 1 - real / slots < unbucketed - 0.1


def test_batch_transforms_and_the_fingerprint(tmp_path):
    pipe = _pipe(tmp_path)
    shifted = pipe.map_batch(add_one)
    assert np.array_equal(shifted.batch_at(3)["tokens"], pipe.batch_at(3)["tokens"] + 1)
    assert _pipe(tmp_path).fingerprint() == pipe.fingerprint()
    assert _pipe(tmp_path, bounds=[64, 128, 300]).fingerprint() != pipe.fingerprint()
    assert _pipe(tmp_path, sizes=[24, 12, 3]).fingerprint() != pipe.fingerprint()
    assert "len<=" not in repr(pipe) and ".bucket(" in repr(pipe)


def test_bad_bucketing_is_refused(tmp_path):
    base = quern.Pipeline.from_source(Docs(), seed=4).shuffle()
    with pytest.raises(ValueError, match="increasing"):
        base.bucket([128, 64], [2, 2], key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="2 batch sizes for 3 buckets"):
        base.bucket([64, 128, 256], [2, 2], key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="boundaries"):
        base.bucket([0, 64], [2, 2], key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="endless"):
        quern.Pipeline.from_source(Docs(), num_epochs=1).bucket([64], [2], key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="bucket"):
        base.batch(4).bucket([64], [2], key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="single-source"):
        quern.mix({"a": base, "b": base}, weights=[1, 1]).bucket([64], [2], key="tokens")
    with pytest.raises(quern.ScanError, match="no key 'ids'"):
        base.bucket([64], [2], key="ids", cache_dir=tmp_path)
