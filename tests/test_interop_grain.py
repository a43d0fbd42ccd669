"""quern.interop.grain: a pipeline as a grain MapDataset (item s is batch_at(s), grain's checkpoint a step),
and grain's data sources read by quern (through __getitems__), with equal records."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_batches_equal, write_array_record

import quern

# grain is imported by the tests that run here, not at collection: every test process collects this module


def map_dataset(*args, **kwargs):
    from quern.interop.grain import map_dataset

    return map_dataset(*args, **kwargs)


def source(*args, **kwargs):
    from quern.interop.grain import source

    return source(*args, **kwargs)


def _pipe(num_epochs=None):
    return quern.Pipeline.from_source({"x": np.arange(96)}, seed=4, num_epochs=num_epochs).shuffle().batch(8)


def test_item_s_is_batch_at_s_and_a_host_slice():
    pipe = _pipe(num_epochs=2)
    ds = map_dataset(pipe)
    assert len(ds) == pipe.num_steps == 24
    for s in (0, 5, 23):
        assert_batches_equal(ds[s], pipe.batch_at(s), f"item {s}")
    half = map_dataset(pipe, process_index=1, process_count=2)
    assert_batches_equal(half[5], pipe.batch_at(5, 1, 2))
    assert len(map_dataset(_pipe())) > 10**15  # endless: grain's repeat() length
    with pytest.raises(ValueError, match="batch"):
        map_dataset(quern.Pipeline.from_source({"x": np.arange(8)}, seed=0))
    with pytest.raises(ValueError, match="process_index 2 is not one of process_count=2"):
        map_dataset(pipe, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="3"):  # 8 rows do not split over 3 hosts: refused now, not at ds[0]
        map_dataset(pipe, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="device stages"):
        map_dataset(pipe.map_device(lambda b: b))


def test_grains_iterator_and_its_checkpoint_are_steps():
    pipe = _pipe()
    it = iter(map_dataset(pipe).to_iter_dataset())
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    for s, b in enumerate(first):
        assert_batches_equal(b, pipe.batch_at(s), f"step {s}")
    again = iter(map_dataset(pipe).to_iter_dataset())
    again.set_state(state)  # grain's own checkpoint, restored into a fresh iterator
    assert_batches_equal(next(again), pipe.batch_at(3), "resumed")


class Squares:
    """A data source of grain's protocol with a bulk read that counts its calls."""

    def __init__(self, n: int) -> None:
        self.n, self.bulk = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": np.int64(i * i)}

    def __getitems__(self, ids: list[int]) -> list[dict]:
        self.bulk += 1
        return [self[i] for i in ids]


def _ids(pipe, step):
    return [rid for row in pipe.explain(step) for _, rid in row]


def test_grains_sources_inside_quern_have_equal_records(tmp_path):
    path = tmp_path / "r.array_record"
    write_array_record(path, [f"record {i}".encode() for i in range(50)])
    import grain

    theirs = grain.sources.ArrayRecordDataSource([str(path)])
    src = source(theirs, name="ar")
    pipe = quern.Pipeline.from_source(src, seed=2).shuffle().batch(5)
    ours = quern.Pipeline.from_source(quern.sources.ArrayRecordSource(str(path)), seed=2).shuffle().batch(5)
    for s in (0, 3, 9):
        got = list(pipe.batch_at(s))
        assert got == list(ours.batch_at(s)) == [theirs[i] for i in _ids(pipe, s)]
    assert src.identity()["files"][0]["records"] == 50  # described by its files, not a sample of records
    squares = Squares(30)
    sq = quern.Pipeline.from_source(source(squares), seed=0).shuffle().batch(6)
    assert sq.batch_at(2)["x"].tolist() == [i * i for i in _ids(sq, 2)]
    assert squares.bulk >= 1  # read through __getitems__
