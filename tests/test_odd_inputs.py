"""Odd inputs to the file sources (issue 36, points 4, 8 and 10): each read as its library reads it, or a
clear error naming the file and where.

- POSIX (pax) GNU-sparse tar members, written by GNU ``tar --sparse`` or crafted here the way GNU tar
  1.x writes them: ``tarfile`` and the webdataset library expand them; quern refuses them by name (it
  read their stored bytes under the bogus key ``./GNUSparseFile.<pid>/NAME``).
- The tar framing: consecutive samples have different keys; a key seen before starts a new sample, as in
  the webdataset library; an index that splits one sample in two is refused at read.
- A JSON line nested past Python's recursion limit (a bare ``RecursionError`` before).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from formatfiles import read_webdataset, write_tar

from quern.pipeline.core.errors import SourceError
from quern.pipeline.sources import JsonlSource, WebDatasetSource
from quern.pipeline.sources import contents as contents_mod
from quern.pipeline.sources import offsets as offsets_mod

pytestmark = pytest.mark.timeout(120)

REAL_SIZE = 1 << 20
DATA_AT = 700_000  # the sparse file's one non-zero part
DATA = b"data"


def _sparse_member(version: str) -> tuple[tarfile.TarInfo, bytes]:
    """A POSIX sparse member as GNU tar 1.x writes it: ``b.bin`` (1 MiB, ``DATA`` at ``DATA_AT``).

    Format 1.0: the header names it ``./GNUSparseFile.0/b.bin``, pax records give ``GNU.sparse.major/
    minor/name/realsize``, and its data is the map (decimal lines: the count, then offset and size per
    part, padded to a block) followed by the parts. Format 0.1: the map is the pax record
    ``GNU.sparse.map`` and the data the parts alone. (See ``tarfile``'s ``_proc_gnusparse_01/10``.)
    """
    info = tarfile.TarInfo("./GNUSparseFile.0/b.bin")
    info.mtime = 0
    if version == "1.0":
        head = f"1\n{DATA_AT}\n{len(DATA)}\n".encode()
        data = head + bytes(-len(head) % 512) + DATA
        info.pax_headers = {
            "GNU.sparse.major": "1",
            "GNU.sparse.minor": "0",
            "GNU.sparse.name": "b.bin",
            "GNU.sparse.realsize": str(REAL_SIZE),
        }
    else:
        data = DATA
        info.pax_headers = {
            "GNU.sparse.map": f"{DATA_AT},{len(DATA)}",
            "GNU.sparse.numblocks": "1",
            "GNU.sparse.name": "b.bin",
            "GNU.sparse.size": str(REAL_SIZE),
        }
    info.size = len(data)
    return info, data


def _write_sparse_tar(path: Path, version: str) -> None:
    """``a.txt``, the sparse ``b.bin``, ``b.txt``: samples ``a`` and ``b``."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a.txt", "b.bin", "b.txt"):
            if name == "b.bin":
                info, data = _sparse_member(version)
            else:
                info, data = tarfile.TarInfo(name), b"hello" if name == "a.txt" else b"x"
                info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))


def _gnu_tar(path: Path, fmt: str, version: str | None, tmp_path: Path) -> None:
    """The same members written by GNU tar from a real sparse file."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"hello")
    (src / "b.txt").write_bytes(b"x")
    with open(src / "b.bin", "wb") as f:
        f.truncate(REAL_SIZE)
        f.seek(DATA_AT)
        f.write(DATA)
    args = ["tar", "--sparse", f"--format={fmt}", "-cf", str(path), "-C", str(src), "a.txt", "b.bin", "b.txt"]
    if version is not None:
        args.insert(2, f"--sparse-version={version}")
    subprocess.run(args, check=True, capture_output=True)


def _expanded() -> bytes:
    return bytes(DATA_AT) + DATA + bytes(REAL_SIZE - DATA_AT - len(DATA))


WITH_GNU_TAR = [("posix", "0.0"), ("posix", "0.1"), ("posix", "1.0"), ("gnu", None)]


@pytest.mark.parametrize("how", ["crafted-1.0", "crafted-0.1"] + [f"gnu-tar-{f}-{v}" for f, v in WITH_GNU_TAR])
def test_a_sparse_tar_member_is_refused_by_name(tmp_path, how):
    path = tmp_path / "s.tar"
    if how.startswith("crafted"):
        _write_sparse_tar(path, how.split("-")[1])
    else:
        if shutil.which("tar") is None:
            pytest.skip("GNU tar is not installed")
        fmt, version = WITH_GNU_TAR[[f"gnu-tar-{f}-{v}" for f, v in WITH_GNU_TAR].index(how)]
        _gnu_tar(path, fmt, version, tmp_path)
    with tarfile.open(path) as tar:  # tarfile expands the member to the file, under its own name
        member = tar.getmember("b.bin")
        assert member.size == REAL_SIZE and tar.extractfile(member).read() == _expanded()
    library = read_webdataset(path)  # and so does the webdataset library
    assert [s["__key__"] for s in library] == ["a", "b"] and library[1]["bin"] == _expanded()
    with pytest.raises(SourceError, match=r"s\.tar'?: member 'b\.bin' \(header at byte \d+\) is a sparse file") as e:
        WebDatasetSource(path, index_cache=tmp_path / "idx")
    assert ("old GNU sparse member (type S)" in str(e.value)) == how.endswith("gnu-None")
    assert "write the shard without --sparse" in str(e.value)


# --------------------------------------------------------------------------- the tar framing


def test_a_key_seen_before_starts_a_new_sample_as_in_the_webdataset_library(tmp_path):
    """Chosen: read as the library reads it (samples are runs of one key, so ``a`` names two samples)."""
    path = tmp_path / "t.tar"
    write_tar(path, [("a.txt", b"1"), ("b.txt", b"2"), ("a.json", b"3")])
    library = read_webdataset(path)
    assert library == [{"__key__": "a", "txt": b"1"}, {"__key__": "b", "txt": b"2"}, {"__key__": "a", "json": b"3"}]
    src = WebDatasetSource(path, index_cache=tmp_path / "idx")
    assert src.read_many(np.arange(3)) == library
    assert [src.read_many(np.array([i]))[0] for i in (2, 0, 1)] == [library[2], library[0], library[1]]


def _renamed_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Rename a member in place (same length: in its header, and in its pax ``path`` record if it has one;
    header checksums fixed), keeping the file's size and mtime."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    for at in [m.start() for m in re.finditer(re.escape(old), data)]:
        data[at : at + len(old)] = new
        head = at - at % 512
        if at % 512 < 100:  # in a header's name field
            data[head + 148 : head + 156] = b" " * 8  # the checksum counts its own field as spaces
            data[head + 148 : head + 156] = b"%06o\0 " % sum(data[head : head + 512])
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _write_abc(path: Path, pax: bool) -> None:
    """Samples ``a``, ``b``, ``c`` of one member each; with ``pax``, each member after a pax header naming it."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT) as tar:
        for name, data in [("a.txt", b"1"), ("b.txt", b"2"), ("c.txt", b"3")]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            if pax:
                info.pax_headers = {"path": name}
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("pax", [False, True], ids=["ustar", "pax"])
@pytest.mark.parametrize("read", [[0], [1], [0, 1], [1, 2], [2]], ids=str)
def test_an_index_that_splits_a_sample_in_two_is_refused_at_read(tmp_path, read, pax):
    """Samples ``a``, ``b``, ``c``; ``b.txt`` renamed ``a.jsn`` (same size and mtime) and a sidecar of the
    old offsets forged for the new bytes: the library reads ``a`` with two members, and the index says
    ``a`` and ``a``. With plain ustar headers the check at open sees two samples of one key and does
    not use the index; after pax headers (names the check at open does not parse) the read refuses it.
    (Under an open source, the rename is refused by the change time before any framing is looked at.)"""
    path = tmp_path / "t.tar"
    _write_abc(path, pax)
    src = WebDatasetSource(path, index_cache=tmp_path / "idx")
    _renamed_in_place(path, b"b.txt", b"a.jsn")
    with pytest.raises(SourceError, match=r"changed since the source opened it"):
        src.read_many(np.array([0]))
    content = contents_mod.know([str(path)], [str(path)], tmp_path / "idx")[0].content
    dump = offsets_mod.dump("webdataset", src.sizes[0], content, src.offsets(0))
    offsets_mod.store(offsets_mod.sidecar_path(str(path)), dump)
    if not pax:
        with pytest.warns(UserWarning, match=r"its samples 0 and 1 \(byte \d+\) both hold members of key 'a'"):
            fresh = WebDatasetSource(path, index_cache=tmp_path / "idx")
        assert fresh.index_sources == ["built"] and len(fresh) == 2
        return
    src = WebDatasetSource(path, index_cache=tmp_path / "idx")
    assert src.index_sources == ["sidecar"]
    assert read_webdataset(path) == [{"__key__": "a", "txt": b"1", "jsn": b"2"}, {"__key__": "c", "txt": b"3"}]
    if read == [2]:  # c's framing is whole: b (now a) before it has another key
        assert src.read_many(np.array(read)) == [{"__key__": "c", "txt": b"3"}]
        return
    first = int(src.offsets(0)[1])
    with pytest.raises(
        SourceError, match=re.escape(f"{str(path)!r} record 0 (bytes 0-{first}) and record 1 both hold ")
    ):
        src.read_many(np.array(read))


def _member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE, size: int | None = None) -> bytes:
    """A USTAR member's bytes; ``size`` patches its size field (its checksum made again)."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, len(data)
    buf = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    if size is not None:
        buf[124:136] = b"%011o\0" % size
        buf[148:156] = b" " * 8
        buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf) + data + bytes(-len(data) % 512)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("d", tarfile.DIRTYPE), ("d/", tarfile.AREGTYPE), ("l", tarfile.SYMTYPE), ("h", tarfile.LNKTYPE)],
    ids=["dir", "old-dir", "symlink", "hardlink"],
)
def test_a_member_without_data_whose_size_is_not_0_is_read_as_tarfile_reads_it(tmp_path, name, kind):
    """A directory (or link) member whose size field says 512: ``tarfile`` (and so the webdataset library)
    reads the next block as a header, skipping data for regular members and unknown types only; quern
    skipped 512 bytes, hiding the member there (``b.txt``)."""
    raw = _member("a.txt", b"A") + _member(name, b"", kind, size=512) + _member("b.txt", b"B")
    path = tmp_path / "s.tar"
    path.write_bytes(raw + _member("c.txt", b"C") + bytes(1024))
    with tarfile.open(path) as tar:
        assert [m.name for m in tar.getmembers()] == ["a.txt", name.rstrip("/"), "b.txt", "c.txt"]
    want = read_webdataset(path)
    assert [s["__key__"] for s in want] == ["a", "b", "c"]
    src = WebDatasetSource(path, index_cache=tmp_path / "idx")
    assert list(src.read_many(np.arange(len(src)))) == want


# --------------------------------------------------------------------------- JSON lines


def test_a_json_line_nested_too_deep_names_its_file_and_line(tmp_path):
    """A line of 100,000 nested arrays: Python's parser raised a bare ``RecursionError``."""
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "a"}\n\n' + "[" * 100_000 + "]" * 100_000 + '\n{"text": "b"}\n')
    src = JsonlSource(path, index_cache=tmp_path / "idx")
    assert src.read_many(np.array([0, 2])) == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(
        SourceError, match=r"deep\.jsonl' line 3 \(record 1\) nests arrays or objects too deep to parse"
    ):
        src.read_many(np.array([1]))
