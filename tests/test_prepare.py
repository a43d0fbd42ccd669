"""Tests of prepare/ (inputs.py, records.py, shards.py, run.py, processes.py).

quern prepare: small files, JSON lines, Parquet and ArrayRecord in; ArrayRecord shards with a
manifest and a metadata index out; ArrayRecordSource reading a prepared folder; filters,
length index, packing and host balancing from the metadata.

Every input is written here, in ``tmp_path``, with its own library (plain files, JSON lines,
pyarrow.parquet, ArrayRecordWriter), and every expected record, length and field value is
computed here from what the test wrote, never taken from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prepared_records, tree, write_array_record

import quern
from quern.pipeline.definition import scan
from quern.prepare import PrepareError, parse_size, prepare, verify
from quern.transforms import decode, metadata_range

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- helpers


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _random_files(root, rng, count, lo, hi) -> list[tuple[str, bytes]]:
    """``count`` files of random bytes (sizes in ``[lo, hi)``) in two folders; ``[(rel, bytes)]`` sorted by path."""
    files = []
    for i in range(count):
        rel = f"{'sub' if i % 3 == 0 else 'top'}/f{i:04d}.bin"
        data = rng.integers(0, 256, size=int(rng.integers(lo, hi)), dtype=np.uint8).tobytes()
        _write(os.path.join(root, rel), data)
        files.append((rel, data))
    return sorted(files)


def to_tokens(data) -> np.ndarray:
    """The map of several tests: bytes or text -> int32 tokens (signed, so a wrong dtype shows)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32) - 100


def first_three(tokens):
    """A pipeline transform that changes the lengths: every record cut to 3 tokens."""
    return tokens[:3]


def _raise(*args, **kwargs):
    raise AssertionError("this must not be called")


def _prepare(inp, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    return prepare(inp, out, **kw)


# --------------------------------------------------------------------------- 1. small files


def test_small_files_tree_records_in_sorted_relative_path_order(tmp_path):
    root = tmp_path / "docs"
    files = {
        "b/z.bin": bytes(range(256)) * 3,
        "a.txt": b"first text\n",
        "a-b.txt": "dash \u00e9\n".encode(),  # '-' < '.' < '/': the order of strings, not of path parts
        "a/b/c.txt": b"nested deeply",
        "a/empty": b"",
        "A.txt": b"upper case sorts first",
        "b/y.txt": b"\x00\xff\x00 binary in a .txt",
        "c.dat": bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8)),
    }
    for rel, data in files.items():
        _write(root / rel, data)
    order = sorted(files)  # relative POSIX paths compared as strings, across the whole tree
    assert order[:4] == ["A.txt", "a-b.txt", "a.txt", "a/b/c.txt"]  # the test's own premise

    m = _prepare(root, tmp_path / "out")
    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    assert len(src) == len(files)
    assert list(src.read_many(np.arange(len(src)))) == [files[p] for p in order]
    np.testing.assert_array_equal(src.metadata["length"], [len(files[p]) for p in order])
    assert src.metadata["length"].dtype == np.int64
    assert m["records"]["count"] == len(files) and m["records"]["type"] == "bytes"
    assert src.manifest["records"]["count"] == len(files)

    txt = [p for p in order if p.endswith(".txt")]
    assert len(txt) == 5
    m2 = _prepare(root, tmp_path / "only_txt", include=["*.txt"])
    assert m2["records"]["count"] == len(txt)
    assert prepared_records(tmp_path / "only_txt") == [files[p] for p in txt]


# --------------------------------------------------------------------------- 2. JSON lines

JSON_OBJECTS = [
    {"text": "h\u00e9llo", "score": 0.5, "n": 3, "ok": True},
    {"text": "w\u00f6rld \u2713", "score": 2.0, "n": -7, "ok": False},
    {"text": "", "score": 1000.25, "n": 0, "ok": True},
    {"text": "last line, no newline after it", "score": -1.5, "n": 2**40, "ok": False},
]


def _write_jsonl(path) -> list[bytes]:
    lines = [json.dumps(o, ensure_ascii=False).encode("utf-8") for o in JSON_OBJECTS]
    body = lines[0] + b"\n\n" + lines[1] + b"\n   \n" + lines[2] + b"\n" + lines[3]  # blank lines between
    _write(path, body)
    return lines


def test_jsonl_whole_lines_a_field_and_scalar_fields(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = _write_jsonl(path)

    m = _prepare(path, tmp_path / "lines")
    assert m["records"]["count"] == len(JSON_OBJECTS)
    assert prepared_records(tmp_path / "lines") == lines  # each line's bytes without its newline; blank lines skipped

    _prepare(path, tmp_path / "text", field="text")
    want = [o["text"].encode("utf-8") for o in JSON_OBJECTS]
    assert prepared_records(tmp_path / "text") == want
    src = quern.sources.ArrayRecordSource(tmp_path / "text")
    np.testing.assert_array_equal(src.metadata["length"], [len(w) for w in want])

    _prepare(path, tmp_path / "fields", fields=("score", "n", "ok"))
    meta = quern.sources.ArrayRecordSource(tmp_path / "fields").metadata
    assert set(meta) == {"length", "score", "n", "ok"}
    assert meta["score"].dtype == np.float64 and meta["n"].dtype == np.int64 and meta["ok"].dtype == np.bool_
    np.testing.assert_array_equal(meta["score"], [o["score"] for o in JSON_OBJECTS])
    np.testing.assert_array_equal(meta["n"], [o["n"] for o in JSON_OBJECTS])
    np.testing.assert_array_equal(meta["ok"], [o["ok"] for o in JSON_OBJECTS])
    np.testing.assert_array_equal(meta["length"], [len(line) for line in lines])


# --------------------------------------------------------------------------- 3. Parquet

TEXTS = ["a", "bb", "", "d\u00e9\u00e9", "eeeee"]
BLOBS = [b"\x00\x01", b"\xff" * 7, b"", b"plain", bytes(range(40))]
SCORES = [0.25, 1.5, -2.0, 3.75, 10.0]
NS = [1, 2, 3, 4, 5]


def _write_parquet(path, **columns) -> None:
    pq.write_table(pa.table(columns), path, row_group_size=2)  # 3 row groups: order across them counts


def test_parquet_one_column_is_the_record(tmp_path):
    path = tmp_path / "t.parquet"
    _write_parquet(
        path,
        text=pa.array(TEXTS, pa.string()),
        blob=pa.array(BLOBS, pa.binary()),
        score=pa.array(SCORES, pa.float64()),
    )
    _prepare(path, tmp_path / "blob", columns=["blob"])
    assert prepared_records(tmp_path / "blob") == BLOBS

    _prepare(path, tmp_path / "text", columns=["text"], fields=("score",))
    assert prepared_records(tmp_path / "text") == [t.encode("utf-8") for t in TEXTS]
    meta = quern.sources.ArrayRecordSource(tmp_path / "text").metadata
    np.testing.assert_array_equal(meta["length"], [len(t.encode("utf-8")) for t in TEXTS])
    assert meta["score"].dtype == np.float64
    np.testing.assert_array_equal(meta["score"], SCORES)


def test_parquet_without_columns_the_record_is_the_column_that_is_not_a_field(tmp_path):
    """No ``columns``, one field: the one other column is the record, the field is metadata."""
    path = tmp_path / "t.parquet"
    _write_parquet(path, text=pa.array(TEXTS, pa.string()), score=pa.array(SCORES, pa.float64()))
    _prepare(path, tmp_path / "out", fields=("score",))
    assert prepared_records(tmp_path / "out") == [t.encode("utf-8") for t in TEXTS]
    np.testing.assert_array_equal(quern.sources.ArrayRecordSource(tmp_path / "out").metadata["score"], SCORES)


def test_parquet_list_int32_column_gives_raw_int32_records(tmp_path):
    rows = [[1, 2, 3], [], [-5], list(range(100, 140)), [2**31 - 1, -(2**31)]]
    path = tmp_path / "tok.parquet"
    _write_parquet(path, tokens=pa.array(rows, pa.list_(pa.int32())))
    m = _prepare(path, tmp_path / "out")
    assert m["records"] == {"count": len(rows), "type": "array", "dtype": "int32"}
    assert prepared_records(tmp_path / "out") == [np.asarray(r, dtype=np.int32).tobytes() for r in rows]
    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    np.testing.assert_array_equal(src.metadata["length"], [len(r) for r in rows])


def text_and_double_n(row):
    """A Parquet map: gets the row as a dict of its columns."""
    return {"record": row["text"], "k": row["n"] * 2}


def test_parquet_several_columns_with_a_map_returning_a_dict(tmp_path):
    path = tmp_path / "t.parquet"
    _write_parquet(
        path,
        text=pa.array(TEXTS, pa.string()),
        n=pa.array(NS, pa.int64()),
        score=pa.array(SCORES, pa.float64()),
    )
    m = _prepare(path, tmp_path / "out", map=text_and_double_n, fields=("k",))
    assert m["records"]["count"] == len(TEXTS)
    assert prepared_records(tmp_path / "out") == [t.encode("utf-8") for t in TEXTS]
    meta = quern.sources.ArrayRecordSource(tmp_path / "out").metadata
    assert meta["k"].dtype == np.int64
    np.testing.assert_array_equal(meta["k"], [2 * n for n in NS])
    np.testing.assert_array_equal(meta["length"], [len(t.encode("utf-8")) for t in TEXTS])


# --------------------------------------------------------------------------- 4. ArrayRecord re-shard


def test_array_record_file_and_prepared_folder_are_resharded_in_order(tmp_path):
    rng = np.random.default_rng(4)
    recs = [rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes() for _ in range(60)]
    write_array_record(tmp_path / "in.array_record", recs)

    m1 = _prepare(tmp_path / "in.array_record", tmp_path / "first", shard_size="64KB")
    assert m1["records"]["count"] == len(recs)
    assert prepared_records(tmp_path / "first") == recs
    assert len(m1["shards"]) >= 2  # the folder re-sharded below spans several shards

    m2 = _prepare(tmp_path / "first", tmp_path / "second", shard_size="16KB")
    assert len(m2["shards"]) > len(m1["shards"])
    assert prepared_records(tmp_path / "second") == recs
    np.testing.assert_array_equal(
        quern.sources.ArrayRecordSource(tmp_path / "second").metadata["length"], [len(r) for r in recs]
    )


# --------------------------------------------------------------------------- 5. a map to int32 tokens


def test_map_to_int32_array_is_stored_raw_and_decoded_by_a_pipeline(tmp_path):
    files = {"d0": b"token me", "d1": "\u00e9t\u00e9".encode(), "d2": bytes(range(200, 256)), "d3": b"z"}
    for rel, data in files.items():
        _write(tmp_path / "docs" / rel, data)
    order = sorted(files)
    want = [np.frombuffer(files[p], np.uint8).astype(np.int32) - 100 for p in order]

    m = _prepare(tmp_path / "docs", tmp_path / "out", map=to_tokens)
    assert m["records"] == {"count": len(order), "type": "array", "dtype": "int32"}
    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    assert list(src.read_many(np.arange(len(src)))) == [w.tobytes() for w in want]
    np.testing.assert_array_equal(src.metadata["length"], [len(w) for w in want])

    pipe = quern.Pipeline.from_source(src, seed=0, num_epochs=1).map(decode(np.int32)).batch(1)
    for i, w in enumerate(want):
        got = pipe.batch_at(i)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got[0], w)


# --------------------------------------------------------------------------- 6. parse_size


@pytest.mark.parametrize(
    "text, want",
    [
        ("512KB", 524288),
        ("1MB", 1 << 20),
        ("128MB", 128 << 20),
        ("1GB", 1 << 30),
        ("4096", 4096),
        (4096, 4096),
        (1, 1),
        ("64kb", 64 << 10),
    ],
)
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["12XB", "-1", "", "1.5.5MB", 0, -5, "MB", "0KB"])
def test_parse_size_refuses(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_size(bad)


@pytest.mark.parametrize("bad", [None, 1.5, b"1MB", True])
def test_parse_size_refuses_other_types(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_size(bad)


# --------------------------------------------------------------------------- 7. shard sizes


def test_shards_are_near_their_size(tmp_path):
    files = _random_files(tmp_path / "docs", np.random.default_rng(7), 400, 500, 4600)  # ~1 MB, small files
    target = 64 << 10
    m = _prepare(tmp_path / "docs", tmp_path / "out", shard_size="64KB")
    names = [s["file"] for s in m["shards"]]
    k = len(names)
    assert k >= 8
    assert names == [f"shard-{i:05d}-of-{k:05d}.array_record" for i in range(k)]
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.endswith(".array_record")) == names

    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    assert list(src.read_many(np.arange(len(src)))) == [d for _, d in files]
    sizes = [len(d) for _, d in files]
    biggest = max(sizes)
    totals, at = [], 0
    for s in m["shards"]:  # the bytes of each shard's records, from the test's own file sizes
        totals.append(sum(sizes[at : at + s["records"]]))
        at += s["records"]
    assert at == len(files)
    for t in totals[:-1]:
        assert t >= target // 2, totals
    for t in totals:
        assert t < 3 * target + biggest, totals


# --------------------------------------------------------------------------- 8. determinism, relocation


def test_output_is_byte_identical_for_any_worker_count(tmp_path):
    rng = np.random.default_rng(8)
    objs = [
        {"text": "".join(chr(int(c)) for c in rng.integers(97, 123, int(rng.integers(1, 300)))), "score": i / 8}
        for i in range(300)
    ]
    path = tmp_path / "in.jsonl"
    _write(path, b"".join(json.dumps(o).encode() + b"\n" for o in objs))
    trees = {}
    for w in (0, 1, 2):
        out = tmp_path / f"out{w}"
        prepare(
            path, out, field="text", map=to_tokens, fields=("score",), shard_size="16KB", num_workers=w, progress=False
        )
        trees[w] = tree(out)
    assert sum(n.endswith(".array_record") for n in trees[0]) >= 3  # several shards: the workers share them
    assert trees[1] == trees[0]
    assert trees[2] == trees[0]
    want = [to_tokens(o["text"]).tobytes() for o in objs]
    assert prepared_records(tmp_path / "out2") == want
    np.testing.assert_array_equal(
        quern.sources.ArrayRecordSource(tmp_path / "out2").metadata["score"], [o["score"] for o in objs]
    )


def test_output_does_not_depend_on_the_output_folder(tmp_path):
    _random_files(tmp_path / "docs", np.random.default_rng(9), 50, 0, 3000)
    _prepare(tmp_path / "docs", tmp_path / "one", shard_size="32KB")
    _prepare(tmp_path / "docs", tmp_path / "elsewhere" / "a_different_name", shard_size="32KB")
    one = tree(tmp_path / "one")
    assert "manifest.json" in one and "metadata/length.npy" in one
    assert tree(tmp_path / "elsewhere" / "a_different_name") == one


def test_a_copied_or_moved_folder_opens_and_reads_the_same(tmp_path):
    files = _random_files(tmp_path / "docs", np.random.default_rng(10), 40, 1, 5000)
    _prepare(tmp_path / "docs", tmp_path / "out", shard_size="32KB")
    shutil.copytree(tmp_path / "out", tmp_path / "copies" / "copy")
    os.rename(tmp_path / "out", tmp_path / "moved")
    want = [d for _, d in files]
    for folder in (tmp_path / "copies" / "copy", tmp_path / "moved"):
        verify(folder)
        src = quern.sources.ArrayRecordSource(folder)
        assert list(src.read_many(np.arange(len(src)))) == want
        np.testing.assert_array_equal(src.metadata["length"], [len(d) for d in want])


def _walk_json(value, key=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, None
            yield from _walk_json(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_json(v, key)
    else:
        yield key, value


def test_manifest_holds_no_absolute_path_host_name_or_time(tmp_path):
    _random_files(tmp_path / "docs", np.random.default_rng(11), 10, 1, 100)
    out = tmp_path / "out"
    _prepare(tmp_path / "docs", out, map=to_tokens)
    text = (out / "manifest.json").read_text()
    for path in (tmp_path, tmp_path / "docs", out, os.path.realpath(tmp_path)):
        assert str(path) not in text
    assert os.getcwd() not in text
    host = socket.gethostname()
    if len(host) >= 3:
        assert host not in text
    now = time.time()
    recent = (now - 20 * 365 * 86400, now + 86400)
    for key, value in _walk_json(json.loads(text)):
        assert not re.search(r"time|date|created|modified|stamp|host|when", key, re.I), key
        if isinstance(value, str):
            assert not re.search(r"\d{4}-\d{2}-\d{2}|\d{2}:\d{2}:\d{2}", value), (key, value)
            assert not value.startswith("/"), (key, value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for scale in (1, 1e3, 1e6, 1e9):  # s, ms, us, ns since the epoch
                assert not recent[0] * scale <= value <= recent[1] * scale, (key, value)


# --------------------------------------------------------------------------- 9. metadata in pipelines


def test_metadata_range_filter_reads_no_record(tmp_path, monkeypatch):
    sizes = [5, 0, 17, 3, 9, 17, 2, 30, 9, 12, 4, 5]
    for i, n in enumerate(sizes):
        _write(tmp_path / "docs" / f"r{i:02d}", bytes([i]) * n)
    _prepare(tmp_path / "docs", tmp_path / "out")
    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    monkeypatch.setattr(src, "read_many", _raise)  # any record read fails the test

    lo, hi = 4, 12  # both bounds are lengths present: the range is inclusive
    pipe = quern.Pipeline.from_source(src, seed=0).filter(metadata_range("length", min=lo, max=hi))
    want = [i for i, n in enumerate(sizes) if lo <= n <= hi]
    np.testing.assert_array_equal(pipe.survivors, want)
    assert pipe.stream_len == len(want)

    only_min = quern.Pipeline.from_source(src, seed=0).filter(metadata_range("length", min=17))
    np.testing.assert_array_equal(only_min.survivors, [i for i, n in enumerate(sizes) if n >= 17])
    chained = only_min.filter(metadata_range("length", max=20))
    np.testing.assert_array_equal(chained.survivors, [i for i, n in enumerate(sizes) if 17 <= n <= 20])

    monkeypatch.undo()  # the records the filter keeps are the ones of those lengths
    kept = quern.Pipeline.from_source(src, seed=0, num_epochs=1).filter(metadata_range("length", min=lo, max=hi))
    got = [bytes(kept.batch(1).batch_at(s)[0]) for s in range(len(want))]
    assert got == [bytes([i]) * sizes[i] for i in want]


def test_metadata_filter_on_plain_array_record_files_is_refused(tmp_path):
    write_array_record(tmp_path / "plain.array_record", [b"a", b"bb", b"ccc"])
    src = quern.sources.ArrayRecordSource(str(tmp_path / "plain.array_record"))
    assert not src.has_metadata
    with pytest.raises(ValueError, match="metadata"):
        quern.Pipeline.from_source(src, seed=0).filter(metadata_range("length", min=2))
    with pytest.raises(ValueError, match="metadata"):
        _ = src.metadata


def _token_folder(tmp_path, sizes):
    """A prepared folder of int32 tokens: record ``i`` has ``sizes[i]`` tokens; returns the expected tokens."""
    rng = np.random.default_rng(12)
    docs = []
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        _write(tmp_path / "docs" / f"d{i:03d}", data)
        docs.append(np.frombuffer(data, np.uint8).astype(np.int32) - 100)
    _prepare(tmp_path / "docs", tmp_path / "tokens", map=to_tokens)
    return docs


TOKEN_SIZES = [int(x) for x in (np.arange(40) * 7919) % 29 + 4]  # 4..32 tokens each


def test_length_index_pack_and_balance_hosts_from_the_metadata(tmp_path, monkeypatch):
    docs = _token_folder(tmp_path, TOKEN_SIZES)
    src = quern.sources.ArrayRecordSource(tmp_path / "tokens")
    np.testing.assert_array_equal(src.metadata["length"], TOKEN_SIZES)
    monkeypatch.setattr(scan, "lengths", _raise)  # a scan of the lengths fails the test
    cache = tmp_path / "cache"
    monkeypatch.setenv("QUERN_CACHE_DIR", str(cache))

    pipe = quern.Pipeline.from_source(src, seed=0).map(decode(np.int32))
    idx = pipe.length_index(cache_dir=cache)
    assert idx.dtype == np.int64
    np.testing.assert_array_equal(idx, TOKEN_SIZES)

    seq_len, rows = 16, 8
    packed = pipe.pack(seq_len)
    batch = packed.batch(rows).batch_at(0)
    assert batch["tokens"].shape == (rows, seq_len) and batch["tokens"].dtype == np.int32
    pieces = packed.pieces(np.arange(rows))
    for r in range(rows):
        mine = np.flatnonzero(pieces.row == r)
        want = [docs[int(pieces.ids[k])][pieces.start[k] : pieces.start[k] + pieces.length[k]] for k in mine]
        seg = batch["segment_ids"][r]
        for j, w in enumerate(want):
            np.testing.assert_array_equal(batch["tokens"][r][seg == j + 1], w)

    bal = pipe.balance_hosts().batch(4)
    np.testing.assert_array_equal(bal.stream.host_lengths, TOKEN_SIZES)
    h0, h1 = bal.positions(0, 0, 2), bal.positions(0, 1, 2)
    assert sorted(np.concatenate([h0, h1]).tolist()) == [0, 1, 2, 3]
    assert not (cache / "lengths").exists() or not os.listdir(cache / "lengths")


def test_length_index_is_scanned_when_the_transforms_change_the_lengths(tmp_path):
    _token_folder(tmp_path, TOKEN_SIZES)
    src = quern.sources.ArrayRecordSource(tmp_path / "tokens")
    pipe = quern.Pipeline.from_source(src, seed=0).map(decode(np.int32)).map(first_three)
    idx = pipe.length_index(cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(idx, np.minimum(TOKEN_SIZES, 3))
    assert min(TOKEN_SIZES) > 3  # so the metadata's lengths are all wrong here
    assert len(os.listdir(tmp_path / "cache" / "lengths")) == 1  # the scan wrote its index


# --------------------------------------------------------------------------- 10. the reader


@pytest.fixture
def folder(tmp_path):
    """A prepared folder of 3+ shards of random records; returns (folder, records)."""
    files = _random_files(tmp_path / "docs", np.random.default_rng(13), 30, 200, 3000)
    m = _prepare(tmp_path / "docs", tmp_path / "out", shard_size="16KB")
    assert len(m["shards"]) >= 3
    return tmp_path / "out", [d for _, d in files]


def _shard_names(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".array_record"))


def test_reader_refuses_a_missing_shard(folder):
    out, _ = folder
    gone = _shard_names(out)[1]
    os.remove(out / gone)
    with pytest.raises(quern.SourceError, match=re.escape(gone) + ".*missing"):
        quern.sources.ArrayRecordSource(out)


def test_reader_refuses_a_truncated_shard(folder):
    out, _ = folder
    shard = _shard_names(out)[0]
    os.truncate(out / shard, os.path.getsize(out / shard) - 1)
    with pytest.raises(quern.SourceError, match=re.escape(shard) + ".*bytes"):
        quern.sources.ArrayRecordSource(out)


def test_reader_refuses_a_folder_without_manifest(folder):
    out, _ = folder
    os.remove(out / "manifest.json")
    with pytest.raises(quern.SourceError, match="not a folder written by quern prepare"):
        quern.sources.ArrayRecordSource(out)
    os.mkdir(out / ".quern-prepare")  # what an unfinished prepare leaves
    with pytest.raises(quern.SourceError, match="did not finish"):
        quern.sources.ArrayRecordSource(out)


def test_reader_refuses_a_shard_name_outside_the_folder(folder):
    out, _ = folder
    m = json.loads((out / "manifest.json").read_text())
    shutil.copy(out / m["shards"][0]["file"], out.parent / "x")  # there, of the right size: only the name is wrong
    m["shards"][0]["file"] = "../x"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(quern.SourceError, match=re.escape("'../x'") + ".*inside the folder"):
        quern.sources.ArrayRecordSource(out)


def test_verify_finds_a_same_size_byte_flip_that_opening_does_not(folder):
    out, recs = folder
    shard = _shard_names(out)[0]
    data = bytearray((out / shard).read_bytes())
    at = data.find(recs[0][50:114])  # random bytes: stored as they are
    assert at >= 0
    data[at + 10] ^= 0xFF
    (out / shard).write_bytes(bytes(data))

    src = quern.sources.ArrayRecordSource(out)  # a stat per shard: the same size passes
    assert len(src) == len(recs)
    with pytest.raises(quern.SourceError, match=re.escape(shard)):
        verify(out)


def test_identity_holds_each_shards_sha256(folder):
    out, _ = folder
    src = quern.sources.ArrayRecordSource(out)
    ident = src.identity()
    names = _shard_names(out)
    assert [f["file"] for f in ident["files"]] == names
    assert [f["sha256"] for f in ident["files"]] == [hashlib.sha256((out / n).read_bytes()).hexdigest() for n in names]
    assert [f["size"] for f in ident["files"]] == [os.path.getsize(out / n) for n in names]
    assert str(out) not in json.dumps(ident)


def test_prepare_refuses_an_empty_input(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError):
        _prepare(tmp_path / "empty", tmp_path / "out")


def test_a_shard_is_closed_before_the_item_that_would_take_it_over_its_size():
    from quern.prepare.shards import plan_shards

    assert plan_shards([10] * 10, 35, ratio=1.0) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert plan_shards([10] * 10, 35, ratio=2.0) == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
        (4, 5),
        (5, 6),
        (6, 7),
        (7, 8),
        (8, 9),
        (9, 10),
    ]
    assert plan_shards([10, 100, 10, 10], 35, ratio=1.0) == [(0, 1), (1, 2), (2, 4)]  # a bigger item alone
    assert plan_shards([5], 35, ratio=1.0) == [(0, 1)]


def test_compression_changes_the_bytes_not_the_records(tmp_path):
    docs = tmp_path / "docs"
    text = b"".join(b"line %d of a compressible file\n" % i for i in range(400))
    for i in range(20):
        (docs / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (docs / f"{i:02d}.txt").write_bytes(text)
    sizes = {}
    for c in ("zstd:1", "snappy", "uncompressed"):
        m = prepare(docs, tmp_path / c.replace(":", ""), compression=c, num_workers=0, progress=False)
        assert m["options"]["writer_options"].endswith(c)
        assert prepared_records(tmp_path / c.replace(":", "")) == [text] * 20
        sizes[c] = sum(s["bytes"] for s in m["shards"])
    assert sizes["uncompressed"] >= 20 * len(text) > sizes["zstd:1"]
    for bad in ("zstd:99", "gzip", "", "snappy,group_size:9"):
        with pytest.raises(ValueError, match="compression"):
            prepare(docs, tmp_path / "bad", compression=bad, num_workers=0, progress=False)
    assert not (tmp_path / "bad").exists()
