"""Tests of pipeline/sources/ and pipeline/collate.py.

No silently wrong data: schemas that differ, files changed under an open source, and
rows that do not collate are errors naming what failed, never a promoted, object or
empty batch.

Files are written by their own libraries (pyarrow, array_record's writer). Reads of
files changed under an open reader run in a child interpreter, so that a crash in
native code fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TESTS, write_array_record

import quern
from quern import sources as S
from quern.transforms import pad

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- Parquet schemas


def _write(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=3)
    return path


def _two(tmp_path, a: dict, b: dict) -> tuple[Path, Path]:
    return _write(tmp_path / "a.parquet", a), _write(tmp_path / "b.parquet", b)


def _ints(values, t=None):
    return pa.array(values, type=pa.int64() if t is None else t)


@pytest.mark.parametrize(
    "a, b, column",
    [
        # a column missing in the second file, then one only in the second file
        ({"x": _ints([1, 2]), "y": _ints([3, 4])}, {"x": _ints([5, 6])}, "y"),
        ({"x": _ints([1, 2])}, {"x": _ints([5, 6]), "z": ["p", "q"]}, "z"),
        # float vs string, int32 vs int64, float32 vs float64, list<int32> vs list<int64>
        ({"x": pa.array([1.5, 2.5])}, {"x": ["1.5", "2.5"]}, "x"),
        ({"x": _ints([1, 2], pa.int32())}, {"x": _ints([3, 4])}, "x"),
        ({"x": pa.array([1.5, 2.5], pa.float32())}, {"x": pa.array([3.5, 4.5])}, "x"),
        ({"x": pa.array([[1], [2, 3]], pa.list_(pa.int32()))}, {"x": pa.array([[4], []], pa.list_(pa.int64()))}, "x"),
    ],
    ids=["missing", "extra", "float-string", "int32-int64", "float32-float64", "list-int32-int64"],
)
def test_parquet_files_with_different_schemas_are_refused_at_open(tmp_path, a, b, column):
    pa_path, pb_path = _two(tmp_path, a, b)
    with pytest.raises(quern.SourceError) as e:
        S.ParquetSource([pa_path, pb_path])
    msg = str(e.value)
    assert "a.parquet" in msg and "b.parquet" in msg and repr(column) in msg, msg
    assert "unify_schemas" in msg or "columns=" in msg, msg  # says what to do


@pytest.mark.parametrize(
    "a, b, column",
    [
        ({"x": pa.array([1.5, 2.5])}, {"x": ["1.5", "2.5"]}, "x"),  # float vs string
        ({"x": _ints([1, 2])}, {"x": pa.array([1.5, 2.5])}, "x"),  # int64 vs float64: values would be rounded
        ({"x": _ints([1, 2], pa.uint64())}, {"x": _ints([3, 4])}, "x"),  # no integer type holds both
        ({"x": _ints([1, 2]), "y": _ints([3, 4])}, {"x": _ints([5, 6])}, "y"),  # missing column
    ],
    ids=["float-string", "int-float", "uint64-int64", "missing"],
)
def test_unify_schemas_still_refuses_incompatible_files(tmp_path, a, b, column):
    pa_path, pb_path = _two(tmp_path, a, b)
    with pytest.raises(quern.SourceError) as e:
        S.ParquetSource([pa_path, pb_path], unify_schemas=True)
    msg = str(e.value)
    assert "a.parquet" in msg and "b.parquet" in msg and repr(column) in msg, msg


@pytest.mark.parametrize(
    "a_col, b_col, dtype",
    [
        (_ints([1, -2, 3], pa.int32()), _ints([2**40, None, -(2**40)]), np.int64),
        (pa.array([0.1, 0.2, 0.3], pa.float32()), pa.array([1e300, -0.5, 2.0]), np.float64),
        (_ints([1, 2, 250], pa.uint8()), _ints([-5, 6, 7], pa.int16()), np.int16),
        (pa.array([None, None, None]), _ints([7, 8, 9]), np.int64),  # an all-null column takes the other type
    ],
    ids=["int32-int64", "float32-float64", "uint8-int16", "null-int64"],
)
def test_unify_schemas_reads_compatible_types_as_one(tmp_path, a_col, b_col, dtype):
    pa_path, pb_path = _two(tmp_path, {"x": a_col, "t": ["a", "b", "c"]}, {"x": b_col, "t": ["d", "e", "f"]})
    src = S.ParquetSource(str(tmp_path / "*.parquet"), unify_schemas=True)
    want = pq.read_table(pa_path).to_pylist() + pq.read_table(pb_path).to_pylist()
    got = src.read_many(np.arange(len(src)))
    assert [r["t"] for r in got] == [w["t"] for w in want]
    for g, w in zip(got, want):
        if w["x"] is None:
            assert g["x"] is None
        else:
            assert type(g["x"]) is np.dtype(dtype).type, (g, w)  # one type in every file: the unified one
            assert g["x"] == np.asarray(w["x"], dtype)  # values exact (a float32's value, widened)
    # and a batch mixing both files collates to the unified dtype
    if not any(w["x"] is None for w in want):
        batch = quern.Pipeline.from_source(src).batch(6).batch_at(0)
        assert batch["x"].dtype == dtype


def test_unify_schemas_widens_list_elements(tmp_path):
    a = {"tokens": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}
    b = {"tokens": pa.array([[2**33], []], pa.large_list(pa.int64()))}
    _two(tmp_path, a, b)
    src = S.ParquetSource(str(tmp_path / "*.parquet"), unify_schemas=True)
    rows = src.read_many(np.arange(4))
    assert [r["tokens"].tolist() for r in rows] == [[1, 2], [3], [2**33], []]
    assert {r["tokens"].dtype for r in rows} == {np.dtype(np.int64)}


def test_columns_may_select_the_common_columns(tmp_path):
    _two(tmp_path, {"x": _ints([1, 2]), "y": _ints([3, 4])}, {"x": _ints([5, 6]), "z": ["p", "q"]})
    src = S.ParquetSource(str(tmp_path / "*.parquet"), columns=["x"])
    assert [int(r["x"]) for r in src.read_many(np.arange(4))] == [1, 2, 5, 6]
    with pytest.raises(quern.SourceError, match=r"'y'.*a\.parquet.*b\.parquet"):  # in the first, not the second
        S.ParquetSource(str(tmp_path / "*.parquet"), columns=["x", "y"])


def test_column_order_may_differ_and_records_follow_the_first_file(tmp_path):
    _two(tmp_path, {"x": _ints([1]), "y": ["a"]}, {"y": ["b"], "x": _ints([2])})
    src = S.ParquetSource(str(tmp_path / "*.parquet"))
    assert [list(r) for r in src.read_many(np.arange(2))] == [["x", "y"], ["x", "y"]]
    assert quern.Pipeline.from_source(src).batch(2).batch_at(0)["x"].tolist() == [1, 2]


def test_unify_schemas_is_part_of_the_identity(tmp_path):
    _two(tmp_path, {"x": _ints([1, 2])}, {"x": _ints([3, 4])})
    plain = S.ParquetSource(str(tmp_path / "*.parquet"))
    unified = S.ParquetSource(str(tmp_path / "*.parquet"), unify_schemas=True)
    assert "unify_schemas" not in plain.identity()  # unchanged for existing pipelines
    assert unified.identity()["unify_schemas"] is True
    fp = [quern.Pipeline.from_source(s).batch(2).fingerprint() for s in (plain, unified)]
    assert fp[0] != fp[1]
    assert pickle.loads(pickle.dumps(unified)).read_many(np.arange(4))[3]["x"] == 4
    with pytest.raises(TypeError, match="unify_schemas"):
        S.ParquetSource(str(tmp_path / "*.parquet"), unify_schemas="yes")


# --------------------------------------------------------------------------- ArrayRecord changed under a reader


def _records(n: int, tag: bytes = b"r") -> list[bytes]:
    rng = np.random.default_rng(n)
    return [tag + str(i).encode() + b"|" + rng.bytes(1000 + i) for i in range(n)]


# A child opens a source, reads, makes the change, reads again through the same source
# (its pooled readers), then through a copy pickled before the change (as a worker
# process gets it, opening fresh readers).
_CHANGE_THEN_READ = textwrap.dedent(
    r"""
    import json, os, pickle, sys
    import numpy as np
    import pyarrow as pa, pyarrow.parquet as pq
    import quern
    from helpers import write_array_record

    kind, path, change = sys.argv[1], sys.argv[2], sys.argv[3]

    def write(records, to=path):
        if kind == "ArrayRecordSource":
            write_array_record(to, records)
        else:
            pq.write_table(pa.table({"b": records}), to, row_group_size=100)

    def err(e):
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)}

    def value(r):
        return r if isinstance(r, bytes) else r["b"]

    src = getattr(quern.sources, kind)(path)
    ids = np.arange(len(src))
    before = [value(r) for r in src.read_many(ids[:100])]  # the first row group of the Parquet file
    copy = pickle.dumps(src)
    size = os.path.getsize(path)
    before = [value(r) for r in src.read_many(ids)] if kind == "ArrayRecordSource" else before + [b""] * 1900
    if change == "truncate_to_zero":
        os.truncate(path, 0)
    elif change == "truncate_half":
        os.truncate(path, size // 2)
    elif change == "rewrite_fewer":
        write(before[: len(before) // 2])
    elif change == "rewrite_same_count":
        write([b"X" + r[1:] for r in before])
    elif change == "replace_by_rename":
        write([b"Y" + r[1:] for r in before], path + ".new")
        os.replace(path + ".new", path)
    elif change == "remove":
        os.remove(path)
    out = {}
    for name, s in (("same", src), ("copy", pickle.loads(copy))):
        try:
            got = [value(r) for r in s.read_many(ids)]
            out[name] = {"ok": True, "empty": sum(not r for r in got), "equal": sum(a == b for a, b in zip(got, before))}
        except Exception as e:
            out[name] = {"error": err(e)}
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize(
    "change",
    ["truncate_to_zero", "truncate_half", "rewrite_fewer", "rewrite_same_count", "replace_by_rename", "remove"],
)
@pytest.mark.parametrize("kind", ["ArrayRecordSource", "ParquetSource"])
def test_file_changed_under_an_open_source_raises_naming_it(tmp_path, kind, change):
    if kind == "ArrayRecordSource":
        path = tmp_path / "data-00000.array_record"
        write_array_record(path, _records(2000))
    else:
        path = tmp_path / "data-00000.parquet"
        pq.write_table(pa.table({"b": _records(2000)}), path, row_group_size=100)
    res = subprocess.run(
        [sys.executable, "-c", _CHANGE_THEN_READ, kind, str(path), change],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": TESTS},  # for helpers
    )
    assert res.returncode == 0, f"child interpreter died (rc={res.returncode}):\n{res.stderr[-3000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("same", "copy"):  # the open readers, and a worker's fresh ones
        assert "error" in out[name], (name, out[name])  # never empty, stale or other records
        e = out[name]["error"]
        assert "SourceError" in e["mro"] and path.name in e["msg"], e
        assert ("changed" in e["msg"] or "removed" in e["msg"]) and "opened" in e["msg"], e


def test_array_record_changed_file_fails_the_step_naming_it(tmp_path):
    path = tmp_path / "data.array_record"
    write_array_record(path, _records(40))
    pipe = quern.Pipeline.from_source(S.ArrayRecordSource(str(path))).batch(8)
    assert len(pipe.batch_at(0)) == 8
    write_array_record(path, _records(40, b"z"))  # rewritten in place: same count, other records
    with pytest.raises(quern.StepError, match=r"stage 'read'.*data\.array_record.*changed since the source opened"):
        pipe.batch_at(1)


def test_array_record_unchanged_files_keep_reading(tmp_path):
    path = tmp_path / "data.array_record"
    recs = _records(30)
    write_array_record(path, recs)
    src = S.ArrayRecordSource(str(path))
    for _ in range(3):
        assert list(src.read_many(np.arange(30))) == recs
    os.utime(path, None)  # a touch is a change too: the source cannot tell it from a same-size rewrite
    with pytest.raises(quern.SourceError, match="modified"):
        src.read_many(np.arange(3))


def test_array_record_source_on_another_machine_compares_sizes_then_its_own_stats(tmp_path):
    path = tmp_path / "data.array_record"
    recs = _records(30)
    write_array_record(path, recs)
    src = S.ArrayRecordSource(str(path))
    src._files.host = "another-machine"  # as if it had been pickled there and sent here
    moved = pickle.loads(pickle.dumps(src))
    assert list(moved.read_many(np.arange(30))) == recs  # inode and times are taken here, at the first read
    os.utime(path, None)
    with pytest.raises(quern.SourceError, match="modified"):
        moved.read_many(np.arange(3))


# --------------------------------------------------------------------------- strict collation


def _batch_error(records, step=1, batch=4, before=lambda p: p, after=lambda p: p) -> str:
    """The message of the StepError that step ``step`` of ``records`` raises, with the
    stages ``before`` adds before ``batch`` and ``after`` adds after it."""
    pipe = after(before(quern.Pipeline.from_source(records)).batch(batch))
    with pytest.raises(quern.StepError) as e:
        pipe.batch_at(step)
    return str(e.value)


def _rows(values, at, odd, n=8):
    """``n`` records equal to ``values`` (a function of the index), the one ``at`` replaced by ``odd``."""
    recs = [values(i) for i in range(n)]
    recs[at] = odd
    return recs


class Thing:
    pass


def _gen():
    yield 1


@pytest.mark.parametrize(
    "values, odd, said",
    [
        (lambda i: np.arange(3, dtype=np.int32), np.arange(3, dtype=np.float64), "dtype float64, row 0 has int32"),
        (lambda i: np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64), "dtype int64, row 0 has int32"),
        (lambda i: np.int32(i), np.int64(5), "row 2 has dtype int64, row 0 has int32"),
        (lambda i: np.int64(i), 5, "is an int, row 0 is a numpy.int64 scalar"),
        (lambda i: i, 2.5, "is a float, row 0 is an int"),
        (lambda i: i, True, "is a bool, row 0 is an int"),
        (lambda i: f"s{i}", 7, "is an int, row 0 is a str"),
        (lambda i: i, "7", "is a str, row 0 is an int"),
        (lambda i: f"s{i}", b"x", "is a bytes, row 0 is a str"),
        (lambda i: i, None, "is None"),
        (lambda i: np.zeros(2), None, "is None"),
        (lambda i: f"s{i}", None, "is None"),  # no longer an object array holding None
        (lambda i: np.arange(2), np.array([1, None], object), "dtype object, row 0 has int64 (an object array"),
        (lambda i: i, {1, 2}, "is a set"),
        (lambda i: i, _gen(), "is a generator"),
        (lambda i: i, Thing(), "Thing"),
        (lambda i: b"x", bytearray(b"x"), "bytearray"),
        (lambda i: (i, i), [1, 1], "is a list of length 2, row 0 is a tuple of length 2"),
        (lambda i: (i, i), (1, 2, 3), "length 3"),
        (lambda i: {"a": i}, {"a": 1, "b": 2}, "has keys ['a', 'b'], row 0 has ['a']"),
        (lambda i: {"a": i}, [1], "is a list"),
        (lambda i: {"a": np.zeros(2, np.float32)}, {"a": np.zeros(2)}, "batch['a']: row 2 has dtype float64"),
        (lambda i: {"a": (i, np.zeros(2))}, {"a": (1, np.zeros(3))}, "batch['a'][1]: row 2 has shape (3,)"),
    ],
    ids=lambda v: None if callable(v) else re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:30],
)
def test_collate_refuses_rows_that_differ_naming_row_record_and_stage(values, odd, said):
    msg = _batch_error(_rows(values, 6, odd))  # step 1 of batches of 4: record 6 is row 2
    assert "step 1" in msg and "stage 'collate'" in msg and "row 2 = record 6" in msg, msg
    assert said in msg, msg


@pytest.mark.parametrize("first", [None, {1}, Thing(), _gen()], ids=["None", "set", "object", "generator"])
def test_collate_refuses_uncollatable_row_zero(first):
    with pytest.raises(quern.CollateError) as e:
        quern.collate([first, first])
    assert e.value.row == 0 and "cannot be collated" in str(e.value)


def test_collate_keeps_what_is_consistent():
    assert quern.collate([1, 2, 3]).dtype == np.int64  # Python numbers: numpy's default dtypes
    assert quern.collate([1.0, 2.0]).dtype == np.float64
    assert quern.collate([True, False]).dtype == np.bool_
    assert quern.collate([np.int32(1), np.int32(2)]).dtype == np.int32  # NumPy values keep their dtype
    assert quern.collate([np.zeros((2, 3), np.uint8)] * 4).shape == (4, 2, 3)
    assert quern.collate([np.zeros((), np.float16), np.float16(1)]).dtype == np.float16  # 0-d array and scalar
    days = [np.datetime64("2024-01-02", "D"), np.datetime64("2024-01-03", "D")]
    assert quern.collate(days).dtype == np.dtype("datetime64[D]")
    with pytest.raises(quern.CollateError, match="dtype datetime64"):
        quern.collate([days[0], np.datetime64("2024-01-02T00:00", "m")])
    strs = quern.collate(["a", np.str_("b")])  # str and NumPy's str_ are one kind
    assert strs.dtype == object and strs.tolist() == ["a", "b"]
    with pytest.raises(quern.CollateError, match="int64 range"):
        quern.collate([1, 2**63])


def test_collate_takes_objects_with_array_protocol():
    jnp = pytest.importorskip("jax.numpy")
    out = quern.collate([jnp.arange(3, dtype=jnp.int32), np.arange(3, dtype=np.int32)])
    assert out.dtype == np.int32 and out.tolist() == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(quern.CollateError, match="dtype float32"):
        quern.collate([np.arange(3, dtype=np.int32), jnp.arange(3, dtype=jnp.float32)])


def test_parquet_null_fails_the_batch_naming_its_record(tmp_path):
    p = _write(tmp_path / "n.parquet", {"x": _ints([1, 2, 3, None, 5, 6, 7, 8])})
    pipe = quern.Pipeline.from_source(S.ParquetSource(str(p))).batch(2)
    assert pipe.batch_at(0)["x"].dtype == np.int64
    with pytest.raises(quern.StepError, match=r"step 1 .*stage 'collate' row 1 = record 3 .*batch\['x'\].*None"):
        pipe.batch_at(1)


def test_pad_refuses_mixed_dtypes_naming_the_record():
    recs = [np.arange(i + 1, dtype=np.int32) for i in range(8)]
    recs[5] = np.arange(3, dtype=np.int64)
    msg = _batch_error(recs, before=lambda p: p.map(pad(4)))
    assert (
        "stage map[0] pad" in msg and "row 1 = record 5" in msg and "pad: row 1 has dtype int64, row 0 has int32" in msg
    ), msg
    with pytest.raises(quern.CollateError, match="dtype float64"):
        pad(4).map_many([[1, 2], []])  # an empty list is float64 to NumPy: not silently a float batch


# --------------------------------------------------------------------------- what transforms return


class Pair(NamedTuple):
    a: np.ndarray
    b: np.ndarray


@pytest.mark.parametrize(
    "records, fn, said",
    [
        ([{"x": i} for i in range(8)], lambda b: (b["x"],), "returned a tuple"),
        ([{"x": i} for i in range(8)], lambda b: None, "returned None"),
        ([{"x": i} for i in range(8)], lambda b: b["x"], "returned an int64 array"),
        (list(range(8)), lambda b: {"x": b}, "returned a dict"),
        (list(range(8)), lambda b: b.tolist(), "returned a list"),
        ([Pair(i, i) for i in range(8)], lambda b: {"a": b.a}, "returned a dict"),
        ([(i, i) for i in range(8)], lambda b: list(b), "returned a list"),
    ],
    ids=["dict-tuple", "dict-None", "dict-array", "array-dict", "array-list", "namedtuple-dict", "tuple-list"],
)
@pytest.mark.parametrize("kind", ["map_batch", "random_map_batch"])
def test_batch_transforms_must_return_a_batch_of_the_same_kind(records, fn, said, kind):
    if kind == "random_map_batch":
        msg = _batch_error(records, after=lambda p: p.random_map_batch(lambda b, keys: fn(b)))
    else:
        msg = _batch_error(records, after=lambda p: p.map_batch(fn))
    assert f"stage {kind}[0]" in msg and said in msg and "kind it was given" in msg, msg


def test_batch_transforms_returning_the_same_kind_pass():
    pipe = quern.Pipeline.from_source([Pair(np.int32(i), np.float32(i)) for i in range(8)]).batch(4)
    out = pipe.map_batch(lambda b: Pair(b.a + 1, b.b)).batch_at(1)  # a namedtuple for a namedtuple
    assert type(out) is Pair and out.a.tolist() == [5, 6, 7, 8]
    out = pipe.map_batch(lambda b: (b.a, b.b)).batch_at(1)  # any tuple for a tuple
    assert isinstance(out, tuple)
    d = quern.Pipeline.from_source({"x": np.arange(8)}).batch(4).map_batch(lambda b: {"n": b["x"].sum()})
    assert int(d.batch_at(0)["n"]) == 6  # a dict's leaves are the transform's business
    jnp = pytest.importorskip("jax.numpy")
    a = quern.Pipeline.from_source(np.arange(8, dtype=np.int32)).batch(4).map_batch(lambda b: jnp.asarray(b) * 2)
    assert np.asarray(a.batch_at(1)).tolist() == [8, 10, 12, 14]  # an array-like for an array


class _Many:
    """A ``map`` transform whose ``map_many`` returns ``result(records)``."""

    def __init__(self, result):
        self.result = result

    def __call__(self, record):
        return record

    def map_many(self, records):
        return self.result(records)


@pytest.mark.parametrize(
    "result, said",
    [
        (lambda recs: None, "map_many returned None, not a sequence of 4 records"),
        (lambda recs: (r for r in recs), "map_many returned a generator"),
        (lambda recs: {i: r for i, r in enumerate(recs)}, "map_many returned a dict"),
        (lambda recs: "abcd", "map_many returned a str"),
        (lambda recs: list(recs)[:3], "map_many returned 3 records for 4"),
    ],
    ids=["None", "generator", "dict", "str", "short"],
)
def test_map_many_must_return_one_record_per_record(result, said):
    msg = _batch_error(list(range(8)), before=lambda p: p.map(_Many(result)))
    assert "step 1" in msg and "stage map[0]" in msg and said in msg and "records list [4, 5, 6, 7]" in msg, msg


def test_map_many_may_return_a_sequence_or_an_array():
    pipe = quern.Pipeline.from_source(list(range(8)))
    assert pipe.map(_Many(lambda recs: tuple(recs))).batch(4).batch_at(1).tolist() == [4, 5, 6, 7]
    assert pipe.map(_Many(lambda recs: np.asarray(recs) * 2)).batch(4).batch_at(1).tolist() == [8, 10, 12, 14]
