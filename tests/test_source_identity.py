"""Source identities (pipeline/sources/: ``identity()`` of each source) follow the data's content,
and say exactly what they check.

Files are written by their own libraries (array_record's writer, pyarrow,
TensorStore); the byte ranges a file identity samples are computed here from
the documented rule (whole file up to 1 MiB; else the first 64 KiB, the last
128 KiB and 16 blocks of 4 KiB, one centred in each sixteenth), not taken from
the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_array_record, write_zarr

import quern
from quern import sources as S
from quern.pipeline.core.errors import FingerprintError
from quern.pipeline.sources.base import sample_ids

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _documented_ranges(size: int) -> list[tuple[int, int]]:
    if size <= MiB:
        return [(0, size)]
    blocks = [((2 * j + 1) * size // 32 - 2048, (2 * j + 1) * size // 32 + 2048) for j in range(16)]
    return [(0, 64 << 10), *blocks, (size - (128 << 10), size)]


def _overlaps(start: int, stop: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start < b and a < stop for a, b in ranges)


# --------------------------------------------------------------------------- files


def _array_record_case(tmp_path: Path, n: int, size: int):
    """(path, records, write(records)) for an uncompressed ArrayRecord file of ``n`` random records."""
    rng = np.random.default_rng(n)
    records = [rng.bytes(size) for _ in range(n)]
    path = tmp_path / "data-00000.array_record"
    write_array_record(path, records, "group_size:1,uncompressed")
    return path, records, lambda recs: write_array_record(path, recs, "group_size:1,uncompressed")


def _parquet_case(tmp_path: Path, n: int):
    """(path, values, write(values)) for an uncompressed, plain-encoded int64 Parquet file
    without statistics, so that changing one value keeps the file's size."""
    rng = np.random.default_rng(n)
    values = [v.tobytes() for v in rng.integers(2**40, 2**62, n, dtype=np.int64)]
    path = tmp_path / "data-00000.parquet"

    def write(vals: list[bytes]) -> None:
        table = pa.table({"x": pa.array(np.frombuffer(b"".join(vals), dtype=np.int64))})
        pq.write_table(
            table, path, row_group_size=50_000, compression="none", use_dictionary=False, write_statistics=False
        )

    write(values)
    return path, values, write


def _identity(kind: str, path: Path) -> dict:
    src = S.ArrayRecordSource(path) if kind == "array_record" else S.ParquetSource(path)
    ident = src.identity()
    json.dumps(ident)
    return ident


def _locate(data: bytes, items: list[bytes]) -> list[int]:
    """Byte offset of each random (so unique) item in ``data``, found by a 16-byte window of
    it (riegeli inserts a 24-byte block header every 64 KiB, which may split an item: then
    another window is found and the offset is off by at most those 24 bytes)."""
    offsets = []
    for it in items:
        n = min(16, len(it))
        found = ((w, data.find(it[w : w + n])) for w in range(0, len(it) - n + 1, 256))
        w, o = next((w, o) for w, o in found if o >= 0)
        offsets.append(o - w)
    return offsets


def _covering(data: bytes, items: list[bytes], offset: int) -> int:
    """Index of the random (so unique) item whose bytes in ``data`` cover byte ``offset``:
    the nearest item start at or before it (a riegeli block header may lengthen an item by 24)."""
    starts = {it[:8]: k for k, it in enumerate(items)}
    for o in range(offset, offset - max(map(len, items)) - 24, -1):
        k = starts.get(data[o : o + 8])
        if k is not None:
            assert offset < o + len(items[k]) + 24
            return k
    raise AssertionError(f"no item covers byte {offset}")


def _changed(item: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in item)  # same length, every byte different


@pytest.mark.parametrize(
    "kind,big", [("array_record", False), ("array_record", True), ("parquet", False), ("parquet", True)]
)
def test_same_size_rewrite_in_the_middle_changes_file_identity(tmp_path, kind, big):
    """One record in the middle rewritten at the same size: noticed in a whole-hashed file of at
    most 1 MiB, and in a bigger file when the record overlaps a sampled block (here the block
    centred in the 8th sixteenth, just before the middle of the file)."""
    if kind == "array_record":
        path, items, write = _array_record_case(tmp_path, *((300, 8000) if big else (100, 2000)))
    else:
        path, items, write = _parquet_case(tmp_path, 200_000 if big else 20_000)
    size = path.stat().st_size
    assert (size > MiB) == big
    before = _identity(kind, path)

    write(items)  # identical rewrite: a new modification time, the same identity
    assert _identity(kind, path) == before

    data = path.read_bytes()
    k = _covering(data, items, 15 * size // 32) if big else len(items) // 2  # big: the 8th sixteenth's centre
    assert 0.3 < _locate(data, [items[k]])[0] / size < 0.7  # in the middle, far from the head and the tail
    changed = list(items)
    changed[k] = _changed(items[k])
    write(changed)
    assert path.stat().st_size == size
    after = _identity(kind, path)
    assert after != before
    assert {key: v for key, v in after["files"][0].items() if key != "sample"} == {
        key: v for key, v in before["files"][0].items() if key != "sample"
    }

    write(items)  # the original content again: the original identity
    assert _identity(kind, path) == before


@pytest.mark.parametrize("kind", ["array_record", "parquet"])
def test_file_identity_ignores_directory_and_modification_time(tmp_path, kind):
    """A copy of the data on another host (another directory, other times) keeps its identity."""
    path, _, _ = _array_record_case(tmp_path, 50, 100) if kind == "array_record" else _parquet_case(tmp_path, 1000)
    other = tmp_path / "elsewhere"
    other.mkdir()
    copy = other / path.name
    shutil.copyfile(path, copy)  # new modification time
    assert _identity(kind, copy) == _identity(kind, path)
    renamed = other / ("x" + path.name)
    shutil.copyfile(path, renamed)
    assert _identity(kind, renamed) != _identity(kind, path)  # the file name is part of it


def test_big_file_change_outside_sampled_ranges_is_not_seen(tmp_path):
    """The documented limit, pinned: a same-size change confined to unsampled bytes of a file
    over 1 MiB keeps the identity (so the statement above says exactly what is checked)."""
    path, records, write = _array_record_case(tmp_path, 300, 8000)
    size = path.stat().st_size
    ranges = _documented_ranges(size)
    before = _identity("array_record", path)
    offsets = _locate(path.read_bytes(), records)
    # a record lying wholly between two sampled blocks, with its riegeli chunk header
    k = next(k for k, o in enumerate(offsets) if not _overlaps(o - 64, o + len(records[k]) + 64, ranges))
    changed = list(records)
    changed[k] = _changed(records[k])
    write(changed)
    assert path.stat().st_size == size and path.read_bytes() != b""
    assert _identity("array_record", path) == before
    # and a change touching a sampled block is seen
    k = next(k for k, o in enumerate(offsets) if _overlaps(o, o + len(records[k]), ranges[1:-1]))
    changed = list(records)
    changed[k] = _changed(records[k])
    write(changed)
    assert _identity("array_record", path) != before


# --------------------------------------------------------------------------- TensorStore


@pytest.mark.parametrize("driver", ["zarr", "zarr3"])
def test_tensorstore_identity_follows_content(tmp_path, driver):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, (60, 3)).astype(np.int32)
    path = tmp_path / "z"
    spec = write_zarr(path, driver, a)
    before = S.TensorStoreSource(spec).identity()
    json.dumps(before)
    arr = before["arrays"][""]
    assert arr["shape"] == [60, 3] and arr["dtype"] == "int32"
    assert arr["chunk_layout"]["read_chunk"]["shape"] == [7, 3]
    assert S.TensorStoreSource(str(path)).identity()["arrays"] == before["arrays"]  # path or spec

    write_zarr(path, driver, a.copy())  # the same values rewritten
    assert S.TensorStoreSource(spec).identity() == before
    moved = tmp_path / "elsewhere" / "z"  # the same array copied to another folder
    shutil.copytree(path, moved)
    assert S.TensorStoreSource(str(moved)).identity() == S.TensorStoreSource(str(path)).identity()

    other = rng.integers(0, 1000, a.shape).astype(np.int32)  # other values, same shape and dtype
    write_zarr(path, driver, other)
    changed = S.TensorStoreSource(spec).identity()
    assert changed != before
    assert {k: v for k, v in changed["arrays"][""].items() if k != "sample"} == {
        k: v for k, v in arr.items() if k != "sample"
    }

    for i in (0, 59):  # one value changed in the first or the last row
        b = a.copy()
        b[i, 1] += 1
        write_zarr(path, driver, b)
        assert S.TensorStoreSource(spec).identity() != before, i

    write_zarr(path, driver, a, chunk0=10)  # the same values in another chunk layout
    relaid = S.TensorStoreSource(spec).identity()
    assert relaid["arrays"][""]["chunk_layout"]["read_chunk"]["shape"] == [10, 3]
    assert relaid != before


def test_tensorstore_dict_identity_follows_each_array(tmp_path):
    img = np.arange(30 * 4, dtype=np.uint8).reshape(30, 4)
    lab = np.arange(30, dtype=np.int64)
    write_zarr(tmp_path / "img", "zarr", img)
    write_zarr(tmp_path / "lab", "zarr3", lab)
    specs = {"image": str(tmp_path / "img"), "label": str(tmp_path / "lab")}
    before = S.TensorStoreSource(specs).identity()
    assert set(before["arrays"]) == {"image", "label"}
    write_zarr(tmp_path / "lab", "zarr3", lab[::-1].copy())
    after = S.TensorStoreSource(specs).identity()
    assert after["arrays"]["image"] == before["arrays"]["image"]
    assert after["arrays"]["label"] != before["arrays"]["label"]


# --------------------------------------------------------------------------- generic sources


class _DefaultRepr:
    """A grain-style source whose repr is object's: it holds the object's address."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


class _Records(_DefaultRepr):
    """A grain-style source with a class-defined repr that says nothing about the data."""

    def __repr__(self):
        return f"_Records(n={len(self.records)})"


def _recs(seed: int, n: int = 40) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 100, 5).astype(np.int32), "text": f"doc {seed}-{i}"} for i in range(n)]


def test_sequence_source_identity_follows_content():
    a, b = _Records(_recs(1)), _Records(_recs(2))
    assert repr(a) == repr(b) and len(a) == len(b)
    ia = S.SequenceSource(a).identity()
    assert S.SequenceSource(b).identity() != ia
    assert S.SequenceSource(_Records(_recs(1))).identity() == ia  # equal content, another object
    json.dumps(ia)
    assert ia["object"].endswith("_Records") and ia["len"] == 40 and "repr" not in ia
    # the same through the pipeline's fingerprint
    fp = quern.Pipeline.from_source(a).batch(4).fingerprint()
    assert quern.Pipeline.from_source(_Records(_recs(1))).batch(4).fingerprint() == fp
    assert quern.Pipeline.from_source(b).batch(4).fingerprint() != fp


def test_sequence_source_identity_with_default_repr_is_stable():
    x, y = _DefaultRepr(_recs(3)), _DefaultRepr(_recs(3))
    assert " at 0x" in repr(x) and repr(x) != repr(y)
    assert S.SequenceSource(x).identity() == S.SequenceSource(y).identity()
    assert S.SequenceSource(_DefaultRepr(_recs(4))).identity() != S.SequenceSource(x).identity()


@pytest.mark.parametrize("which", ["first", "last"])
def test_sequence_source_identity_samples_first_and_last_record(which):
    recs = [np.int64(i) for i in range(1000)]
    before = S.SequenceSource(list(recs)).identity()
    recs[0 if which == "first" else -1] = np.int64(-1)
    assert S.SequenceSource(recs).identity() != before


def test_sample_ids_first_last_and_one_per_stratum():
    for n in (1, 2, 3, 7, 10, 1000, 2**40 + 3):
        ids = sample_ids(n)
        assert ids == sorted(set(ids)) and ids[0] == 0 and ids[-1] == n - 1
        assert all(0 <= i < n for i in ids)
        if n >= 1000:
            assert len(ids) == 7 and all(any(j * n // 5 <= i < (j + 1) * n // 5 for i in ids[1:-1]) for j in range(5))
        assert sample_ids(n) == ids  # from n alone
    assert sample_ids(0) == []


class _Opaque:
    pass


def test_sequence_source_identity_refuses_undescribable_records():
    src = S.SequenceSource(_Records([_Opaque() for _ in range(10)]), name="blobs")
    with pytest.raises(FingerprintError) as ei:
        src.identity()
    msg = str(ei.value)
    assert "'blobs'" in msg and "record 0" in msg and "_Opaque" in msg
    assert "identity()" in msg and "fingerprint()" in msg
    # a record in the middle that cannot be described is named too
    recs: list = [np.int64(i) for i in range(10)]
    k = sample_ids(10)[1]
    recs[k] = _Opaque()
    with pytest.raises(FingerprintError, match=rf"source 'mixed' .*record {k}\b"):
        S.SequenceSource(_Records(recs), name="mixed").identity()


class _Unreadable(_Records):
    def __getitem__(self, i):
        raise AssertionError("a source that describes itself is not sampled")


class _SelfIdentified(_Unreadable):
    def __init__(self, records, version):
        super().__init__(records)
        self.version = version

    def identity(self):
        return {"dataset": "x", "version": self.version}


class _SelfFingerprinted(_Unreadable):
    def __init__(self, records, version):
        super().__init__(records)
        self.version = version

    def fingerprint(self):
        return f"x@{self.version}"


@pytest.mark.parametrize("cls", [_SelfIdentified, _SelfFingerprinted])
def test_sequence_source_identity_uses_the_objects_own_description(cls):
    recs = [_Opaque() for _ in range(5)]  # not describable: never read
    one = S.SequenceSource(cls(recs, 1)).identity()
    json.dumps(one)
    assert "sample" not in one
    assert S.SequenceSource(cls(recs, 1)).identity() == one
    assert S.SequenceSource(cls(recs, 2)).identity() != one


def test_sequence_source_fingerprint_must_be_a_string():
    class Bad(_Unreadable):
        def fingerprint(self):
            return 3

    with pytest.raises(FingerprintError, match=r"fingerprint\(\) returned int"):
        S.SequenceSource(Bad([1, 2])).identity()
