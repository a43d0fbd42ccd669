"""Forged offset indexes that cut records inside a file, and odd tar framing (issue 36, points 4, 5 and 8).

A sidecar with a valid checksum is checked at every boundary when a host first uses it: TFRecord
frames chain, JSON lines are scanned again and compared, tar offsets hold headers and consecutive
samples do not start with one key. Also tar members the parser must refuse or read as ``tarfile``
does: a pax or GNU long-name header with no member after it in a sample, zero blocks inside a
member taken for the end of the archive, a directory member whose size is not 0. Expected records
come from each format's library (``tests/formatfiles.py``).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from formatfiles import read_jsonl, read_tfrecords, read_webdataset, write_jsonl, write_tfrecords

from quern.pipeline.core.errors import SourceError
from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources import offsets as offsets_mod

pytestmark = pytest.mark.timeout(120)


def _forge(src: Any, path: Path, off: np.ndarray) -> None:
    """A sidecar of ``off`` for the file's bytes, with a valid checksum."""
    fmt = type(src).FORMAT
    offsets_mod.store(offsets_mod.sidecar_path(str(path)), offsets_mod.dump(fmt, src.sizes[0], src.contents[0], off))


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))


def _files(fmt: str, tmp_path: Path) -> tuple[Path, list[Any]]:
    """A file of 6 records of the format, written by its library, and its records as the library reads them."""
    if fmt == "webdataset":
        path = tmp_path / "s.tar"
        _tar(path, [(f"{i:03d}.{ext}", b"%d" % i) for i in range(6) for ext in ("txt", "cls")])
        return path, read_webdataset(path)
    if fmt == "tfrecord":
        path = tmp_path / "s.tfrecord"
        write_tfrecords(path, [b"record %d" % i * (i + 1) for i in range(6)])
        return path, read_tfrecords(path)
    path = tmp_path / "s.jsonl"
    write_jsonl(path, [{"id": i, "text": "a b c"} for i in range(6)])
    return path, read_jsonl(path)


CLASSES: dict[str, Any] = {"webdataset": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}


def _split(fmt: str, off: np.ndarray) -> np.ndarray:
    """Record 2 cut in two: at its second member's header (tar), 8 bytes in (TFRecord), after ``"id"`` (JSON)."""
    inside = int(off[2]) + (1024 if fmt == "webdataset" else 8)
    return np.insert(off, 3, inside)


@pytest.mark.parametrize(
    ("fmt", "how"),
    [(fmt, how) for fmt in CLASSES for how in ("split", "merged")] + [("webdataset", "not at a header")],
)  # "not at a header": an offset inside a member's data, a tar-only case
def test_a_forged_sidecar_that_cuts_records_inside_is_not_used(fmt, how, tmp_path):
    """A sidecar with a valid checksum and right ends that splits a record in two or merges two: refused
    at open with a warning (it was accepted: another record count and fingerprint; only reads of the
    records cut failed), all 6 records read from an index built here."""
    path, want = _files(fmt, tmp_path)
    src = CLASSES[fmt](path, index_cache=tmp_path / "probe")
    off = src.offsets(0)
    forged = {
        "split": lambda: _split(fmt, off),
        "merged": lambda: np.delete(off, 3),
        "not at a header": lambda: np.insert(off, 3, int(off[2]) + 512),
    }[how]()
    _forge(src, path, forged)
    if fmt == "webdataset" and how == "merged":  # left to the read: a check at open would walk every member
        merged = WebDatasetSource(path, index_cache=tmp_path / "other")
        assert merged.index_sources == ["sidecar"]
        assert list(merged.read_many(np.array([0, 1, 3, 4]))) == [want[i] for i in (0, 1, 4, 5)]
        with pytest.raises(SourceError, match=r"s\.tar' record 2 \(bytes \d+-\d+\): its members are not one sample"):
            merged.read_many(np.array([2]))
        return
    with pytest.warns(UserWarning, match=r"sidecar index .*quern\.idx is not used: .*(split|merged|header|lines)"):
        again = CLASSES[fmt](path, index_cache=tmp_path / "other")
    assert again.index_sources == ["built"] and len(again) == 6
    assert list(again.read_many(np.arange(6))) == want
    assert again.identity() == src.identity()


@pytest.mark.parametrize("fmt", list(CLASSES))
def test_a_sidecar_is_checked_once_per_content_and_index_on_a_host(fmt, tmp_path, monkeypatch):
    """A good sidecar passes the check at its first use on a host; the verdict is kept, so the next open
    checks nothing inside (here: a check that would fail is not called)."""
    path, want = _files(fmt, tmp_path)
    src = CLASSES[fmt](path, index_cache=tmp_path / "probe")
    _forge(src, path, src.offsets(0))  # the right offsets
    first = CLASSES[fmt](path, index_cache=tmp_path / "host")
    assert first.index_sources == ["sidecar"] and list(first.read_many(np.arange(6))) == want
    monkeypatch.setattr(CLASSES[fmt], "check_inside", classmethod(lambda *a: "checked again"))
    second = CLASSES[fmt](path, index_cache=tmp_path / "host")
    assert second.index_sources == ["sidecar"]
    with pytest.warns(UserWarning, match="checked again"):
        other = CLASSES[fmt](path, index_cache=tmp_path / "other-host")
    assert other.index_sources == ["built"]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu-long-name"])
def test_a_record_ending_after_an_extended_header_is_refused(fmt, tmp_path):
    """A sidecar whose boundary skips sample 1's pax (or GNU long-name) header, starting it at the member's
    own header: record 0 ended with that header pending, and its parser stopped there silently (every
    record read, one sample under another key). The read now refuses record 0, naming it."""
    path = tmp_path / "s.tar"
    long = "k" * 60 + ".x" + "t" * 60 if fmt == tarfile.GNU_FORMAT else "ключ"  # a key in the first 100 bytes
    _tar(path, [("a.txt", b"A"), (f"{long}.txt", b"K"), ("c.txt", b"C")], fmt=fmt)
    src = WebDatasetSource(path, index_cache=tmp_path / "probe")
    off = src.offsets(0).copy()
    raw = path.read_bytes()
    assert raw[int(off[1]) + 156 : int(off[1]) + 157] in (b"x", b"L")
    size = int(raw[int(off[1]) + 124 : int(off[1]) + 136].rstrip(b" \0"), 8)
    off[1] += 512 + -(-size // 512) * 512  # the member's own header
    _forge(src, path, off)
    forged = WebDatasetSource(path, index_cache=tmp_path / "other")
    assert list(forged.read_many(np.array([2]))) == [{"__key__": "c", "txt": b"C"}]
    with pytest.raises(
        SourceError,
        match=rf"s\.tar' record 0 \(bytes 0-{off[1]}\): the extended tar header \(pax or GNU long name\) at byte "
        rf"1024 has no member after it before byte {off[1]}",
    ):
        forged.read_many(np.array([0]))


@pytest.mark.parametrize("zeros_in", ["__pad__/z", "003.bin"])
def test_a_last_offset_in_zero_data_is_not_taken_for_the_end(zeros_in, tmp_path):
    """A sidecar whose last offset points into 2 KiB of zeros inside a member's data: the zero block there
    was taken for the end of the archive, and sample 004 after it was dropped (every read succeeded
    with the zeros in a skipped ``__pad__`` member). Every byte from the end block to the file's end
    must be zero: not used, with a warning; all 5 samples read."""
    path = tmp_path / "s.tar"
    members = [(f"{k:03d}.txt", b"%d" % k) for k in range(4)] + [(zeros_in, bytes(2048)), ("004.txt", b"4")]
    _tar(path, members)
    src = WebDatasetSource(path, index_cache=tmp_path / "probe")
    off = src.offsets(0)
    raw = path.read_bytes()
    zeros = raw.find(bytes(1024), int(off[3]) + 1024)
    zeros = -(-zeros // 512) * 512
    _forge(src, path, np.concatenate([off[:4], [zeros]]))
    with pytest.warns(UserWarning, match=r"and the zero block at byte \d+ after it is no end of the archive"):
        again = WebDatasetSource(path, index_cache=tmp_path / "other")
    assert again.index_sources == ["built"] and list(again.read_many(np.arange(5))) == read_webdataset(path)


def test_a_skipped_member_that_overruns_its_record_is_refused(tmp_path):
    """A ``__pad__`` member (skipped, as webdataset skips ``__x__`` members) whose data holds a tar member
    crafted there, and a sidecar with a boundary at that crafted header: record 0 ended inside the pad's
    data and read as sample 000 alone. A skipped member must fit in its record: the read refuses it."""
    crafted = io.BytesIO()
    with tarfile.open(fileobj=crafted, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("x.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"FAKE"))
    hidden = crafted.getvalue()[:1024]  # its header and data block, no end-of-archive
    path = tmp_path / "s.tar"
    _tar(path, [("000.txt", b"0"), ("__pad__/z", hidden), ("001.txt", b"1")])
    src = WebDatasetSource(path, index_cache=tmp_path / "probe")
    off = src.offsets(0)
    assert len(src) == 2 and path.read_bytes()[1536 : 1536 + 5] == b"x.txt"
    _forge(src, path, np.array([0, 1536, int(off[1]), int(off[2])]))
    forged = WebDatasetSource(path, index_cache=tmp_path / "other")
    assert forged.index_sources == ["sidecar"]  # the crafted header is a header: left to the read
    with pytest.raises(SourceError, match=r"s\.tar' record 0 \(bytes 0-1536\): its members are not one sample"):
        forged.read_many(np.array([0]))


def test_a_zero_block_inside_a_record_is_refused(tmp_path):
    """As above, the pad's data a crafted member then a zero block: record 1 (from the crafted header to
    sample 001) read as sample ``x``, the parser stopping at the zero block. A record's bytes end at its
    last member's padding, never at a zero block: refused. (A crafted member that fills the pad's data
    to its end reads as a sample: only a walk of every member from the start could tell.)"""
    crafted = io.BytesIO()
    with tarfile.open(fileobj=crafted, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("x.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"FAKE"))
    path = tmp_path / "s.tar"
    _tar(path, [("000.txt", b"0"), ("__pad__/z", crafted.getvalue()[:1024] + bytes(1024)), ("001.txt", b"1")])
    src = WebDatasetSource(path, index_cache=tmp_path / "probe")
    off = src.offsets(0)
    _forge(src, path, np.array([0, 1536, int(off[1]), int(off[2])]))
    forged = WebDatasetSource(path, index_cache=tmp_path / "other")
    with pytest.raises(SourceError, match=r"s\.tar' record 1 \(bytes 1536-\d+\): a zero block \(the end of a tar\)"):
        forged.read_many(np.array([1]))
