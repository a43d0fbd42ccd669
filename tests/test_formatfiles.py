"""The reference side of the file sources' tests (tests/formatfiles.py): each writer, read back by the
format's own library, gives back what was written, and the bad files are bad the way they claim."""

from __future__ import annotations

import gzip
import json
import os
import struct
import tarfile

import pytest
from formatfiles import (
    TAR_BLOCK,
    TAR_RECORD,
    TFRECORD_OVERHEAD,
    flip_byte,
    gzip_copy,
    make_json_objects,
    make_tfrecord_payloads,
    make_webdataset_samples,
    read_jsonl,
    read_tfrecords,
    read_webdataset,
    tfrecord_crc_errors,
    truncate,
    write_jsonl,
    write_tar,
    write_tar_with_extensionless_member,
    write_tfrecord_examples,
    write_tfrecord_index,
    write_tfrecords,
    write_tfrecords_cut_short,
    write_webdataset,
)

# --- WebDataset ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # WebDataset leaves the tar open
@pytest.mark.parametrize("mtime", [None, 0], ids=["float-mtime", "int-mtime"])
def test_webdataset_round_trip(tmp_path, monkeypatch, mtime):
    for name in ("RANK", "WORLD_SIZE", "WORKER", "NUM_WORKERS"):  # WebDataset splits by them
        monkeypatch.delenv(name, raising=False)
    samples = make_webdataset_samples(40, seed=1)
    path = tmp_path / "shard.tar"
    write_webdataset(path, samples, mtime=mtime)
    assert read_webdataset(path) == samples
    assert read_webdataset(path, via_dataset=True) == samples
    data = path.read_bytes()
    assert len(data) % TAR_RECORD == 0 and data.endswith(b"\0" * 2 * TAR_BLOCK)
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    # one member per entry, key + "." + ext, extensions in sorted order within a sample
    assert [m.name for m in members] == [
        f"{s['__key__']}.{ext}" for s in samples for ext in sorted(s) if ext != "__key__"
    ]
    assert {m.uname for m in members} == {"bigdata"} and {m.mode for m in members} == {0o444}
    pax_mtime = [m for m in members if "mtime" in m.pax_headers]
    assert len(pax_mtime) == (len(members) if mtime is None else 0)
    assert any("path" in m.pax_headers for m in members)  # the long key of sample 3


def test_webdataset_samples_cover_the_edges():
    samples = make_webdataset_samples(40, seed=0)
    sizes = {len(v) for s in samples for k, v in s.items() if k != "__key__"}
    assert {0, 512, 1024, 10240, 20480, 102400} <= sizes and max(sizes) <= 110_000
    assert all("/" in s["__key__"] for s in samples)
    assert any(s["__key__"].startswith("a.b/") for s in samples)
    assert any(len(s["__key__"]) > 100 for s in samples)
    assert any("seg.png" in s for s in samples) and any("seg.png" not in s for s in samples)
    assert any("json" not in s for s in samples) and any("txt" not in s for s in samples)
    assert len({s["__key__"] for s in samples}) == len(samples)
    assert make_webdataset_samples(40, seed=0) == samples != make_webdataset_samples(40, seed=1)


def test_webdataset_encodes_str_json_and_ints(tmp_path):
    path = tmp_path / "enc.tar"
    write_webdataset(path, [{"__key__": "k/0", "txt": "é✓", "json": {"a": [1]}, "cls": 7, "_skipped": "x"}])
    assert read_webdataset(path) == [{"__key__": "k/0", "txt": "é✓".encode(), "json": b'{"a": [1]}', "cls": b"7"}]


def test_webdataset_grouping_rules(tmp_path):
    path = tmp_path / "rules.tar"
    write_tar(
        path,
        [
            ("d", None),  # a directory: skipped
            ("a.txt", b"1"),
            ("__meta__", b"m"),  # meta: skipped
            ("a.JPG", b"2"),  # extension lower-cased
            ("b.txt", b"3"),
            ("a.seg.png", b"4"),  # back to an earlier key: a new sample
        ],
    )
    assert read_webdataset(path) == [
        {"__key__": "a", "txt": b"1", "jpg": b"2"},
        {"__key__": "b", "txt": b"3"},
        {"__key__": "a", "seg.png": b"4"},
    ]
    write_tar(path, [("a.txt", b"1"), ("a.TXT", b"2")])
    with pytest.raises(ValueError, match="duplicate file name"):
        read_webdataset(path)


def test_webdataset_skips_an_extensionless_member(tmp_path):
    path = tmp_path / "readme.tar"
    expected = write_tar_with_extensionless_member(path)
    assert "README" in tarfile.open(path).getnames()
    assert read_webdataset(path) == expected


def test_webdataset_bad_files(tmp_path):
    samples = make_webdataset_samples(6, seed=2)
    path = tmp_path / "good.tar"
    write_webdataset(path, samples, mtime=0)
    gzip_copy(path, tmp_path / "good.tar.gz")
    assert gzip.decompress((tmp_path / "good.tar.gz").read_bytes()) == path.read_bytes()
    assert read_webdataset(tmp_path / "good.tar.gz") == samples  # webdataset opens tars with "r|*"
    # cut inside the last member's data: tarfile's "unexpected end of data"
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    assert last.size > 1
    truncate(path, path.stat().st_size - (last.offset_data + last.size // 2))
    with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
        read_webdataset(path)


# --- TFRecord -----------------------------------------------------------------------------------


def test_tfrecord_round_trip_and_index(tmp_path):
    records = make_tfrecord_payloads(30, seed=3)
    assert records[0] == b"" and max(map(len, records)) <= 51_200
    path = tmp_path / "data.tfrecord"
    write_tfrecords(path, records)
    assert read_tfrecords(path) == records
    assert tfrecord_crc_errors(path) == []
    assert path.stat().st_size == sum(TFRECORD_OVERHEAD + len(r) for r in records)
    index = write_tfrecord_index(path, tmp_path / "data.tfindex")
    offsets = [0]
    for r in records[:-1]:
        offsets.append(offsets[-1] + TFRECORD_OVERHEAD + len(r))
    assert index == [(o, TFRECORD_OVERHEAD + len(r)) for o, r in zip(offsets, records)]
    gzip_copy(path, tmp_path / "data.tfrecord.gz")
    assert read_tfrecords(tmp_path / "data.tfrecord.gz", compression_type="gzip") == records


def test_tfrecord_framing(tmp_path):
    path = tmp_path / "one.tfrecord"
    write_tfrecords(path, [b"abc"])
    data = path.read_bytes()
    assert struct.unpack("<Q", data[:8]) == (3,) and data[12:15] == b"abc" and len(data) == 19
    # masked crc32c: ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32, little-endian
    import crc32c

    def masked(b: bytes) -> int:
        c = crc32c.crc32c(b)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    assert struct.unpack("<II", data[8:12] + data[15:19]) == (masked(data[:8]), masked(b"abc"))


def test_tfrecord_examples(tmp_path):
    from tfrecord.reader import example_loader

    path = tmp_path / "ex.tfrecord"
    datums = [{"image": (b"\x00\x01", "byte"), "label": (i, "int"), "score": ([0.5, 1.5], "float")} for i in range(3)]
    records = write_tfrecord_examples(path, datums)
    assert read_tfrecords(path) == records
    loaded = list(example_loader(str(path), None))
    assert [int(x["label"][0]) for x in loaded] == [0, 1, 2] and loaded[0]["image"] == b"\x00\x01"


def test_tfrecord_bad_files(tmp_path):
    records = make_tfrecord_payloads(5, seed=4)[1:]  # the last one non-empty
    path = tmp_path / "cut.tfrecord"
    write_tfrecords_cut_short(path, records)
    assert path.stat().st_size < sum(TFRECORD_OVERHEAD + len(r) for r in records)
    with pytest.raises(RuntimeError, match="Failed to read"):
        read_tfrecords(path)
    # a flipped data byte: tfrecord's reader returns the record changed, only the CRC tells
    path = tmp_path / "flipped.tfrecord"
    write_tfrecords(path, records)
    flip_byte(path, TFRECORD_OVERHEAD + len(records[0]) + 12)
    got = read_tfrecords(path)
    assert got[1] != records[1] and got[0] == records[0] and got[2:] == records[2:]
    assert tfrecord_crc_errors(path) == [1]
    with pytest.raises(ValueError):
        write_tfrecords_cut_short(path, records, nbytes_from_end=TFRECORD_OVERHEAD + len(records[-1]))


# --- JSON lines ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ensure_ascii", [True, False], ids=["ascii", "utf8"])
@pytest.mark.parametrize("final_newline", [True, False], ids=["newline", "no-newline"])
def test_jsonl_round_trip(tmp_path, ensure_ascii, final_newline):
    objects = make_json_objects(50, seed=5)
    assert objects == json.loads(json.dumps(objects))
    path = tmp_path / "data.jsonl"
    write_jsonl(path, objects, ensure_ascii=ensure_ascii, final_newline=final_newline)
    raw = path.read_bytes()
    assert raw.count(b"\n") == len(objects) - (not final_newline)
    assert raw.isascii() == ensure_ascii
    if not ensure_ascii:
        assert "\u2028".encode() in raw  # raw inside a string: a reader must split on b"\n" only
    assert read_jsonl(path) == objects
    assert [o.get("label", "missing") for o in read_jsonl(path)].count("missing") == len(objects) // 4


def test_jsonl_blank_lines(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\r\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)
    assert read_jsonl(path, skip_blank=True) == [{"a": 1}, {"a": 2}]


# --- bad-file helpers ---------------------------------------------------------------------------


def test_truncate_and_flip_byte(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(10)))
    truncate(path, 3)
    assert path.read_bytes() == bytes(range(7))
    assert flip_byte(path, -1) == 6
    assert path.read_bytes() == bytes(range(6)) + bytes([6 ^ 0xFF])
    with pytest.raises(ValueError):
        truncate(path, 8)
    with pytest.raises(IndexError):
        flip_byte(path, 7)
    assert os.path.getsize(path) == 7
