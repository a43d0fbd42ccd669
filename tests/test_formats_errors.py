"""Tests of pipeline/sources/webdataset.py, tfrecord.py and jsonl.py: bad input.

Every bad file is made by ``tests/formatfiles.py`` (or written byte by byte here, its layout worked
out in the test); each refusal must be the stated exception, its message naming the file and where
(a byte offset, a record, a line number). Where the format's own library reads the file, the test
also shows what it does with it.
"""

from __future__ import annotations

import bz2
import lzma
import os
import pickle
import re
import struct
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from formatfiles import (
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
    write_tfrecords,
    write_tfrecords_cut_short,
    write_webdataset,
)
from helpers import quern_cmd

from quern.pipeline.core.errors import SourceError
from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources import offsets as offsets_mod

pytestmark = pytest.mark.timeout(120)

FORMATS = ("webdataset", "tfrecord", "jsonl")
CLASSES: dict[str, type] = {"webdataset": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}
SUFFIX = {"webdataset": ".tar", "tfrecord": ".tfrecord", "jsonl": ".jsonl"}


def write_good(fmt: str, path: Path, n: int = 6) -> list[Any]:
    """A good file of the format, written by its library; returns its records as the library reads them."""
    if fmt == "webdataset":
        write_webdataset(path, make_webdataset_samples(n))
        return read_webdataset(path)
    if fmt == "tfrecord":
        write_tfrecords(path, make_tfrecord_payloads(n))
        return read_tfrecords(path)
    write_jsonl(path, make_json_objects(n))
    return read_jsonl(path)


def open_source(fmt: str, paths: Any, tmp_path: Path, **kw: Any) -> Any:
    return CLASSES[fmt](paths, index_cache=tmp_path / "idx", **kw)


def named(path: Path) -> str:
    """The file as messages name it (its repr), as a regex."""
    return re.escape(repr(str(path)))


# --------------------------------------------------------------------------- tar (WebDataset)

# write_tar, USTAR, mtime 0: member 0 (5000 bytes) header at 0, data 512-5512, padded to 5632;
# member 1 (100 bytes) header at 5632, data 6144-6244, padded to 6656; end blocks 6656-7680.
TWO_MEMBERS = [("a/0.txt", b"x" * 5000), ("a/1.txt", b"y" * 100)]


def write_two_members(path: Path) -> None:
    write_tar(path, TWO_MEMBERS, fmt=tarfile.USTAR_FORMAT)
    data = path.read_bytes()
    assert data[5632 + 257 : 5632 + 262] == b"ustar" and data[6656:7680] == bytes(1024)  # the layout above


def test_a_tar_member_cut_short(tmp_path):
    path = tmp_path / "cut.tar"
    write_two_members(path)
    truncate(path, os.path.getsize(path) - 3000)  # inside member 0's data
    with pytest.raises(
        SourceError,
        match=rf"{named(path)}: tar member 'a/0.txt' \(header at byte 0\) is cut short: "
        r"its 5000 bytes need the file to reach byte 5512, and it has 3000",
    ):
        WebDatasetSource(path, index_cache=tmp_path / "idx")
    with pytest.raises(tarfile.ReadError):  # the library fails too
        read_webdataset(path)


def test_a_tar_header_cut_short(tmp_path):
    path = tmp_path / "cut.tar"
    write_two_members(path)
    truncate(path, os.path.getsize(path) - (5632 + 100))
    with pytest.raises(SourceError, match=rf"{named(path)}: the tar header at byte 5632 is cut short \(100 of 512"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


@pytest.mark.parametrize("end", [6656, 5632], ids=["after-last-member", "between-members"])
def test_a_tar_without_end_of_archive_blocks(tmp_path, end):
    path = tmp_path / "open.tar"
    write_two_members(path)
    truncate(path, os.path.getsize(path) - end)
    with pytest.raises(SourceError, match=rf"{named(path)} ends at byte {end} without the tar end-of-archive block"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


def test_a_tar_member_without_a_key(tmp_path):
    path = tmp_path / "readme.tar"
    theirs = write_tar_with_extensionless_member(path)
    assert read_webdataset(path) == theirs  # the library drops README silently
    with pytest.raises(SourceError, match=rf"{named(path)}: tar member 'README' \(header at byte 1024\) has no key"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


def test_a_duplicate_extension_within_one_sample(tmp_path):
    path = tmp_path / "dup.tar"
    write_tar(path, [("s/1.json", b"{}"), ("s/1.txt", b"a"), ("s/1.TXT", b"b")], fmt=tarfile.USTAR_FORMAT)
    with pytest.raises(ValueError, match="duplicate file name"):  # the library refuses it too
        read_webdataset(path)
    with pytest.raises(
        SourceError, match=rf"{named(path)}: tar member 's/1.TXT' \(header at byte 2048\) repeats the extension 'txt'"
    ):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


@pytest.mark.parametrize("header", [0, 5632])
def test_a_corrupted_tar_header(tmp_path, header):
    path = tmp_path / "bad.tar"
    write_two_members(path)
    flip_byte(path, header + 3)  # a byte of the member's name: its checksum no longer matches
    with pytest.raises(SourceError, match=rf"{named(path)}: bad tar header at byte {header} \(bad checksum\)"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


def test_a_corrupted_pax_header_in_a_tarwriter_shard(tmp_path):
    path = tmp_path / "pax.tar"
    write_webdataset(path, make_webdataset_samples(4))
    flip_byte(path, 512 * 2 + 1)  # the second header: member 0's own, after its pax header
    with pytest.raises(SourceError, match=rf"{named(path)}: bad tar header at byte 1024"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


def test_a_file_that_is_not_a_tar(tmp_path):
    path = tmp_path / "text.tar"
    path.write_bytes(b"hello, this is not a tar file\n" * 40)
    with pytest.raises(SourceError, match=rf"{named(path)}: bad tar header at byte 0 .*not a tar"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


@pytest.mark.parametrize("members", [[], [("d/", None), ("__meta__", b"m")]], ids=["end-blocks-only", "no-sample"])
def test_a_tar_holding_no_sample(tmp_path, members):
    path = tmp_path / "none.tar"
    write_tar(path, members)
    assert read_webdataset(path) == []
    with pytest.raises(SourceError, match=rf"{named(path)} holds no webdataset records"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


# --------------------------------------------------------------------------- TFRecord


def frame_offsets(payloads: list[bytes]) -> list[int]:
    """Where each TFRecord frame starts (and where the last ends): 16 bytes of framing each."""
    return np.cumsum([0] + [TFRECORD_OVERHEAD + len(p) for p in payloads]).tolist()


def test_a_tfrecord_data_crc_error_is_named_at_read(tmp_path):
    path = tmp_path / "crc.tfrecord"
    payloads = make_tfrecord_payloads(6)
    assert len(payloads[2]) == 7
    write_tfrecords(path, payloads)
    off = frame_offsets(payloads)
    flip_byte(path, off[2] + 12 + 3)  # a data byte of record 2
    assert tfrecord_crc_errors(path) == [2]
    src = TFRecordSource(path, index_cache=tmp_path / "idx")  # the scan checks only the lengths' CRCs
    assert len(src) == 6
    assert list(src.read_many(np.array([0, 1, 3, 4, 5]))) == [payloads[i] for i in (0, 1, 3, 4, 5)]
    where = rf"{named(path)} record 2 \(bytes {off[2]}-{off[3]}\): its data's CRC does not match"
    for ids in ([2], [0, 1, 2, 3], [5, 2]):
        with pytest.raises(SourceError, match=where):
            src.read_many(np.array(ids))


@pytest.mark.parametrize("byte", [0, 9], ids=["length", "length-crc"])
def test_a_tfrecord_length_crc_error_is_named_at_open(tmp_path, byte):
    path = tmp_path / "len.tfrecord"
    payloads = make_tfrecord_payloads(5)
    write_tfrecords(path, payloads)
    off = frame_offsets(payloads)
    flip_byte(path, off[3] + byte)
    with pytest.raises(
        SourceError, match=rf"{named(path)}: record 3 at byte {off[3]}: its length's CRC does not match"
    ):
        TFRecordSource(path, index_cache=tmp_path / "idx")


@pytest.mark.parametrize("cut", [None, 4, TFRECORD_OVERHEAD + 4096 - 5], ids=["in-data", "in-data-crc", "in-length"])
def test_a_truncated_last_tfrecord_is_named_at_open(tmp_path, cut):
    path = tmp_path / "short.tfrecord"
    payloads = make_tfrecord_payloads(10)
    assert len(payloads[-1]) == 4096
    write_tfrecords_cut_short(path, payloads, cut)
    off = frame_offsets(payloads)
    with pytest.raises(RuntimeError):  # the tfrecord package's reader fails too
        read_tfrecords(path)
    with pytest.raises(SourceError, match=rf"{named(path)}: record 9 at byte {off[9]} is cut short"):
        TFRecordSource(path, index_cache=tmp_path / "idx")


def test_a_file_that_is_not_tfrecord(tmp_path):
    path = tmp_path / "text.tfrecord"
    write_jsonl(path, make_json_objects(5))
    with pytest.raises(SourceError, match=rf"{named(path)}: record 0 at byte 0: its length's CRC does not match"):
        TFRecordSource(path, index_cache=tmp_path / "idx")


# --------------------------------------------------------------------------- JSON lines


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_a_json_line_that_does_not_parse_names_its_line_number(tmp_path, newline):
    lines = ['{"a": 1}', "", "   ", '{"a": 2}', '{"a": 3', "\t", '{"a": 4}', '{"a": 5} trailing']
    path = tmp_path / "bad.jsonl"
    path.write_bytes(newline.join(lines).encode())
    src = JsonlSource(path, index_cache=tmp_path / "idx")
    assert len(src) == 5  # blank lines hold no record
    assert list(src.read_many(np.array([0, 1, 3]))) == [{"a": 1}, {"a": 2}, {"a": 4}]
    with pytest.raises(SourceError, match=rf"{named(path)} line 5 \(record 2\) is not valid JSON"):
        src.read_many(np.array([2]))
    with pytest.raises(SourceError, match=rf"{named(path)} line 8 \(record 4\) is not valid JSON: Extra data"):
        src.read_many(np.array([3, 4]))


def test_a_json_line_without_the_field(tmp_path):
    path = tmp_path / "field.jsonl"
    path.write_text('{"text": "a"}\n\n{"other": 1, "more": 2}\n[1, 2]\n{"text": null}\n')
    src = JsonlSource(path, field="text", index_cache=tmp_path / "idx")
    assert list(src.read_many(np.array([0, 3]))) == ["a", None]
    with pytest.raises(
        SourceError,
        match=rf"{named(path)} line 3 \(record 1\) has no field 'text' \(its keys: "
        r"\['more', 'other'\]\)",
    ):
        src.read_many(np.array([1]))
    with pytest.raises(SourceError, match=rf"{named(path)} line 4 \(record 2\) has no field 'text' \(it holds a list"):
        src.read_many(np.array([2]))
    with pytest.raises(TypeError, match="field must be a str"):
        JsonlSource(path, field=3, index_cache=tmp_path / "idx")  # type: ignore[arg-type]


def test_a_jsonl_file_of_blank_lines_only(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n  \n\t\r\n\n ")
    assert read_jsonl(path, skip_blank=True) == []
    with pytest.raises(SourceError, match=rf"{named(path)} holds no jsonl records"):
        JsonlSource(path, index_cache=tmp_path / "idx")


# --------------------------------------------------------------------------- every format


@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        ("webdataset", "its members are not one sample where the index says"),
        ("tfrecord", r"its record 1 at byte \d+ ends at byte \d+, and the frame there ends at byte \d+"),
        ("jsonl", r"its record 1 starts at byte \d+, which does not follow a newline \(a line split"),
    ],
)
def test_a_valid_index_that_does_not_fit_the_records_is_refused_at_open_or_read(fmt, why, tmp_path):
    """A sidecar with a good checksum but wrong offsets (records 1 and 2 as one; for JSON lines, record 0
    ending inside its line): TFRecord frames and JSON lines are checked at every boundary when the sidecar
    is first used on a host, and it is not used (a warning); a tar's merged samples are caught at read,
    naming the file and record."""
    path = tmp_path / f"f{SUFFIX[fmt]}"
    want = write_good(fmt, path)
    src = open_source(fmt, path, tmp_path)
    off = src.offsets(0).copy()
    if fmt == "jsonl":
        off[1] -= 3
        bad = 0
    else:
        off = np.delete(off, 2)
        bad = 1
    sidecar = offsets_mod.sidecar_path(str(path))
    offsets_mod.store(sidecar, offsets_mod.dump(src.FORMAT, src.sizes[0], src.contents[0], off))
    if fmt != "webdataset":
        with pytest.warns(UserWarning, match=rf"sidecar index .*quern\.idx is not used: {why}"):
            refused = open_source(fmt, path, tmp_path)
        assert refused.index_sources == ["cache"] and list(refused.read_many(np.arange(len(want)))) == want
        return
    wrong = open_source(fmt, path, tmp_path)
    assert wrong.index_sources == ["sidecar"] and len(wrong) == len(want) - 1
    assert wrong.read_many(np.array([4])) == [want[5]]
    with pytest.raises(SourceError, match=rf"{named(path)} record {bad} \(bytes {off[bad]}-{off[bad + 1]}\).*{why}"):
        wrong.read_many(np.array([bad]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_file(fmt, tmp_path):
    path = tmp_path / f"empty{SUFFIX[fmt]}"
    path.write_bytes(b"")
    with pytest.raises(SourceError, match=rf"{named(path)} is empty \(0 bytes\)"):
        open_source(fmt, path, tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz"])
def test_a_compressed_file_is_refused_by_its_magic_bytes(fmt, kind, tmp_path):
    good = tmp_path / f"good{SUFFIX[fmt]}"
    write_good(fmt, good)
    path = tmp_path / "in" / good.name  # named as uncompressed
    path.parent.mkdir()
    if kind == "gzip":
        gzip_copy(good, path)
    else:
        path.write_bytes((bz2.compress if kind == "bzip2" else lzma.compress)(good.read_bytes()))
    with pytest.raises(
        SourceError, match=rf"{named(path)} is {kind}-compressed: .*Decompress it.*ArrayRecord with `quern prepare`"
    ):
        open_source(fmt, path, tmp_path)


def test_a_tarwriter_gzipped_shard_is_refused(tmp_path):
    path = tmp_path / "shard.tar.gz"
    write_webdataset(path, make_webdataset_samples(3))  # TarWriter gzips a name ending in gz
    assert len(read_webdataset(path)) == 3
    with pytest.raises(SourceError, match=rf"{named(path)} is gzip-compressed"):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_files_and_empty_globs(fmt, tmp_path):
    with pytest.raises(FileNotFoundError):
        open_source(fmt, tmp_path / f"missing{SUFFIX[fmt]}", tmp_path)
    with pytest.raises(FileNotFoundError):
        open_source(fmt, str(tmp_path / f"*{SUFFIX[fmt]}"), tmp_path)
    good = tmp_path / f"good{SUFFIX[fmt]}"
    write_good(fmt, good)
    with pytest.raises(FileNotFoundError):  # one of several
        open_source(fmt, [good, tmp_path / f"missing{SUFFIX[fmt]}"], tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_urls_and_local_paths_cannot_be_mixed(fmt, tmp_path):
    good = tmp_path / f"good{SUFFIX[fmt]}"
    write_good(fmt, good)
    with pytest.raises(ValueError, match="give local paths or URLs, not both"):
        open_source(fmt, [str(good), "http://127.0.0.1:9/x" + SUFFIX[fmt]], tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_id_out_of_range(fmt, tmp_path):
    good = tmp_path / f"good{SUFFIX[fmt]}"
    want = write_good(fmt, good)
    src = open_source(fmt, good, tmp_path)
    assert len(src) == len(want) == 6
    for bad in (6, -1, 100):
        with pytest.raises(IndexError, match=rf"record {bad} out of range \[0, 6\)"):
            src.read_many(np.array([0, bad]))
    with pytest.raises(IndexError):
        src[6]


def _change(fmt: str, path: Path, how: str, tmp_path: Path) -> None:
    """Change a file under an open source: append to it, rewrite it shorter, replace it (same size), remove it."""
    if how == "appended":
        with open(path, "ab") as f:
            f.write(b"\n" if fmt == "jsonl" else bytes(512) if fmt == "webdataset" else struct.pack("<Q", 1))
    elif how == "rewritten-shorter":
        write_good(fmt, path, n=3)
    elif how == "replaced-same-size":
        other = tmp_path / "other"
        other.write_bytes(path.read_bytes())
        os.replace(other, path)
    else:
        os.unlink(path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["appended", "rewritten-shorter", "replaced-same-size", "removed"])
@pytest.mark.parametrize("read_before", [False, True], ids=["unread", "read-before"])
def test_a_file_changed_after_the_source_opened_it(fmt, how, read_before, tmp_path):
    paths = [tmp_path / f"a{SUFFIX[fmt]}", tmp_path / f"b{SUFFIX[fmt]}"]
    want = [r for p in paths for r in write_good(fmt, p)]
    src = open_source(fmt, paths, tmp_path)
    if read_before:
        assert list(src.read_many(np.array([1, 7]))) == [want[1], want[7]]
    _change(fmt, paths[1], how, tmp_path)
    assert list(src.read_many(np.array([0, 2]))) == [want[0], want[2]]  # the other file reads on
    why = {
        "appended": "its size went from",
        "rewritten-shorter": "its size went from",
        "replaced-same-size": "it was replaced by another file",
        "removed": "it was removed since the source opened it",
    }[how]
    with pytest.raises(SourceError, match=rf"{named(paths[1])}.*{why}"):
        src.read_many(np.array([7]))


def test_quern_index_refuses_bad_files_naming_them(tmp_path):
    good = tmp_path / "good.tfrecord"
    write_good("tfrecord", good)
    cut = tmp_path / "cut.tfrecord"
    payloads = make_tfrecord_payloads(10)
    write_tfrecords_cut_short(cut, payloads)
    done = quern_cmd("index", str(good), str(cut), check=False)
    assert done.returncode == 1, done
    assert f"{cut!s}" in done.stderr and "record 9 at byte" in done.stderr and "cut short" in done.stderr
    assert not Path(str(cut) + ".quern.idx").exists()
    packed = tmp_path / "packed.jsonl"
    gzip_copy(good, packed)
    done = quern_cmd("index", str(packed), check=False)
    assert done.returncode == 1 and "gzip-compressed" in done.stderr and str(packed) in done.stderr, done
    odd = tmp_path / "data.bin"
    odd.write_bytes(good.read_bytes())
    done = quern_cmd("index", str(odd), check=False)
    assert done.returncode == 2 and "cannot tell the format" in done.stderr and "--format" in done.stderr, done
    done = quern_cmd("index", "--format", "tfrecord", str(odd))
    assert f"{odd}: 6 tfrecord records; index {odd}.quern.idx written" in done.stdout
    assert TFRecordSource(odd, index_cache=tmp_path / "idx").index_sources == ["sidecar"]
    done = quern_cmd("index", str(tmp_path / "none-*.tar"), check=False)
    assert done.returncode != 0 and "none-*.tar" in done.stderr, done


def test_an_index_cache_that_cannot_be_written(tmp_path):
    """The index is not cached, nor the file's content hash (warnings name the file and the folder); the
    records read, also pickled."""
    path = tmp_path / "a.jsonl"
    want = write_good("jsonl", path)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    with pytest.warns(UserWarning) as caught:
        src = JsonlSource(path, index_cache=blocker)
    said = [str(w.message) for w in caught]
    assert any(re.search(rf"cannot cache the index of {named(path)} in {re.escape(str(blocker))}", m) for m in said)
    assert any(re.search(rf"cannot keep the content hash of {named(path)} .*read whole .* every open", m) for m in said)
    assert src.index_sources == ["built"] and list(src.read_many(np.arange(6))) == want
    copy = pickle.loads(pickle.dumps(src))  # its offsets travel in the pickle
    assert list(copy.read_many(np.array([5, 0, 3]))) == [want[5], want[0], want[3]]


def _tar_with_pax(path: Path, records: bytes) -> None:
    """A tar of one member ``a.txt`` preceded by a pax extended header holding ``records``."""
    head = tarfile.TarInfo("././@PaxHeader")
    head.type, head.size = tarfile.XHDTYPE, len(records)
    member = tarfile.TarInfo("a.txt")
    member.size = 2
    with open(path, "wb") as f:
        f.write(head.tobuf(tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512))
        f.write(member.tobuf(tarfile.USTAR_FORMAT) + b"hi" + bytes(510) + bytes(1024))


@pytest.mark.parametrize("records", [b"0 x=\n", b"-5 size=3\n", b"99 path=x\n", b"nospace", b"11 size=-9\n"])
def test_bad_pax_headers_are_errors_not_hangs(tmp_path, records):
    """A pax record whose length would not move on, runs past its header, or gives a negative size."""
    path = tmp_path / "t.tar"
    _tar_with_pax(path, records)
    with pytest.raises(
        SourceError, match=r"t\.tar'?: (bad tar header at byte 0|the tar header at byte \d+ gives a negative)"
    ):
        WebDatasetSource(path, index_cache=tmp_path / "idx")


def test_a_good_pax_header_is_read(tmp_path):
    path = tmp_path / "t.tar"
    _tar_with_pax(path, b"15 path=b.json\n")
    assert WebDatasetSource(path, index_cache=tmp_path / "idx")[0] == {"__key__": "b", "json": b"hi"}
