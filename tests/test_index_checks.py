"""Tests of the checks of offset indexes (pipeline/sources/indexed.py, contents.py, offsets.py; issue 36).

An index is used only for a file whose every byte it was made for (the content hash, remembered per
stat identity), and only after its first and last offsets are checked against the file's bytes: a
stale index (a file changed in place, in bytes the sampled hash does not read) is rebuilt with a
warning; a forged one (a valid checksum, records left out at either end) is not used, beside a local
file or fetched beside a URL. Also ``quern index`` over its own sidecars, their mode, and files
that are not regular files. Expected records come from each format's library (``tests/formatfiles.py``).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
import shutil
import stat
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from formatfiles import (
    make_json_objects,
    make_tfrecord_payloads,
    read_jsonl,
    read_tfrecords,
    read_webdataset,
    write_jsonl,
    write_tfrecords,
    write_webdataset,
)
from helpers import quern_cmd
from servers import needs_nginx, nginx

import quern
from quern.pipeline.core.errors import SourceError
from quern.pipeline.remote.cache import ShardCache
from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources import contents as contents_mod
from quern.pipeline.sources import offsets as offsets_mod
from quern.pipeline.sources.base import sample_hash, sample_ranges

pytestmark = pytest.mark.timeout(120)

FORMATS = ("webdataset", "tfrecord", "jsonl")
CLASSES: dict[str, type] = {"webdataset": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}
SUFFIX = {"webdataset": ".tar", "tfrecord": ".tfrecord", "jsonl": ".jsonl"}


def write_ten(fmt: str, path: Path, seed: int = 0) -> list[Any]:
    """A file of 10 records of the format, written by its library; its records as the library reads them."""
    if fmt == "webdataset":
        samples = [{"__key__": f"{i:06d}", "txt": f"sample {i} {seed}".encode(), "cls": b"%d" % i} for i in range(10)]
        write_webdataset(path, samples, mtime=0)
        return read_webdataset(path)
    if fmt == "tfrecord":
        write_tfrecords(path, make_tfrecord_payloads(10, seed=seed))
        return read_tfrecords(path)
    write_jsonl(path, make_json_objects(10, seed=seed))
    return read_jsonl(path)


def read_all(src: Any) -> list[Any]:
    return list(src.read_many(np.arange(len(src))))


def unsampled(size: int, lo: int, hi: int) -> bool:
    """Whether the bytes ``[lo, hi)`` of a file of ``size`` bytes lie outside every range the sampled hash reads."""
    return not any(a < hi and lo < b for a, b in sample_ranges(size))


def rewrite_in_place(path: Path, data: bytes) -> list[int]:
    """Write ``data`` over the file (same size, same inode); the offsets of the bytes that changed."""
    old = path.read_bytes()
    assert len(old) == len(data)
    with open(path, "r+b") as f:
        f.write(data)
    return [i for i in range(len(old)) if old[i] != data[i]]


# --------------------------------------------------------------------------- point 4: stale indexes


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_tar_changed_in_unsampled_bytes_is_indexed_again_with_a_warning(tmp_path):
    """A tar over 1 MiB, one member renamed (same size) in bytes the sampled hash does not read, so that it
    joins the sample before it: 299 samples as the webdataset library sees, not the 300 of the old index,
    on a host whose cache holds the old index as on one whose cache is empty (one fingerprint)."""
    members = [(f"{i:06d}.bin", bytes([i % 251]) * 4000) for i in range(300)]
    path = tmp_path / "big.tar"
    path.write_bytes(_tar(members))
    size = os.path.getsize(path)
    assert size > 1 << 20
    old = WebDatasetSource(path, index_cache=tmp_path / "host-a")
    assert len(old) == 300 and read_all(old) == read_webdataset(path)
    k = next(k for k in range(150, 300) if unsampled(size, k * 4608, k * 4608 + 512))  # a header no range reads
    renamed = list(members)
    renamed[k] = (f"{k - 1:06d}.dat", members[k][1])  # same name length: same size, same offsets
    before = sample_hash(str(path), size)
    changed = rewrite_in_place(path, _tar(renamed))
    assert changed and all(unsampled(size, at, at + 1) for at in changed)
    assert sample_hash(str(path), size) == before  # what the sampled hash does not see
    want = read_webdataset(path)
    assert len(want) == 299
    with pytest.warns(UserWarning, match=r"big\.tar' changed in place since it was last opened here"):
        again = WebDatasetSource(path, index_cache=tmp_path / "host-a")
    assert again.index_sources == ["built"] and len(again) == 299 and read_all(again) == want
    other = WebDatasetSource(path, index_cache=tmp_path / "host-b")  # another host's cache: built there too
    assert other.offsets(0).tolist() == again.offsets(0).tolist()
    fingerprints = {quern.Pipeline.from_source(s, seed=0).shuffle().batch(4).fingerprint() for s in (again, other)}
    assert len(fingerprints) == 1
    stale = tmp_path / "host-c"  # a host whose cache holds the old index and whose records know nothing
    shutil.copytree(tmp_path / "host-a" / "offsets", stale / "offsets", ignore=shutil.ignore_patterns("files"))
    third = WebDatasetSource(path, index_cache=stale)
    assert len(third) == 299 and third.identity() == again.identity()


def test_a_json_lines_file_changed_in_unsampled_bytes_is_indexed_again_with_a_warning(tmp_path):
    """A space turned into a newline in a JSON-lines file over 1 MiB, outside the sampled ranges: the line
    is two lines now (neither valid JSON), as a fresh index sees; the old index read it as one object."""
    objects = [{"id": i, "text": "w" * 300} for i in range(4000)]
    path = tmp_path / "big.jsonl"
    write_jsonl(path, objects)
    data = path.read_bytes()
    size = len(data)
    assert size > 1 << 20
    old = JsonlSource(path, index_cache=tmp_path / "idx")
    off = old.offsets(0)
    k = next(k for k in range(2000, 4000) if unsampled(size, int(off[k]), int(off[k + 1])))
    at = data.index(b", ", int(off[k]))  # the space after the id's comma
    before = sample_hash(str(path), size)
    rewrite_in_place(path, data[: at + 1] + b"\n" + data[at + 2 :])
    assert sample_hash(str(path), size) == before  # what the sampled hash does not see
    with pytest.warns(UserWarning, match=r"big\.jsonl' changed in place since it was last opened here"):
        again = JsonlSource(path, index_cache=tmp_path / "idx")
    fresh = JsonlSource(path, index_cache=tmp_path / "fresh")
    assert len(again) == len(fresh) == 4001 and again.offsets(0).tolist() == fresh.offsets(0).tolist()
    assert again.identity() == fresh.identity() != old.identity()
    others = np.array([i for i in range(4001) if i not in (k, k + 1)])
    assert list(again.read_many(others)) == [objects[i if i < k else i - 1] for i in others]
    with pytest.raises(SourceError, match=rf"big\.jsonl' line {k + 1} \(record {k}\) is not valid JSON"):
        again.read_many(np.array([k]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sidecar_of_a_file_changed_since_is_not_used(fmt, tmp_path):
    """A sidecar made for the file's old contents (its size the same): not used, with a warning, on a host
    that never saw the file before (no record of it)."""
    path = tmp_path / f"a{SUFFIX[fmt]}"
    write_ten(fmt, path)
    quern_cmd("index", str(path))
    off = CLASSES[fmt](path, index_cache=tmp_path / "probe").offsets(0)
    data = bytearray(path.read_bytes())
    at = int(off[-1]) - 2 if fmt == "tfrecord" else data.index(b"sample 5" if fmt == "webdataset" else b'"id"')
    data[at + 1] ^= 0x01  # a letter of a member's data or of a key; the last record's data CRC
    rewrite_in_place(path, bytes(data))
    with pytest.warns(UserWarning, match=r"sidecar index .*quern\.idx is not used: made for other contents"):
        src = CLASSES[fmt](path, index_cache=tmp_path / "new-host")
    assert src.index_sources == ["built"]


def test_a_file_is_hashed_until_its_record_is_trusted_then_not_read(tmp_path):
    """The record of a file hashed within RACY_NS of its last write is not trusted (the file is hashed at
    every open); an older file's record is, while its stat identity holds; a change that keeps the size
    and sets the modification time back still changes the change time: hashed again, the change seen."""
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 1000)
    folder = tmp_path / "cache"

    def know() -> contents_mod.Known:
        return contents_mod.know([str(path)], [str(path)], folder)[0]

    first = know()
    assert first.hashed and first.before is None
    assert know().hashed  # written a moment ago: its record is not trusted
    time.sleep(contents_mod.RACY_NS / 1e9 + 0.2)
    assert know().hashed  # hashed once more, now trusted
    trusted = know()
    assert not trusted.hashed and trusted.content == first.content
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"y")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time set back
    changed = know()
    assert changed.hashed and changed.content != first.content and changed.before == first.content


def test_a_disk_cache_file_whose_times_the_cache_sets_is_not_hashed_again(tmp_path):
    """Files of the disk cache of remote files get their times set at every use (the cache's eviction
    order), which moves their change time: with ``ctime=False`` their record holds while size, mtime,
    inode and device do, so a later open does not read them whole; with the change time counted (local
    files) the same file is hashed again."""
    path = tmp_path / "shard.tar"
    path.write_bytes(b"z" * 1000)
    old = time.time_ns() - 10 * contents_mod.RACY_NS
    os.utime(path, ns=(old, old))  # fetched long ago: its mtime is old, its change time is now
    folder = tmp_path / "cache"

    def know(ctime: bool) -> contents_mod.Known:
        return contents_mod.know([str(path)], [str(path)], folder, ctime=ctime)[0]

    first = know(False)
    assert first.hashed  # no record yet
    assert not know(False).hashed  # trusted at once: the change time does not count
    st = os.stat(path)
    os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # what the cache does at a use: the change time moves
    assert os.stat(path).st_ctime_ns != st.st_ctime_ns
    again = know(False)
    assert not again.hashed and again.content == first.content
    assert know(True).hashed  # a local file's record counts the change time: read again


def test_a_verdict_of_older_checks_is_not_used(tmp_path, monkeypatch):
    """A stored verdict says the offsets passed the checks of its CHECKS_VERSION: once the checks get
    stricter (the version bumped) the index is checked again, not trusted on the old verdict."""
    offsets = np.array([0, 512, 2048], dtype=np.int64)
    offsets_mod.mark_checked("tar", "ab" * 16, offsets, tmp_path)
    assert offsets_mod.checked("tar", "ab" * 16, offsets, tmp_path)
    monkeypatch.setattr(offsets_mod, "CHECKS_VERSION", offsets_mod.CHECKS_VERSION + 1)
    assert not offsets_mod.checked("tar", "ab" * 16, offsets, tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("reader", ["open", "pickled"])
def test_an_open_source_refuses_a_same_size_rewrite_with_its_mtime_set_back(fmt, reader, tmp_path):
    """A file rewritten in place under an open source (and under its pickled copy on this host, as a worker
    holds it), with the same size and its modification time set back: the change time moved, so a read
    is refused, not served through the index of the old bytes."""
    path = tmp_path / f"a{SUFFIX[fmt]}"
    write_ten(fmt, path, seed=0)
    src = CLASSES[fmt](path, index_cache=tmp_path / "idx")
    copy = pickle.loads(pickle.dumps(src))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    st = os.stat(path)
    rewrite_in_place(path, bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    reading = src if reader == "open" else copy
    with pytest.raises(SourceError, match=r"changed since the source opened it \(it was written, or its metadata"):
        reading.read_many(np.arange(10))


def test_a_write_between_the_hash_and_the_scan_stores_no_index(tmp_path, monkeypatch):
    """A writer holding a dirty shared mapping (no stat field changes) rewrites the tar after the source
    hashed it and before its scan: the scan's own hash of the bytes it read differs, so the source is
    refused and nothing is cached under the old hash; a copy of the old bytes then reads its own 2 samples
    (it read 3, through the index of the new bytes stored under the old hash)."""
    old, new = (
        _tar([("a.txt", b"x"), ("a.cls", b"x"), ("b.txt", b"x")]),
        _tar([("a.txt", b"x"), ("c.cls", b"x"), ("b.txt", b"x")]),
    )
    path = tmp_path / "s.tar"
    path.write_bytes(old)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, len(old))
    m[:] = old  # the page is dirty and writable now: the next write through it changes no time
    real = offsets_mod.build

    def build(*args: Any, **kwargs: Any) -> Any:
        before = os.stat(path)
        m[:] = new
        after = os.stat(path)
        assert (before.st_mtime_ns, before.st_ctime_ns) == (after.st_mtime_ns, after.st_ctime_ns)
        return real(*args, **kwargs)

    monkeypatch.setattr(offsets_mod, "build", build)
    try:
        with pytest.raises(SourceError, match=r"s\.tar' changed while it was indexed \(the bytes scanned are not"):
            WebDatasetSource(path, index_cache=tmp_path / "idx")
    finally:
        m.close()
        os.close(fd)
    monkeypatch.setattr(offsets_mod, "build", real)
    copy = tmp_path / "copy.tar"
    copy.write_bytes(old)
    src = WebDatasetSource(copy, index_cache=tmp_path / "idx")
    assert src.index_sources == ["built"] and len(src) == 2 and read_all(src) == read_webdataset(copy)


# --------------------------------------------------------------------------- point 5: forged indexes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cut", ["head", "tail", "both"])
def test_a_forged_sidecar_that_leaves_records_out_is_not_used(fmt, cut, tmp_path):
    """A sidecar with a valid checksum whose offsets start after the first records and stop before the
    last ("records 4 of 10"): checked against the file's ends, not used (a warning), all 10 records read."""
    path = tmp_path / f"f{SUFFIX[fmt]}"
    want = write_ten(fmt, path)
    src = CLASSES[fmt](path, index_cache=tmp_path / "idx")
    off = src.offsets(0)
    forged = off[{"head": slice(3, None), "tail": slice(None, 8), "both": slice(3, 8)}[cut]]
    offsets_mod.store(offsets_mod.sidecar_path(str(path)), offsets_mod.dump(fmt, src.sizes[0], src.contents[0], forged))
    assert offsets_mod.load(offsets_mod.sidecar_path(str(path)), fmt, src.sizes[0], src.contents[0])[1] == "verified"
    with pytest.warns(UserWarning, match=r"sidecar index .*f\.\w+\.quern\.idx is not used"):
        again = CLASSES[fmt](path, index_cache=tmp_path / "other")
    assert again.index_sources == ["built"] and len(again) == 10 and read_all(again) == want
    done = quern_cmd("index", str(path))  # quern index does not keep it either
    assert f"{path}: 10 {fmt} records; index {path}.quern.idx written" in done.stdout


@needs_nginx
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sidecar_fetched_beside_a_url_never_serves_a_local_file(fmt, tmp_path):
    """A forged sidecar beside a URL (3 records of 10) is not used; a good one is kept for that URL only:
    a local copy of the file, without a sidecar, with the same cache folder, reads its 10 records from
    an index of its own."""
    www = tmp_path / "www"
    www.mkdir()
    path = www / f"f{SUFFIX[fmt]}"
    want = write_ten(fmt, path)
    probe = CLASSES[fmt](path, index_cache=tmp_path / "probe")
    forged = offsets_mod.dump(fmt, probe.sizes[0], probe.contents[0], probe.offsets(0)[4:8])
    Path(offsets_mod.sidecar_path(str(path))).write_bytes(forged)
    local = tmp_path / "local" / path.name
    local.parent.mkdir()
    shutil.copy(path, local)
    idx = tmp_path / "idx"
    with nginx(www) as srv:
        url = f"{srv.url}/{path.name}"
        with pytest.warns(UserWarning, match=r"sidecar index http://.*\.quern\.idx is not used"):
            remote = CLASSES[fmt](url, index_cache=idx, cache=ShardCache(tmp_path / "cache"))
        assert remote.index_sources == ["built"] and read_all(remote) == want
        assert not list((idx / "offsets").glob("fetched/*"))
        copy = CLASSES[fmt](local, index_cache=idx)
        assert len(copy) == 10 and read_all(copy) == want
        quern_cmd("index", str(path))  # a good sidecar now
        idx2 = tmp_path / "idx2"
        good = CLASSES[fmt](url, index_cache=idx2, cache=ShardCache(tmp_path / "cache2"))
        assert good.index_sources == ["sidecar"] and read_all(good) == want
        assert len(list((idx2 / "offsets").glob("fetched/*.idx"))) == 1
        assert not list((idx2 / "offsets").glob("*.idx"))  # not where local files' indexes are looked up
        mine = CLASSES[fmt](local, index_cache=idx2)
        assert mine.index_sources == ["built"] and read_all(mine) == want
        reopened = CLASSES[fmt](url, index_cache=idx2, cache=ShardCache(tmp_path / "cache2"))
        assert reopened.index_sources == ["cache"] and read_all(reopened) == want


# --------------------------------------------------------------------------- point 10: quern index, odd files


def test_quern_index_twice_over_one_glob_keeps_its_sidecars(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    paths = [data / "a.tar", data / "b.jsonl"]
    write_ten("webdataset", paths[0])
    write_ten("jsonl", paths[1])
    first = quern_cmd("index", str(data / "*"))
    second = quern_cmd("index", str(data / "*"))  # the glob matches the sidecars too: left out
    for p, fmt in zip(paths, ("webdataset", "jsonl")):
        assert f"{p}: 10 {fmt} records; index {p}.quern.idx written" in first.stdout
        assert f"{p}: 10 {fmt} records; index {p}.quern.idx already right, kept" in second.stdout
    assert sorted(os.listdir(data)) == ["a.tar", "a.tar.quern.idx", "b.jsonl", "b.jsonl.quern.idx"]
    named = quern_cmd("index", str(paths[0]) + ".quern.idx", check=False)
    assert named.returncode == 2 and "is a sidecar index" in named.stderr, named
    only = quern_cmd("index", str(data / "*.idx"), check=False)
    assert only.returncode == 2 and "no file but sidecar indexes matches" in only.stderr, only


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077], ids=["022", "027", "077"])
def test_sidecars_get_the_mode_the_umask_gives(umask, tmp_path):
    path = tmp_path / "a.tfrecord"
    write_ten("tfrecord", path)
    old = os.umask(umask)
    try:
        TFRecordSource.write_sidecars(str(path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(str(path) + ".quern.idx").st_mode) == 0o666 & ~umask


def test_quern_index_help_describes_no_allow():
    done = quern_cmd("index", "--help")
    assert "--allow" not in done.stdout and "--format" in done.stdout and "--traceback" in done.stdout


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_a_fifo_is_named_for_what_it_is(fmt, kind, tmp_path):
    path = tmp_path / f"x{SUFFIX[fmt]}"
    if kind == "directory":
        path.mkdir()
        what = "is a directory"
    else:
        os.mkfifo(path)
        what = "is a FIFO (named pipe)"
    message = f"{CLASSES[fmt].__name__}: '{path}' {what}, not a {fmt} file"
    with pytest.raises(SourceError, match=re.escape(message)):
        CLASSES[fmt](path, index_cache=tmp_path / "idx")
    done = quern_cmd("index", str(path), check=False)
    assert done.returncode == 1 and f"'{path}' {what}, not a {fmt} file" in done.stderr, done
    assert "empty" not in done.stderr and "IsADirectoryError" not in done.stderr


def test_old_sidecars_are_indexed_again(tmp_path):
    """A version-1 sidecar (made for a sampled hash) is not used: a warning says so, and `quern index` rewrites it."""
    path = tmp_path / "a.jsonl"
    want = write_ten("jsonl", path)
    quern_cmd("index", str(path))
    sidecar = Path(str(path) + ".quern.idx")
    sidecar.write_bytes(b"QUERNOX1" + sidecar.read_bytes()[8:])
    with pytest.warns(UserWarning, match=r"is not used: an old format \(version 1"):
        src = JsonlSource(path, index_cache=tmp_path / "idx")
    assert read_all(src) == want
    assert f"index {sidecar} written" in quern_cmd("index", str(path)).stdout
    assert JsonlSource(path, index_cache=tmp_path / "idx2").index_sources == ["sidecar"]
