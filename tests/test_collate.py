"""pipeline/collate.py: a list of records -> one batch, strictly: the rows must agree in structure,
keys, types, dtypes and shapes, nothing is promoted, and an error names the key path and the row."""

from collections import namedtuple

import numpy as np
import pytest

import quern
from quern.pipeline.core.collate import CollatedRows, CollateError, describe, take

Pair = namedtuple("Pair", "a b")


def test_collate_nested_structures():
    recs = [{"a": np.full(2, i), "b": (i, f"s{i}"), "c": {"d": float(i)}, "e": bytes([i])} for i in range(3)]
    out = quern.collate(recs)
    assert out["a"].shape == (3, 2) and out["b"][0].tolist() == [0, 1, 2]
    assert out["b"][1].tolist() == ["s0", "s1", "s2"] and out["c"]["d"].dtype == np.float64
    assert out["e"].dtype == object and out["e"].tolist() == [b"\x00", b"\x01", b"\x02"]


def test_collate_errors_name_the_key():
    with pytest.raises(ValueError, match=r"batch\['a'\].*different shapes"):
        quern.collate([{"a": np.zeros(2)}, {"a": np.zeros(3)}])
    with pytest.raises(ValueError, match="row 1 has keys"):
        quern.collate([{"a": 1}, {"b": 1}])
    with pytest.raises(ValueError, match="None"):
        quern.collate([None, None])


def test_variable_length_records_without_pad_fail_with_a_hint():
    pipe = quern.Pipeline.from_source([np.arange(i + 1) for i in range(10)]).batch(5)
    with pytest.raises(quern.StepError, match="stage 'collate'.*pad"):
        pipe.batch_at(0)


def test_a_namedtuple_stays_one_and_lists_stay_lists():
    out = quern.collate([Pair(np.int32(i), [float(i), i]) for i in range(3)])
    assert type(out) is Pair and out.a.dtype == np.int32 and out.a.tolist() == [0, 1, 2]
    assert isinstance(out.b, list) and out.b[0].dtype == np.float64 and out.b[1].dtype == np.int64


@pytest.mark.parametrize(
    "value,dtype", [(True, np.bool_), (3, np.int64), (2.5, np.float64), (1j, np.complex128)], ids=str
)
def test_python_numbers_collate_to_their_default_dtype(value, dtype):
    out = quern.collate([value, value])
    assert out.dtype == dtype and out.tolist() == [value, value]


@pytest.mark.parametrize(
    "rows,said",
    [
        (
            [np.int32(1), np.int64(2)],
            "row 1 has dtype int64, row 0 has int32: rows of different dtypes are not promoted",
        ),
        ([np.zeros(2, np.int32), np.zeros(2, np.int64)], "row 1 has dtype int64, row 0 has int32"),
        ([1, 2.0], "row 1 is a float, row 0 is an int"),
        ([1, np.int64(2)], "row 1 is a numpy.int64 scalar, row 0 is an int"),
        ([1, 2**63], "row 1 is the int 9223372036854775808, outside the int64 range"),
        (["a", b"b"], "row 1 is a bytes, row 0 is a str"),
        ([{1, 2}, {3}], "row 0 is a set, which cannot be collated"),
    ],
    ids=["int32-int64", "array-dtypes", "int-float", "int-numpy", "int-overflow", "str-bytes", "set"],
)
def test_rows_that_differ_are_refused_naming_the_row(rows, said):
    with pytest.raises(CollateError, match=said) as info:
        quern.collate(rows)
    assert info.value.row == (0 if "row 0 is a set" in said else 1)


def test_an_empty_list_is_an_error():
    with pytest.raises(ValueError, match="cannot collate an empty list of records"):
        quern.collate([])


def test_collated_rows_are_their_batch_and_give_rows_on_access():
    batch = {"x": np.arange(6).reshape(3, 2), "t": (np.array([1.0, 2.0, 3.0]),)}
    rows = CollatedRows(batch, 3)
    assert quern.collate(rows) is batch and len(rows) == 3
    assert rows[1]["x"].tolist() == [2, 3] and rows[-1]["t"][0] == 3.0
    assert [r["x"][0] for r in rows[1:]] == [2, 4]
    with pytest.raises(IndexError):
        rows[3]


def test_take_indexes_every_array_of_a_batch():
    batch = {"x": np.arange(4), "pair": Pair(np.arange(4) * 2, [np.arange(4) * 3])}
    got = take(batch, np.array([3, 0]))
    assert got["x"].tolist() == [3, 0] and type(got["pair"]) is Pair
    assert got["pair"].a.tolist() == [6, 0] and got["pair"].b[0].tolist() == [9, 0]


def test_describe_says_the_kind_of_a_value():
    assert describe(np.zeros((2, 3), np.float32)) == "a float32 array of shape (2, 3)"
    assert describe(np.int8(1)) == "a numpy.int8 scalar"
    assert [describe(v) for v in (None, 1, "s", {1})] == ["None", "an int", "a str", "a set"]
