"""first_fit and concat without a length index (pipeline/order/growing.py, first_fit.py GrowingPlan,
packing.py GrowingConcat, pipeline/definition/lazy_lengths.py): no pass over the data before the
first batch; the plan measures the documents it reaches, a window at a time, and caches their
lengths by chunk."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from helpers import assert_batches_equal, assert_iterator_gives_batch_at

import quern


class Counting(quern.sources.Source):
    """Documents in memory that count how many records were read."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.docs = [rng.integers(1, 999, int(k)).astype(np.int32) for k in rng.integers(1, 40, n)]
        self.name = "docs"
        self.read = 0

    def __len__(self) -> int:
        return len(self.docs)

    def read_many(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        self.read += len(ids)
        return [{"tokens": self.docs[i]} for i in ids.tolist()]

    def identity(self) -> dict:
        return {"type": "Counting", "n": len(self.docs), "first": self.docs[0].tolist()}


MODES = ["first_fit", "concat"]


def _pack(pipe, mode, **kw):
    more = {"num_bins": 4} if mode == "first_fit" else {}
    return pipe.pack(48, mode=mode, key="tokens", **more, **kw).batch(4)


def _packed(src, cache, mode="first_fit", **kw):
    return _pack(quern.Pipeline.from_source(src, seed=3, **kw).shuffle(), mode, cache_dir=cache)


@pytest.mark.parametrize("mode", MODES)
def test_the_first_batch_reads_as_many_documents_whatever_the_dataset_size(tmp_path, mode):
    counts = []
    for n in (2_000, 20_000, 200_000):
        src = Counting(n)
        pipe = _packed(src, tmp_path / f"c{n}", mode)
        assert src.read == 0  # pack() read nothing
        pipe.batch_at(0)
        counts.append(src.read)
        assert len(pipe.stream.epoch(0, 4)[1]) < 200  # the epoch's order computed only as far as the plan reached
    assert max(counts) < 200, counts  # the first window (64 documents) and the step's own: not the dataset


@pytest.mark.parametrize("mode", MODES)
def test_rows_equal_the_plan_made_from_a_whole_length_index(tmp_path, mode):
    src = Counting(3_000, seed=1)
    lazy = _packed(src, tmp_path / "c", mode, num_epochs=2)
    lengths = np.asarray([len(d) for d in src.docs])
    whole = _pack(quern.Pipeline.from_source(src, seed=3, num_epochs=2).shuffle(), mode, lengths=lengths)
    assert lazy.stream.lazy is not None and whole.stream.lazy is None
    assert lazy.fingerprint() == whole.fingerprint()  # the records are described, not how their lengths were found
    assert lazy.num_steps == whole.num_steps  # a finite stream counts its rows when asked (every document)
    for s in (0, 1, whole.num_steps // 2, whole.num_steps - 1):  # the second epoch too
        assert_batches_equal(lazy.batch_at(s), whole.batch_at(s), f"step {s}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_endless_stream_is_step_addressable_with_workers(tmp_path, num_workers, mode):
    pipe = _packed(Counting(500, seed=2), tmp_path / "c", mode)
    assert_iterator_gives_batch_at(pipe, count=12, num_workers=num_workers)
    rows_per_epoch = pipe.stream.rows_before(1)
    step = rows_per_epoch // 4 + 3  # a step of the second epoch
    assert_iterator_gives_batch_at(pipe, start_step=step, count=4, num_workers=num_workers)


@pytest.mark.parametrize("mode", MODES)
def test_lengths_are_cached_and_a_resume_measures_only_the_documents_before_it(tmp_path, mode):
    src = Counting(20_000, seed=4)
    pipe = _packed(src, tmp_path / "c", mode)
    pipe.batch_at(50)
    measured_then_read = src.read
    rows = 51 * 4
    assert measured_then_read < 20_000 // 2, measured_then_read  # the documents up to step 50's rows, in windows
    del pipe  # the job ends (its lengths not written yet are written then)
    gc.collect()
    again = _packed(src, tmp_path / "c", mode)  # a restarted job: the lengths come from the cache
    src.read = 0
    again.batch_at(50)
    assert src.read <= 4 * 12, src.read  # only the step's own documents (at most 12 a row here)
    assert rows < measured_then_read


@pytest.mark.parametrize("mode", MODES)
def test_no_token_at_all_is_a_clear_error(tmp_path, mode):
    class Empty(Counting):
        def read_many(self, ids):
            return [{"tokens": np.zeros(0, np.int32)} for _ in np.asarray(ids).tolist()]

    pipe = _packed(Empty(50), tmp_path / "c", mode)
    with pytest.raises(ValueError, match="hold no token"):
        pipe.batch_at(0)


def test_concat_rows_are_the_same_in_every_shuffled_epoch_and_counted_once(tmp_path):
    src = Counting(2_000, seed=6)
    pipe = _packed(src, tmp_path / "c", "concat", num_epochs=3)
    tokens = sum(len(d) for d in src.docs)
    assert pipe.stream.rows_before(3) == 3 * -(-tokens // 48)  # one epoch measured: concat's rows are its tokens
    assert src.read == 2_000  # every document read once, to measure it: the later epochs were not planned
    assert pipe.stream.lazy.values[:, 0].min() >= 0  # (that one epoch measured every document)
    last = pipe.num_steps - 1
    assert_batches_equal(
        pipe.batch_at(last),
        _pack(
            quern.Pipeline.from_source(src, seed=3, num_epochs=3).shuffle(),
            "concat",
            lengths=[len(d) for d in src.docs],
        ).batch_at(last),
        "the last step",
    )


def test_lazy_concat_columns_that_disagree_name_the_record(tmp_path):
    class TwoColumns(Counting):
        def read_many(self, ids):
            out = super().read_many(ids)
            for i, rec in zip(np.asarray(ids).tolist(), out):
                rec["targets"] = rec["tokens"][:-1] if i == 70 else rec["tokens"]
            return out

    pipe = quern.Pipeline.from_source(TwoColumns(300), seed=3)
    pipe = pipe.pack({"tokens": 48, "targets": 48}, mode="concat", cache_dir=tmp_path / "c").batch(4)
    assert pipe.stream.lazy is not None
    pipe.batch_at(0)  # the first window (64 documents) agrees
    with pytest.raises(ValueError, match="record 70 of source 'docs' has .* tokens in column 'tokens' and"):
        pipe.batch_at(pipe.stream.rows_before(1) // 4 - 1)


def test_an_index_scanned_before_is_used_and_the_fingerprint_stays(tmp_path):
    src = Counting(1_000, seed=7)
    lazy = _packed(src, tmp_path / "c", "concat")
    quern.Pipeline.from_source(src, seed=3).length_index("tokens", cache_dir=tmp_path / "c")
    indexed = _packed(src, tmp_path / "c", "concat")
    assert indexed.stream.lazy is None and lazy.stream.lazy is not None
    assert indexed.fingerprint() == lazy.fingerprint()
    src.read = 0
    indexed.batch_at(3)
    assert src.read <= 4 * 12, src.read  # no measuring: the step's own documents only
    assert_batches_equal(indexed.batch_at(3), lazy.batch_at(3), "step 3")


@pytest.mark.parametrize("mode", MODES)
def test_threads_growing_one_plan_at_once_place_each_window_once(tmp_path, mode):
    """The iterator's lookahead thread reads a plan while the main thread grows it: the rows stay the plan's."""
    import threading

    src = Counting(6_000, seed=8)
    lazy = _packed(src, tmp_path / "c", mode)
    whole = _pack(quern.Pipeline.from_source(src, seed=3).shuffle(), mode, lengths=[len(d) for d in src.docs])
    spans = [np.arange(k * 40, k * 40 + 40) for k in range(12)]
    got: dict[int, object] = {}
    start = threading.Barrier(len(spans))

    def read(k: int) -> None:
        start.wait()
        got[k] = lazy.stream.pieces(spans[k])

    threads = [threading.Thread(target=read, args=(k,)) for k in range(len(spans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, span in enumerate(spans):
        want = whole.stream.pieces(span)
        assert all(np.array_equal(a, b) for a, b in zip(got[k], want)), k
