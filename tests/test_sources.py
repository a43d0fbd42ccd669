"""Tests of pipeline/sources/.

Tests for quern.sources against real files written by the libraries themselves.

Every expected value comes from the writing library (the bytes handed to
ArrayRecordWriter, pyarrow's own ``read_table(...).to_pylist()``, the NumPy array
written into TensorStore), never from the code under test.

Reads of damaged files run in a child interpreter (``_probe``) so that a crash in
native code (riegeli, Arrow, TensorStore) fails the test instead of killing pytest.
"""

from __future__ import annotations

import collections.abc
import datetime
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorstore as ts
from helpers import write_array_record, write_zarr

import quern
from quern import sources as S

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- helpers


def _make_records(rng: np.random.Generator, shard: int, n: int) -> list[bytes]:
    """Distinct records of varied length (including empty and NUL-containing ones)."""
    out = []
    for i in range(n):
        tag = f"s{shard}r{i}|".encode()
        body = rng.bytes(int(rng.integers(0, 300)))
        out.append(tag + body)
    out[0] = b""  # zero-length record
    if n > 1:
        out[1] = b"\x00" * 17
    return out


def _parquet_table(rng: np.random.Generator, n: int, start: int) -> pa.Table:
    tokens = [rng.integers(0, 4, int(rng.integers(0, 13))).astype(np.int32) for _ in range(n)]
    return pa.table(
        {
            "tokens": pa.array(tokens, type=pa.list_(pa.int32())),
            "id": pa.array((np.arange(start, start + n, dtype=np.int64) * 1_000_003) + 2**40, type=pa.int64()),
            "score": pa.array(rng.standard_normal(n), type=pa.float64()),
            "text": pa.array([f"row-{start + i}-" + "ab" * int(rng.integers(0, 5)) for i in range(n)]),
        }
    )


def _assert_value_equal(got, want, where: str = "") -> None:
    """``want`` is a plain Python / NumPy value from the writing library."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert set(got) == set(want), where
        for k in want:
            _assert_value_equal(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (bytes, str)):
        assert type(got) is type(want), f"{where}: {type(got)} vs {type(want)}"
        assert got == want, where
    elif isinstance(want, list):  # a Parquet list cell -> 1-D NumPy array
        assert isinstance(got, np.ndarray) and got.ndim == 1, f"{where}: {type(got)}"
        assert got.tolist() == want, where
    elif isinstance(want, np.ndarray):
        got_a = np.asarray(got)
        assert got_a.dtype == want.dtype, f"{where}: {got_a.dtype} vs {want.dtype}"
        assert got_a.shape == want.shape, where
        np.testing.assert_array_equal(got_a, want, err_msg=where)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _assert_records_equal(got: list, want: list) -> None:
    # read_many returns a sequence of records: a list, or rows already stacked (ArraySource)
    assert isinstance(got, collections.abc.Sequence) and not isinstance(got, (str, bytes))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        _assert_value_equal(g, w, f"record #{k}")


# A child interpreter opens a source and reads lists of ids, reporting each step as JSON.
_PROBE = textwrap.dedent(
    r"""
    import json, sys
    import numpy as np
    import quern

    kind, path, reads, pyarrow_groups = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])

    def err(e):
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)}

    def plain(x):
        if isinstance(x, bytes):
            return {"hex": x.hex()}
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, np.ndarray):
            return x.tolist()
        if isinstance(x, np.generic):
            return x.item()
        return x

    out = {"pyarrow": []}
    if pyarrow_groups:  # what pyarrow itself says about each row group of the file
        import pyarrow.parquet as pq
        for g in pyarrow_groups:
            try:
                pq.ParquetFile(path).read_row_group(g)
                out["pyarrow"].append(None)
            except Exception as e:
                out["pyarrow"].append(err(e))
    try:
        src = getattr(quern.sources, kind)(path)
    except Exception as e:
        out["open"] = err(e)
        print(json.dumps(out))
        raise SystemExit(0)
    out["open"] = None
    out["len"] = len(src)
    out["reads"] = []
    for ids in reads:
        if ids == "all":
            ids = list(range(len(src)))
        try:
            out["reads"].append({"ok": [plain(r) for r in src.read_many(np.asarray(ids, dtype=np.int64))]})
        except Exception as e:
            out["reads"].append({"error": err(e)})
    print(json.dumps(out))
    """
)


def _probe(kind: str, path, reads=("all",), pyarrow_groups=(), cwd=None) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, kind, str(path), json.dumps(list(reads)), json.dumps(list(pyarrow_groups))],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )
    assert res.returncode == 0, f"child interpreter died (rc={res.returncode}):\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _assert_error_names_file(e: dict, path, types=("SourceError",)) -> None:
    assert any(t in e["mro"] for t in types), e
    assert os.path.basename(str(path)) in e["msg"], e


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def ar_shards(tmp_path):
    """Three ArrayRecord shards ``train-0000k-of-00003.array_record``; returns (paths, records per shard)."""
    rng = np.random.default_rng(1234)
    d = tmp_path / "ar"
    d.mkdir()
    counts = [23, 41, 9]
    paths, recs = [], []
    for k, n in enumerate(counts):
        p = d / f"train-{k:05d}-of-00003.array_record"
        r = _make_records(rng, k, n)
        write_array_record(p, r)
        paths.append(p)
        recs.append(r)
    return paths, recs


@pytest.fixture
def pq_files(tmp_path):
    """Three Parquet files with row groups of 64 rows; returns (paths, pyarrow's rows, row-group layout)."""
    rng = np.random.default_rng(99)
    d = tmp_path / "pq"
    d.mkdir()
    paths, rows, start = [], [], 0
    for k, n in enumerate([200, 200, 136]):
        p = d / f"events-{k:05d}.parquet"
        pq.write_table(_parquet_table(rng, n, start), p, row_group_size=64, compression="snappy")
        paths.append(p)
        rows.extend(pq.read_table(p).to_pylist())  # the expected values: pyarrow's own reading
        start += n
    layout = []  # (global start row, n rows) per row group, from pyarrow's metadata
    g0 = 0
    for p in paths:
        md = pq.ParquetFile(p).metadata
        for g in range(md.num_row_groups):
            layout.append((g0, md.row_group(g).num_rows))
            g0 += md.row_group(g).num_rows
    return paths, rows, layout


# --------------------------------------------------------------------------- ArrayRecord


def _ar_input(form: str, paths: list[Path], recs: list[list[bytes]]):
    d = paths[0].parent
    if form == "glob":
        return str(d / "train-*.array_record"), recs[0] + recs[1] + recs[2]
    if form == "single_path":
        return str(paths[1]), recs[1]
    if form == "pathlike":
        return paths[2], recs[2]
    if form == "list_reordered":
        return [str(paths[2]), str(paths[0])], recs[2] + recs[0]
    if form == "list_mixed_glob":
        return [paths[1], str(d / "train-0000[02]-*.array_record")], recs[1] + recs[0] + recs[2]
    raise AssertionError(form)


@pytest.mark.parametrize("form", ["glob", "single_path", "pathlike", "list_reordered", "list_mixed_glob"])
def test_array_record_round_trip(ar_shards, form):
    paths, recs = ar_shards
    spec, expected = _ar_input(form, paths, recs)
    src = S.ArrayRecordSource(spec)
    n = len(expected)
    assert len(src) == n

    rng = np.random.default_rng(7)
    ids = rng.integers(0, n, size=300)  # random, unsorted, with repeats, spanning files
    ids[:4] = [n - 1, 0, n - 1, 0]
    got = src.read_many(ids)
    _assert_records_equal(got, [expected[i] for i in ids])

    # Every record, in reverse order, as a plain Python list of ints.
    rev = list(range(n))[::-1]
    _assert_records_equal(src.read_many(rev), [expected[i] for i in rev])
    # Single-record access and grain's batch protocol.
    for i in (0, n // 2, n - 1):
        assert src[i] == expected[i]
    _assert_records_equal(src.__getitems__([3, 1, 3]), [expected[3], expected[1], expected[3]])


def test_array_record_name_comes_from_first_file(ar_shards):
    paths, _ = ar_shards
    assert S.ArrayRecordSource(str(paths[0].parent / "train-*.array_record")).name == "train"
    assert S.ArrayRecordSource(paths[0], name="custom").name == "custom"


@pytest.mark.parametrize("bad", [None, -1, "len", "len+5"])
def test_array_record_out_of_range_ids(ar_shards, bad):
    paths, recs = ar_shards
    src = S.ArrayRecordSource([str(p) for p in paths])
    n = sum(map(len, recs))
    bad_id = {None: None, -1: -1, "len": n, "len+5": n + 5}[bad]
    if bad_id is None:  # the last valid id reads fine; one past it does not
        assert src[n - 1] == recs[-1][-1]
        with pytest.raises(IndexError, match=rf"record {n} out of range \[0, {n}\)"):
            src[n]
        return
    with pytest.raises(IndexError, match=rf"record {bad_id} out of range \[0, {n}\)"):
        src.read_many([0, 1, bad_id])
    with pytest.raises(IndexError, match=rf"record {bad_id} out of range"):
        src[bad_id]


class _CountingReader:
    """Proxy for an ArrayRecordReader that records every ``read`` call."""

    def __init__(self, inner, file_index: int, calls: list):
        self._inner, self._file_index, self._calls = inner, file_index, calls

    def read(self, *args, **kwargs):
        self._calls.append((self._file_index, list(args[0]) if args else None))
        return self._inner.read(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_array_record_one_read_call_per_file(ar_shards, monkeypatch):
    paths, recs = ar_shards
    src = S.ArrayRecordSource([str(p) for p in paths])
    calls: list = []
    real_reader = src._reader

    def borrow(f):  # readers go back to a shared pool after each call: unwrap a proxy that comes back
        r = real_reader(f)
        return _CountingReader(getattr(r, "_inner", r), f, calls)

    monkeypatch.setattr(src, "_reader", borrow)

    starts = np.cumsum([0] + [len(r) for r in recs])
    flat = [r for rs in recs for r in rs]
    rng = np.random.default_rng(3)
    # ids in files 0 and 2 only, shuffled, with repeats
    ids = np.concatenate([rng.integers(starts[0], starts[1], 40), rng.integers(starts[2], starts[3], 25)])
    rng.shuffle(ids)
    got = src.read_many(ids)
    _assert_records_equal(got, [flat[i] for i in ids])

    assert sorted(f for f, _ in calls) == [0, 2], calls  # exactly one read per touched file
    for f, local in calls:
        want_local = sorted(int(i - starts[f]) for i in ids if starts[f] <= i < starts[f + 1])
        assert sorted(local) == want_local

    calls.clear()
    src.read_many(np.arange(len(src))[::-1])
    assert sorted(f for f, _ in calls) == [0, 1, 2]
    calls.clear()
    src.read_many([starts[1] + 2])
    assert [f for f, _ in calls] == [1]


# --------------------------------------------------------------------------- Parquet


def test_parquet_rows_match_pyarrow(pq_files):
    paths, rows, _ = pq_files
    src = S.ParquetSource(str(paths[0].parent / "events-*.parquet"))
    assert len(src) == len(rows) == 536
    rng = np.random.default_rng(11)
    ids = rng.integers(0, len(rows), 400)
    ids[:3] = [len(rows) - 1, 0, len(rows) - 1]
    got = src.read_many(ids)
    _assert_records_equal(got, [rows[i] for i in ids])
    for r in got:
        assert r["tokens"].dtype == np.int32  # list<int32> cells become int32 arrays
    # all rows, reversed, across files and row groups
    every = np.arange(len(rows))[::-1]
    _assert_records_equal(src.read_many(every), [rows[i] for i in every])
    _assert_value_equal(src[200], rows[200])  # first row of the second file


def test_parquet_list_input_order(pq_files):
    paths, _, _ = pq_files
    src = S.ParquetSource([paths[2], str(paths[0])])
    want = pq.read_table(paths[2]).to_pylist() + pq.read_table(paths[0]).to_pylist()
    assert len(src) == len(want)
    ids = np.random.default_rng(0).permutation(len(want))
    _assert_records_equal(src.read_many(ids), [want[i] for i in ids])


@pytest.mark.parametrize("columns", [["tokens"], ["text", "id"], ["score"]])
def test_parquet_column_selection(pq_files, columns):
    paths, rows, _ = pq_files
    src = S.ParquetSource([str(p) for p in paths], columns=columns)
    ids = np.random.default_rng(5).integers(0, len(rows), 100)
    got = src.read_many(ids)
    _assert_records_equal(got, [{c: rows[i][c] for c in columns} for i in ids])


def test_parquet_unknown_column_raises_key_error(pq_files):
    paths, _, _ = pq_files
    with pytest.raises(KeyError, match="no_such_column"):
        S.ParquetSource([str(p) for p in paths], columns=["id", "no_such_column"])


def test_parquet_block_size_is_row_group_size(pq_files, tmp_path):
    paths, _, layout = pq_files
    assert [n for _, n in layout].count(64) == 8  # 200 = 3*64+8, 136 = 2*64+8
    assert S.ParquetSource([str(p) for p in paths]).block_size() == 64
    p = tmp_path / "rg10.parquet"
    pq.write_table(_parquet_table(np.random.default_rng(0), 50, 0), p, row_group_size=10)
    assert S.ParquetSource(p).block_size() == 10


def test_parquet_out_of_range(pq_files):
    paths, _, _ = pq_files
    src = S.ParquetSource(paths[0])
    with pytest.raises(IndexError, match=r"record 200 out of range \[0, 200\)"):
        src.read_many([0, 200])
    with pytest.raises(IndexError, match=r"record -1 out of range"):
        src[-1]


@pytest.fixture
def decode_counter(monkeypatch):
    """Counts (file basename, row group) decodes done through pyarrow's ParquetFile.read_row_group."""
    calls: list = []
    real = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        calls.append(i)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    return calls


@pytest.mark.parametrize("cache", [1, 3])
def test_parquet_lru_cache_is_bounded(pq_files, decode_counter, cache):
    paths, rows, layout = pq_files
    src = S.ParquetSource([str(p) for p in paths], cache_row_groups=cache)
    n_groups = len(layout)
    assert n_groups == 11

    # One read over every row group: each group is decoded exactly once, cache stays bounded.
    ids = np.random.default_rng(2).permutation(len(rows))
    _assert_records_equal(src.read_many(ids), [rows[i] for i in ids])
    assert len(decode_counter) == n_groups
    assert len(src._cache) <= cache

    # Walk the row groups one read at a time.
    decode_counter.clear()
    for start, n in layout:
        _assert_records_equal(src.read_many([start, start + n - 1]), [rows[start], rows[start + n - 1]])
        assert len(src._cache) <= cache
    assert len(decode_counter) == n_groups

    # The last `cache` groups are still decoded; the one before them was evicted.
    decode_counter.clear()
    for start, _ in layout[-cache:]:
        src.read_many([start])
    assert decode_counter == []
    start_evicted = layout[-cache - 1][0]
    _assert_value_equal(src[start_evicted], rows[start_evicted])
    assert len(decode_counter) == 1
    assert len(src._cache) <= cache


def test_parquet_lru_order(pq_files, decode_counter):
    paths, _, layout = pq_files
    src = S.ParquetSource([str(p) for p in paths], cache_row_groups=3)
    first = [start for start, _ in layout]
    for g in (0, 1, 2):
        src[first[g]]
    assert len(decode_counter) == 3
    src[first[0] + 1]  # hit: group 0 becomes most recently used
    assert len(decode_counter) == 3
    src[first[3]]  # evicts group 1 (least recently used), not group 0
    assert len(decode_counter) == 4
    src[first[0]]
    src[first[2]]
    assert len(decode_counter) == 4
    src[first[1]]
    assert len(decode_counter) == 5


def test_parquet_int64_column_with_nulls_keeps_exact_values(tmp_path):
    """A null in an int64 column must not turn the other values of its row group into float64."""
    p = tmp_path / "nulls.parquet"
    big = 2**60 + 1  # not representable as float64
    table = pa.table(
        {
            "id": pa.array([big, None, 3, big + 2], type=pa.int64()),
            "tokens": pa.array([[1, 2], None, [], [7]], type=pa.list_(pa.int32())),
            "text": pa.array(["a", None, "c", "d"]),
        }
    )
    pq.write_table(table, p)
    want = pq.read_table(p).to_pylist()
    got = S.ParquetSource(p).read_many([0, 2, 3])
    for g, w in zip(got, [want[0], want[2], want[3]]):
        assert g["text"] == w["text"]
        assert np.asarray(g["tokens"]).tolist() == w["tokens"]
        assert type(g["id"]) is np.int64, f"int64 value came back as {type(g['id']).__name__}"
        assert int(g["id"]) == w["id"]
        assert g["tokens"].dtype == np.int32


def _typed_columns() -> tuple[pa.Table, dict]:
    """12 rows in 3 row groups of 4; only the middle row group holds nulls (row 5 in every
    column, and null list elements in row 6). Returns the table and, per column, the NumPy
    type of its non-null values (list columns: the dtype of their 1-D arrays)."""
    rows = range(12)
    null = {5}

    def col(make, type_):
        return pa.array([None if i in null else make(i) for i in rows], type=type_)

    t0 = datetime.datetime(2024, 1, 1, 12, 0, 0)
    table = pa.table(
        {
            "i64": col(lambda i: 2**60 + i, pa.int64()),
            "i32": col(lambda i: -i, pa.int32()),
            "u8": col(lambda i: i, pa.uint8()),
            "f64": col(lambda i: i / 3, pa.float64()),
            "f32": col(lambda i: i / 4, pa.float32()),
            "b": col(lambda i: i % 2 == 0, pa.bool_()),
            "ts": col(lambda i: t0 + datetime.timedelta(seconds=i), pa.timestamp("us")),
            "ts_utc": col(lambda i: t0 + datetime.timedelta(milliseconds=i), pa.timestamp("ms", tz="UTC")),
            "date": col(lambda i: datetime.date(2024, 1, 1 + i), pa.date32()),
            "s": col(lambda i: f"row{i}", pa.string()),
            "bin": col(lambda i: bytes([i, 0, i]), pa.binary()),
            "l_i32": pa.array(
                [None if i in null else ([i, None, i] if i == 6 else [i] * (i % 3)) for i in rows],
                type=pa.list_(pa.int32()),
            ),
            "l_f64": col(lambda i: [i / 2, i / 5], pa.list_(pa.float64())),
            "l_large": col(lambda i: list(range(i)), pa.large_list(pa.int64())),
            "fixed": pa.array(
                [None if i in null else ([None, i] if i == 6 else [i, -i]) for i in rows], type=pa.list_(pa.int16(), 2)
            ),
            "l_s": col(lambda i: [f"a{i}", f"b{i}"], pa.list_(pa.string())),
        }
    )
    want = {
        "i64": np.int64,
        "i32": np.int32,
        "u8": np.uint8,
        "f64": np.float64,
        "f32": np.float32,
        "b": np.bool_,
        "ts": np.dtype("datetime64[us]"),
        "ts_utc": np.dtype("datetime64[ms]"),
        "date": np.dtype("datetime64[D]"),
        "s": str,
        "bin": bytes,
        "l_i32": np.int32,
        "l_f64": np.float64,
        "l_large": np.int64,
        "fixed": np.int16,
        "l_s": object,
    }
    return table, want


@pytest.mark.parametrize("name", list(_typed_columns()[1]))
def test_parquet_value_types_do_not_depend_on_row_group_nulls(tmp_path, name):
    """A column's non-null values have one type in every row group, with or without nulls."""
    table, want = _typed_columns()
    path = tmp_path / "typed.parquet"
    pq.write_table(table, path, row_group_size=4)
    md = pq.ParquetFile(path).metadata
    assert [md.row_group(g).num_rows for g in range(md.num_row_groups)] == [4, 4, 4]
    expected = [row[name] for row in pq.read_table(path).to_pylist()]
    ids = np.arange(12)[::-1]  # rows of all three row groups, in one read
    got = {i: r[name] for i, r in zip(ids.tolist(), S.ParquetSource(path).read_many(ids))}
    kind = want[name]
    is_list = name.startswith(("l_", "fixed"))

    assert got[5] is None
    seen: dict = {}  # (type, dtype) of a value -> rows where it was seen
    for i in [i for i in range(12) if i != 5]:
        v = got[i]
        if is_list and expected[i] is not None and None in expected[i]:  # a list holding a null element
            assert isinstance(v, np.ndarray) and v.dtype == object, (i, v)
            assert {type(x) for x in v if x is not None} == {np.dtype(kind).type}, (i, v)
            assert [None if x is None else x.item() for x in v] == expected[i]
            continue
        seen.setdefault((type(v), getattr(v, "dtype", None)), []).append(i)
        if is_list:
            assert v.ndim == 1 and v.tolist() == expected[i], (i, v)
        else:
            plain = v.item() if isinstance(v, np.generic) else v
            if name == "ts_utc":
                plain = plain.replace(tzinfo=datetime.UTC)
            assert plain == expected[i], (i, v)
    assert len(seen) == 1, f"{name}: value types differ between row groups: {seen}"
    ((typ, dtype),) = seen
    if kind in (str, bytes):
        assert typ is kind
    elif is_list:
        assert typ is np.ndarray and dtype == np.dtype(kind)
    else:
        assert typ is np.dtype(kind).type and dtype == np.dtype(kind)


# --------------------------------------------------------------------------- TensorStore


_TS_CASES = [
    ("zarr", np.int32, (45, 3, 2)),
    ("zarr3", np.float32, (45, 4)),
    ("zarr3", np.int64, (45,)),
    ("zarr", np.uint8, (45, 2, 2, 2)),
]


@pytest.fixture(params=_TS_CASES, ids=lambda c: f"{c[0]}-{np.dtype(c[1]).name}-{len(c[2])}d")
def zarr_array(request, tmp_path):
    driver, dtype, shape = request.param
    rng = np.random.default_rng(len(shape))
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path / f"arr_{driver}"
    spec = write_zarr(path, driver, a)
    return path, spec, a


@pytest.mark.parametrize("open_by", ["path_str", "pathlike", "spec"])
def test_tensorstore_rows(zarr_array, open_by):
    path, spec, a = zarr_array
    src = S.TensorStoreSource({"path_str": str(path), "pathlike": path, "spec": spec}[open_by])
    assert len(src) == a.shape[0]
    rng = np.random.default_rng(4)
    id_sets = [
        rng.integers(0, a.shape[0], 60),  # random, unsorted, repeats
        np.arange(10, 25),  # contiguous
        np.array([14, 12, 13, 12, 14]),  # contiguous set, permuted, repeats
        np.array([a.shape[0] - 1]),
        np.arange(a.shape[0])[::-1],
    ]
    for ids in id_sets:
        got = src.read_many(ids)
        _assert_records_equal(got, [a[i] for i in ids])
    _assert_value_equal(src[5], a[5])


def test_tensorstore_dict_of_specs(tmp_path):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (30, 4, 4)).astype(np.uint8)
    lab = rng.integers(0, 10, (30,)).astype(np.int64)
    write_zarr(tmp_path / "img", "zarr", img)
    lab_spec = write_zarr(tmp_path / "lab", "zarr3", lab)
    src = S.TensorStoreSource({"image": str(tmp_path / "img"), "label": lab_spec})
    assert len(src) == 30
    assert src.name == "image+label"
    ids = np.array([29, 0, 7, 7, 13, 2])
    _assert_records_equal(src.read_many(ids), [{"image": img[i], "label": lab[i]} for i in ids])
    _assert_records_equal(src.read_many(np.arange(5, 9)), [{"image": img[i], "label": lab[i]} for i in range(5, 9)])
    with pytest.raises(IndexError, match=r"record 30 out of range \[0, 30\)"):
        src.read_many([30])


def test_tensorstore_mismatched_first_dims(tmp_path):
    write_zarr(tmp_path / "a", "zarr", np.zeros((10, 2), np.float32))
    write_zarr(tmp_path / "b", "zarr3", np.zeros((11,), np.int32))
    with pytest.raises(ValueError, match="first dimension"):
        S.TensorStoreSource({"a": str(tmp_path / "a"), "b": str(tmp_path / "b")})


# --------------------------------------------------------------------------- ArraySource / SequenceSource


def test_array_source_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    y = np.arange(20, dtype=np.int64) * 7
    src = S.ArraySource({"x": x, "y": y})
    assert len(src) == 20
    ids = np.array([19, 0, 5, 5, 11])
    _assert_records_equal(src.read_many(ids), [{"x": x[i], "y": y[i]} for i in ids])
    with pytest.raises(IndexError, match=r"record 20 out of range \[0, 20\)"):
        src.read_many([20])
    with pytest.raises(ValueError, match="share their first dimension"):
        S.ArraySource({"x": x, "y": y[:5]})
    with pytest.raises(ValueError, match="share their first dimension"):
        S.ArraySource({"x": np.float32(1.0)})
    with pytest.raises(TypeError, match="expects an array or a non-empty dict"):
        S.ArraySource([x])


class _GetItemOnly:
    def __init__(self, data):
        self.data = data
        self.getitem_calls: list = []

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.getitem_calls.append(i)
        return self.data[i]


class _WithGetItems(_GetItemOnly):
    def __init__(self, data, drop: int = 0):
        super().__init__(data)
        self.getitems_calls: list = []
        self.drop = drop

    def __getitems__(self, ids):
        self.getitems_calls.append(list(ids))
        out = [self.data[i] for i in ids]
        return out[: len(out) - self.drop]


def test_sequence_source_uses_getitems_once():
    data = [f"item{i}".encode() for i in range(50)]
    obj = _WithGetItems(data)
    src = S.SequenceSource(obj)
    ids = [49, 3, 3, 0, 17]
    assert src.read_many(np.asarray(ids)) == [data[i] for i in ids]
    assert obj.getitems_calls == [ids]
    assert obj.getitem_calls == []
    assert all(type(i) is int for i in obj.getitems_calls[0])


def test_sequence_source_falls_back_to_getitem():
    data = [{"v": i * i} for i in range(30)]
    obj = _GetItemOnly(data)
    src = S.SequenceSource(obj)
    assert len(src) == 30
    ids = [29, 1, 1, 8]
    assert src.read_many(ids) == [data[i] for i in ids]
    assert obj.getitem_calls == ids
    with pytest.raises(IndexError, match=r"record 30 out of range \[0, 30\)"):
        src.read_many([30])


def test_sequence_source_wrong_length_getitems_raises():
    src = S.SequenceSource(_WithGetItems(list(range(10)), drop=1), name="shorty")
    with pytest.raises(quern.SourceError, match="shorty"):
        src.read_many([1, 2, 3])


def test_as_source_dispatch():
    arr_src = S.ArraySource({"x": np.arange(3)})
    assert S.as_source(arr_src) is arr_src
    a = S.as_source({"x": np.arange(4) * 2})
    assert isinstance(a, S.ArraySource)
    _assert_records_equal(a.read_many([3, 0]), [{"x": np.int64(6)}, {"x": np.int64(0)}])
    s = S.as_source(["a", "b", "c"])
    assert isinstance(s, S.SequenceSource)
    assert s.read_many([2, 0]) == ["c", "a"]
    with pytest.raises(TypeError, match="needs __len__ and __getitem__"):
        S.as_source(42)


# --------------------------------------------------------------------------- all sources


@pytest.fixture
def every_source(tmp_path, ar_shards, pq_files):
    """name -> (factory building a fresh source, expected record for each id)."""
    ar_paths, ar_recs = ar_shards
    ar_flat = [r for rs in ar_recs for r in rs]
    pq_paths, pq_rows, _ = pq_files
    rng = np.random.default_rng(8)
    a3 = rng.integers(-50, 50, (40, 3, 2)).astype(np.int32)
    a2 = rng.standard_normal((40, 5)).astype(np.float32)
    write_zarr(tmp_path / "z2", "zarr", a3)
    spec3 = write_zarr(tmp_path / "z3", "zarr3", a2)
    seq = [f"seq-{i}" for i in range(25)]
    x = rng.standard_normal((33, 2))
    return {
        "array_record": (lambda: S.ArrayRecordSource(str(ar_paths[0].parent / "*.array_record")), ar_flat),
        "parquet": (lambda: S.ParquetSource([str(p) for p in pq_paths], cache_row_groups=2), pq_rows),
        "zarr": (lambda: S.TensorStoreSource(str(tmp_path / "z2")), list(a3)),
        "zarr3_spec": (lambda: S.TensorStoreSource(spec3), list(a2)),
        "tensorstore_dict": (
            lambda: S.TensorStoreSource({"a": tmp_path / "z2", "b": spec3}),
            [{"a": a3[i], "b": a2[i]} for i in range(40)],
        ),
        "arrays": (lambda: S.ArraySource({"x": x}), [{"x": x[i]} for i in range(33)]),
        "sequence": (lambda: S.SequenceSource(seq), seq),
    }


_SOURCE_KINDS = ["array_record", "parquet", "zarr", "zarr3_spec", "tensorstore_dict", "arrays", "sequence"]


@pytest.mark.parametrize("kind", _SOURCE_KINDS)
def test_pickle_after_reading(every_source, kind):
    make, expected = every_source[kind]
    src = make()
    fresh_blob = pickle.dumps(src)
    ids = np.random.default_rng(1).integers(0, len(expected), 50)
    _assert_records_equal(src.read_many(ids), [expected[i] for i in ids])  # opens handles, fills caches

    blob = pickle.dumps(src)
    # Open handles and decoded caches are not part of the pickled state.
    assert blob == fresh_blob
    clone = pickle.loads(blob)
    assert len(clone) == len(expected)
    assert clone.name == src.name
    _assert_records_equal(clone.read_many(ids), [expected[i] for i in ids])
    _assert_records_equal(clone.read_many(np.arange(len(expected))), expected)
    # The original keeps working after having been pickled.
    _assert_records_equal(src.read_many(ids[::-1]), [expected[i] for i in ids[::-1]])
    # And a clone of the clone, after the clone has read.
    _assert_records_equal(pickle.loads(pickle.dumps(clone)).read_many(ids), [expected[i] for i in ids])


@pytest.mark.parametrize("kind", _SOURCE_KINDS)
def test_read_many_of_no_ids_is_empty(every_source, kind):
    make, _ = every_source[kind]
    src = make()
    assert list(src.read_many(np.array([], dtype=np.int64))) == []
    assert list(src.read_many([])) == []


# --------------------------------------------------------------------------- identity


def test_array_record_identity(ar_shards):
    paths, recs = ar_shards
    src = S.ArrayRecordSource([str(p) for p in paths])
    ident = src.identity()
    assert ident["type"] == "ArrayRecordSource"
    assert ident["len"] == sum(map(len, recs))
    assert [{k: v for k, v in f.items() if k != "sample"} for f in ident["files"]] == [
        {"file": p.name, "size": os.path.getsize(p), "records": len(r)} for p, r in zip(paths, recs)
    ]
    assert len({f["sample"] for f in ident["files"]}) == len(paths)  # a content sample per file
    json.dumps(ident)  # fingerprint material must be JSON-serialisable
    assert S.ArrayRecordSource([str(p) for p in paths]).identity() == ident  # stable

    # Rewrite shard 1 with more (incompressible) data: the identity of the data changes.
    old_size = os.path.getsize(paths[1])
    bigger = recs[1] + [np.random.default_rng(5).bytes(4000) for _ in range(40)]
    write_array_record(paths[1], bigger)
    assert os.path.getsize(paths[1]) != old_size
    ident2 = S.ArrayRecordSource([str(p) for p in paths]).identity()
    assert ident2 != ident
    assert {k: v for k, v in ident2["files"][1].items() if k != "sample"} == {
        "file": paths[1].name,
        "size": os.path.getsize(paths[1]),
        "records": len(bigger),
    }
    assert ident2["files"][1]["sample"] != ident["files"][1]["sample"]
    assert ident2["files"][0] == ident["files"][0]
    assert ident2["len"] == ident["len"] + 40


def test_parquet_identity(pq_files):
    paths, rows, _ = pq_files
    src = S.ParquetSource([str(p) for p in paths], columns=["id"])
    ident = src.identity()
    assert ident["type"] == "ParquetSource"
    assert ident["columns"] == ["id"]
    assert ident["len"] == len(rows)
    assert [{k: v for k, v in f.items() if k != "sample"} for f in ident["files"]] == [
        {"file": p.name, "size": os.path.getsize(p), "records": pq.ParquetFile(p).metadata.num_rows} for p in paths
    ]
    json.dumps(ident)
    assert S.ParquetSource([str(p) for p in paths], columns=["id", "text"]).identity() != ident

    old_size = os.path.getsize(paths[0])
    pq.write_table(_parquet_table(np.random.default_rng(3), 250, 0), paths[0], row_group_size=64)
    assert os.path.getsize(paths[0]) != old_size
    ident2 = S.ParquetSource([str(p) for p in paths], columns=["id"]).identity()
    assert ident2 != ident
    assert {k: v for k, v in ident2["files"][0].items() if k != "sample"} == {
        "file": paths[0].name,
        "size": os.path.getsize(paths[0]),
        "records": 250,
    }


def test_array_source_identity_tracks_content():
    x = np.arange(12, dtype=np.int32).reshape(6, 2)
    i1 = S.ArraySource({"x": x}).identity()
    assert S.ArraySource({"x": x.copy()}).identity() == i1
    y = x.copy()
    y[3, 1] += 1
    assert S.ArraySource({"x": y}).identity() != i1
    assert S.ArraySource({"x": x.astype(np.int64)}).identity() != i1


# --------------------------------------------------------------------------- bad files


def test_missing_files_raise_file_not_found(tmp_path, ar_shards, pq_files):
    ar_paths, _ = ar_shards
    pq_paths, _, _ = pq_files
    cases = [
        (S.ArrayRecordSource, tmp_path / "missing.array_record", "missing.array_record"),
        (S.ArrayRecordSource, str(tmp_path / "nomatch-*.array_record"), "nomatch-*.array_record"),
        (S.ArrayRecordSource, [str(ar_paths[0]), str(tmp_path / "gone.array_record")], "gone.array_record"),
        (S.ParquetSource, tmp_path / "missing.parquet", "missing.parquet"),
        (S.ParquetSource, str(tmp_path / "nomatch-*.parquet"), "nomatch-*.parquet"),
        (S.ParquetSource, [pq_paths[0], tmp_path / "gone.parquet"], "gone.parquet"),
        (S.TensorStoreSource, tmp_path / "missing_zarr", "missing_zarr"),
    ]
    for cls, arg, needle in cases:
        with pytest.raises(FileNotFoundError) as ei:
            cls(arg)
        assert needle in str(ei.value), (cls.__name__, str(ei.value))


def test_tensorstore_missing_or_not_zarr(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="empty_dir"):
        S.TensorStoreSource(str(tmp_path / "empty_dir"))
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "missing_zarr")}}
    with pytest.raises(quern.SourceError, match="missing_zarr"):
        S.TensorStoreSource(spec)
    with pytest.raises(quern.SourceError, match="missing_zarr3"):
        S.TensorStoreSource(
            {"x": {**spec, "driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "missing_zarr3")}}}
        )


@pytest.fixture
def one_ar_file(tmp_path):
    """One ArrayRecord file of 100 incompressible 2000-byte records (~200 KB of chunks)."""
    rng = np.random.default_rng(21)
    recs = [rng.bytes(2000) for _ in range(100)]
    p = tmp_path / "good.array_record"
    write_array_record(p, recs)
    return p, recs


@pytest.mark.parametrize("damage", ["truncated_half", "empty", "text_70k", "random_200k", "parquet_file"])
def test_damaged_array_record_file_raises_naming_file(tmp_path, one_ar_file, pq_files, damage):
    good, _ = one_ar_file
    data = good.read_bytes()
    bad = tmp_path / f"bad_{damage}.array_record"
    if damage == "truncated_half":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "text_70k":  # above ArrayRecord's 64 KiB minimum, so the footer parser runs
        bad.write_bytes(b"this is a plain text file, not an array record\n" * 1500)
    elif damage == "random_200k":
        bad.write_bytes(np.random.default_rng(0).bytes(200_000))
    elif damage == "parquet_file":
        bad.write_bytes(pq_files[0][0].read_bytes())
    out = _probe("ArrayRecordSource", bad, cwd=tmp_path)
    failure = out["open"] or (out["reads"][0].get("error") if out.get("reads") else None)
    assert failure is not None, f"damaged file read without error: {out.get('len')} records"
    _assert_error_names_file(failure, bad)


def test_corrupted_array_record_fails_at_read_naming_file(tmp_path, one_ar_file):
    good, recs = one_ar_file
    data = bytearray(good.read_bytes())
    mid = len(recs) * 2000 * 2 // 5  # 40% into the ~200 KB of record chunks
    for i in range(mid, mid + 64):
        data[i] ^= 0xFF
    bad = tmp_path / "flipped.array_record"
    bad.write_bytes(bytes(data))

    out = _probe("ArrayRecordSource", bad, reads=["all", [0, 1], [99], "all"], cwd=tmp_path)
    assert out["open"] is None, out["open"]  # header and footer are intact
    assert out["len"] == 100
    all1, first, last, all2 = out["reads"]
    assert "error" in all1, "reading every record of a corrupted file succeeded"
    _assert_error_names_file(all1["error"], bad)
    # Records far from the damage still read correctly, also after the failed read.
    assert first.get("ok") == [{"hex": recs[0].hex()}, {"hex": recs[1].hex()}], first
    assert last.get("ok") == [{"hex": recs[99].hex()}], last
    assert "error" in all2
    _assert_error_names_file(all2["error"], bad)


@pytest.mark.parametrize(
    "damage", ["truncated_half", "empty", "random", "magic_and_garbage_footer", "array_record_file"]
)
def test_damaged_parquet_file_raises_naming_file(tmp_path, pq_files, one_ar_file, damage):
    data = pq_files[0][0].read_bytes()
    bad = tmp_path / f"bad_{damage}.parquet"
    rng = np.random.default_rng(1)
    if damage == "truncated_half":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "random":
        bad.write_bytes(rng.bytes(50_000))
    elif damage == "magic_and_garbage_footer":
        bad.write_bytes(b"PAR1" + rng.bytes(5000) + (4000).to_bytes(4, "little") + b"PAR1")
    elif damage == "array_record_file":
        bad.write_bytes(one_ar_file[0].read_bytes())
    out = _probe("ParquetSource", bad, cwd=tmp_path)
    failure = out["open"] or (out["reads"][0].get("error") if out.get("reads") else None)
    assert failure is not None, "damaged Parquet file read without error"
    _assert_error_names_file(failure, bad)


def test_corrupted_parquet_data_page_fails_at_read_naming_file(tmp_path):
    """Snappy-compressed data page with flipped bytes.

    Corruption pattern: XOR 0xFF over the middle half of the ``tokens`` data page of
    the middle row group (about the middle of the file). Dictionary encoding is off
    and the token values are small, so the page is a snappy stream full of copy
    tags, which snappy rejects when damaged. (Flipping bytes inside a long snappy
    *literal* -- e.g. random float64 data -- decodes silently to wrong values in
    pyarrow too; no checksum covers it unless page checksums are written and
    verified.) The test first checks that pyarrow itself detects this corruption.
    """
    rng = np.random.default_rng(0)
    p = tmp_path / "corrupt.parquet"
    table = _parquet_table(rng, 256, 0)
    pq.write_table(table, p, row_group_size=64, compression="snappy", use_dictionary=False)
    want = pq.read_table(p).to_pylist()
    md = pq.ParquetFile(p).metadata
    assert md.num_row_groups == 4
    bad_group = 2
    cc = md.row_group(bad_group).column(0)
    assert cc.path_in_schema.startswith("tokens")
    off, size = cc.data_page_offset, cc.total_compressed_size
    data = bytearray(p.read_bytes())
    for i in range(off + size // 4, off + 3 * size // 4):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))

    bad_ids = [bad_group * 64 + 5, bad_group * 64 + 60]
    good_ids = [3, 64 + 10, 255]
    out = _probe("ParquetSource", p, reads=[good_ids, bad_ids, "all", good_ids], pyarrow_groups=range(4), cwd=tmp_path)
    # Precondition: pyarrow itself rejects exactly the damaged row group.
    assert [e is not None for e in out["pyarrow"]] == [False, False, True, False], out["pyarrow"]
    assert out["open"] is None, out["open"]  # footer intact: the error must come from read_many
    assert out["len"] == 256
    good1, bad_read, all_read, good2 = out["reads"]
    for r in (good1, good2):
        assert "ok" in r, r
        assert r["ok"] == [want[i] for i in good_ids]  # JSON round trip of pyarrow-equal rows
    for r in (bad_read, all_read):
        assert "error" in r, "reading the corrupted row group succeeded"
        _assert_error_names_file(r["error"], p)


@pytest.mark.parametrize("driver,chunk_file", [("zarr", "1.0"), ("zarr3", "c/1/0")])
def test_damaged_zarr_chunk_raises_naming_file(tmp_path, driver, chunk_file):
    a = np.arange(30 * 4, dtype=np.int16).reshape(30, 4)
    path = tmp_path / f"damaged_{driver}"
    write_zarr(path, driver, a)
    chunk = path / chunk_file
    b = chunk.read_bytes()
    chunk.write_bytes(b[: len(b) // 2])
    out = _probe("TensorStoreSource", path, reads=[[0, 1], [8], "all"], cwd=tmp_path)
    assert out["open"] is None
    ok_read, bad_read, all_read = out["reads"]
    assert ok_read.get("ok") == a[[0, 1]].tolist()  # rows 0..6 live in an intact chunk
    for r in (bad_read, all_read):
        assert "error" in r, r
        _assert_error_names_file(r["error"], path)


# --------------------------------------------------------------------------- nulls, read-only cache, limits


def _plain(v):
    return v.tolist() if isinstance(v, np.ndarray) else (v.item() if isinstance(v, np.generic) else v)


def test_parquet_nulls_are_none_in_every_column_type(tmp_path):
    table = pa.table(
        {
            "l": pa.array([[1, 2], None, [3, None], [4]], type=pa.list_(pa.int64())),
            "f": pa.array([1.5, None, 2.5, 3.0]),
            "i": pa.array([1, 2, None, 2**60 + 1]),
            "fs": pa.array([[1, 2], [3, 4], None, [5, 6]], type=pa.list_(pa.int32(), 2)),
            "s": pa.array(["a", None, "c", "d"]),
        }
    )
    path = tmp_path / "nulls.parquet"
    pq.write_table(table, path, row_group_size=2)
    got = S.ParquetSource(path).read_many(np.arange(4))
    assert [{k: _plain(v) for k, v in r.items()} for r in got] == table.to_pylist()


def test_parquet_cached_arrays_are_read_only(tmp_path):
    path = tmp_path / "flags.parquet"
    pq.write_table(
        pa.table({"flags": pa.array([[True, False]] * 8, type=pa.list_(pa.bool_()))}), path, row_group_size=4
    )
    src = S.ParquetSource(path)

    def flip(rec):
        rec["flags"][0] = ~rec["flags"][0]
        return rec

    with pytest.raises(quern.StepError, match="read-only"):
        quern.Pipeline.from_source(src).map(flip).batch(2).batch_at(0)
    copying = quern.Pipeline.from_source(src).map(lambda r: {"flags": ~r["flags"]}).batch(2)
    first = copying.batch_at(0)["flags"]
    np.testing.assert_array_equal(copying.batch_at(0)["flags"], first)
    assert first[:, 0].tolist() == [False, False]


def test_parquet_columns_may_be_one_name(pq_files):
    paths, rows, _ = pq_files
    rec = S.ParquetSource(paths, columns="id")[3]
    assert list(rec) == ["id"] and rec["id"] == rows[3]["id"]


def test_array_record_keeps_at_most_max_open_files_readers(tmp_path):
    paths = []
    for i in range(20):
        p = tmp_path / f"s-{i:03d}.array_record"
        write_array_record(p, [bytes([i, j]) for j in range(3)])
        paths.append(p)
    fds_before = len(os.listdir("/proc/self/fd"))
    src = S.ArrayRecordSource(str(tmp_path / "*.array_record"), max_open_files=3)
    got = src.read_many(np.arange(60)[::-1])
    assert [bytes(r) for r in got] == [bytes([i // 3, i % 3]) for i in range(60)][::-1]
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 3


def test_tensorstore_domain_with_nonzero_origin(tmp_path):
    arr = np.arange(40 * 2, dtype=np.int32).reshape(40, 2)
    st = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "z")}},
        create=True,
        dtype=ts.int32,
        shape=arr.shape,
    ).result()
    st.write(arr).result()
    src = S.TensorStoreSource(st[20:30].spec())
    assert len(src) == 10
    np.testing.assert_array_equal(np.stack(src.read_many([0, 1, 9])), arr[[20, 21, 29]])


def test_block_shuffle_over_parquet_reads_few_row_groups_per_step(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(1000)}), path, row_group_size=50)
    src = S.ParquetSource(path)
    pipe = quern.Pipeline.from_source(src, seed=4, num_epochs=1).shuffle("block", window=2).batch(100)
    assert pipe.stream.block_size == 50  # the row-group size
    ids = np.concatenate([pipe.batch_at(s)["id"] for s in range(10)])
    assert np.array_equal(np.sort(ids), np.arange(1000)) and not np.array_equal(ids, np.arange(1000))
    for s in range(10):  # a step of 100 positions = one window of 2 blocks = 2 row groups
        groups = {int(i) // 50 for i in pipe.batch_at(s)["id"]}
        assert len(groups) == 2
    global_groups = [
        len({int(i) // 50 for i in quern.Pipeline.from_source(src, seed=4).shuffle().batch(100).batch_at(s)["id"]})
        for s in range(5)
    ]
    assert min(global_groups) > 10  # a global shuffle touches most row groups every step


def test_parquet_cache_is_bounded_by_bytes(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"x": np.arange(1000, dtype=np.int64)}), path, row_group_size=100)  # 800 B per group
    roomy = S.ParquetSource(path)
    roomy.read_many(np.arange(1000))
    assert len(roomy._cache) == 10
    tight = S.ParquetSource(path, cache_bytes=2500)
    got = tight.read_many(np.arange(1000)[::-1])
    assert [int(r["x"]) for r in got] == list(range(999, -1, -1))
    assert len(tight._cache) == 3 and tight._cached_bytes <= 2500
