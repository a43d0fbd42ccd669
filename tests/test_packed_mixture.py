"""Tests of pipeline/streams/mixture.py and pipeline/streams/packed.py.

Mixtures of packed components: rows of a component, mixed by weight (issue 12, point 7).

Document ``i`` of a component holds ``n_i`` copies of ``base + i``, so every token
names its component and document; expectations come from the components alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import quern

pytestmark = pytest.mark.timeout(120)


class Docs:
    def __init__(self, base, n):
        self.base, self.n = base, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": np.full(int((i * 7919) % 97 + 1), self.base + i, dtype=np.int32)}

    def identity(self):
        return {"type": "PackedMixDocs", "base": self.base, "n": self.n}


def _parts(tmp_path):
    a = quern.Pipeline.from_source(Docs(0, 300), seed=0).shuffle().pack(128, key="tokens", cache_dir=tmp_path)
    b = quern.Pipeline.from_source(Docs(10_000, 50), seed=1).shuffle()
    b = b.pack(128, mode="concat", key="tokens", cache_dir=tmp_path)
    return a, b


def test_rows_are_the_components_rows_mixed_by_weight(tmp_path):
    a, b = _parts(tmp_path)
    pipe = quern.mix({"a": a, "b": b}, weights=[0.7, 0.3], seed=2).batch(16)
    counts = [0, 0]
    for s in range(64):  # 1,024 rows: one block, exact counts
        batch = pipe.batch_at(s)
        seg = pipe.segments(pipe.positions(s))
        for r in range(16):
            c, pos = int(seg.component[r]), int(seg.positions[r])
            own = (a, b)[c].batch(1).batch_at(pos)
            for key in ("tokens", "segment_ids", "positions"):
                assert np.array_equal(own[key][0], batch[key][r]), (s, r, key)
            counts[c] += 1
    assert counts == [717, 307]  # floor(0.3 * 1024) = 307 for 'b', the rest for 'a'


def test_explain_lists_every_document_of_a_packed_row(tmp_path):
    a, b = _parts(tmp_path)
    pipe = quern.mix({"a": a, "b": b}, weights=[0.5, 0.5], seed=2).batch(8)
    for s in range(4):
        batch = pipe.batch_at(s)
        for r, row in enumerate(pipe.explain(s)):
            tokens, seg = batch["tokens"][r], batch["segment_ids"][r]
            docs = [int(tokens[seg == k][0]) for k in range(1, int(seg.max()) + 1)]
            names = ["a" if d < 10_000 else "b" for d in docs]
            ids = [d if d < 10_000 else d - 10_000 for d in docs]
            assert row == list(zip(names, ids)), (s, r)


def test_workers_hosts_and_resume_give_the_same_rows(tmp_path):
    a, b = _parts(tmp_path)
    pipe = quern.mix({"a": a, "b": b}, weights=[0.6, 0.4], seed=2).batch(8)
    want = [pipe.batch_at(s)["tokens"] for s in range(8)]
    with pipe.iterator(num_workers=2) as it:
        got = [next(it)["tokens"] for _ in range(4)]
        state = it.state()
    with pipe.resume(state) as it:
        got += [next(it)["tokens"] for _ in range(4)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    parts = [pipe.batch_at(3, h, 2)["tokens"] for h in range(2)]
    assert np.array_equal(np.concatenate(parts), want[3])


def test_packed_and_unpacked_components_do_not_mix(tmp_path):
    a, _ = _parts(tmp_path)
    plain = quern.Pipeline.from_source({"tokens": np.zeros((10, 128), np.int32)}, seed=1).shuffle()
    pipe = quern.mix({"a": a, "plain": plain}, weights=[0.5, 0.5], seed=2).batch(16)
    with pytest.raises(quern.StepError, match="components '(a|plain)' and '(a|plain)' give records of different"):
        pipe.batch_at(0)
