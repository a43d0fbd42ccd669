"""Tests of pipeline/sources/webdataset.py, tfrecord.py and jsonl.py (with indexed.py and offsets.py).

Records read in place by offset: every expected record comes from the format's own library
(``tests/formatfiles.py``: webdataset's tar iterator and ``group_by_keys``, the ``tfrecord``
package's reader and ``tfrecord2idx`` index, ``json.loads`` over ``b"\\n"``-ended lines), never
from the code under test. Bad input is in ``tests/test_formats_errors.py``.

Every source gets ``index_cache=tmp_path / ...``: no test writes under ``~/.cache``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from formatfiles import (
    flip_byte,
    make_json_objects,
    make_tfrecord_payloads,
    make_webdataset_samples,
    read_jsonl,
    read_tfrecords,
    read_webdataset,
    tfrecord_crc_errors,
    write_jsonl,
    write_tar,
    write_tfrecord_examples,
    write_tfrecord_index,
    write_tfrecords,
    write_webdataset,
)
from helpers import assert_batches_equal, quern_cmd
from servers import needs_nginx, nginx

import quern
from quern.pipeline.core.errors import SourceError
from quern.pipeline.remote.cache import ShardCache
from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources import offsets as offsets_mod
from quern.pipeline.sources.base import sample_ranges

pytestmark = pytest.mark.timeout(120)

FORMATS = ("webdataset", "tfrecord", "jsonl")
CLASSES: dict[str, type] = {"webdataset": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}
SUFFIX = {"webdataset": ".tar", "tfrecord": ".tfrecord", "jsonl": ".jsonl"}
LEFT_OUT = {  # why an index that leaves the last record out is not used
    "webdataset": "lies after its last sample",
    "tfrecord": "outside them hold data",
    "jsonl": "outside them hold data",
}


# --------------------------------------------------------------------------- files, written by each format's library


def write_files(fmt: str, folder: Path, n_files: int = 3, per_file: int = 10, seed: int = 0) -> list[Path]:
    """``n_files`` files ``part-00K<suffix>`` of the format in ``folder``, written by its own library.

    Args:
        fmt: ``webdataset``, ``tfrecord`` or ``jsonl``.
        folder: where (made if missing).
        n_files: how many files.
        per_file: records per file.
        seed: seed of the contents.

    Returns:
        The files, in name order.
    """
    folder.mkdir(parents=True, exist_ok=True)
    n = n_files * per_file
    if fmt == "webdataset":
        records: list[Any] = make_webdataset_samples(n, seed=seed)
    elif fmt == "tfrecord":
        records = make_tfrecord_payloads(n, seed=seed)
    else:
        records = make_json_objects(n, seed=seed)
    paths = []
    for k in range(n_files):
        path = folder / f"part-{k:03d}{SUFFIX[fmt]}"
        part = records[k * per_file : (k + 1) * per_file]
        if fmt == "webdataset":
            write_webdataset(path, part)  # TarWriter's default float mtime: a pax header before every member
        elif fmt == "tfrecord":
            write_tfrecords(path, part)
        else:
            write_jsonl(path, part, ensure_ascii=False)  # U+2028, U+2029, NEL raw inside strings
        paths.append(path)
    return paths


def reference(fmt: str, path: Path) -> list[Any]:
    """The records of one file as the format's own library reads them."""
    if fmt == "webdataset":
        return read_webdataset(path)
    if fmt == "tfrecord":
        return read_tfrecords(path)
    return read_jsonl(path, skip_blank=True)


def open_source(fmt: str, paths: Any, index_cache: Path, **kw: Any) -> Any:
    """The format's source over ``paths``, its indexes cached in ``index_cache``."""
    return CLASSES[fmt](paths, index_cache=index_cache, **kw)


def built_indexes(index_cache: Path) -> list[Path]:
    """The indexes cached in ``index_cache`` (not the records of the files hashed, in ``offsets/files/``)."""
    return sorted((index_cache / "offsets").glob("*.idx"))


def read_all(src: Any) -> list[Any]:
    return list(src.read_many(np.arange(len(src))))


def write_sidecar(src: Any, k: int, offsets: np.ndarray | None = None, path: str | None = None) -> str:
    """Write file ``k``'s sidecar index (``offsets``: the source's own by default) with offsets.dump/store."""
    target = offsets_mod.sidecar_path(path or src.paths[k])
    off = src.offsets(k) if offsets is None else offsets
    offsets_mod.store(target, offsets_mod.dump(src.FORMAT, src.sizes[k], src.contents[k], off))
    return target


# --------------------------------------------------------------------------- map functions (module level: workers import them)


def _head(data: bytes, n: int = 8) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    out[: min(n, len(data))] = np.frombuffer(data[:n], np.uint8)
    return out


def webdataset_arrays(sample: dict) -> dict:
    """A sample as fixed-shape arrays: its key's CRC, its members' sizes and the jpg's first bytes."""
    sizes = [len(sample.get(ext, b"")) for ext in ("jpg", "cls", "json", "txt", "seg.png")]
    return {
        "key": np.int64(zlib.crc32(sample["__key__"].encode())),
        "sizes": np.asarray(sizes, np.int64),
        "head": _head(sample["jpg"]),
    }


def tfrecord_arrays(record: bytes) -> dict:
    """A record as fixed-shape arrays: its size, CRC and first bytes."""
    return {"size": np.int64(len(record)), "crc": np.int64(zlib.crc32(record)), "head": _head(record)}


def jsonl_arrays(obj: dict) -> dict:
    """A JSON object as fixed-shape arrays: its id and the CRC of its canonical JSON."""
    canonical = json.dumps(obj, sort_keys=True).encode()
    return {"id": np.int64(obj["id"]), "crc": np.int64(zlib.crc32(canonical))}


ARRAYS = {"webdataset": webdataset_arrays, "tfrecord": tfrecord_arrays, "jsonl": jsonl_arrays}


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("given", ["list", "glob"])
def test_every_record_reads_as_its_library_reads_it_over_several_files(fmt, given, tmp_path):
    paths = write_files(fmt, tmp_path / "data")
    if given == "list":  # ids run over the files in the order given
        order = paths[::-1]
        src = open_source(fmt, [str(p) for p in order], tmp_path / "idx")
    else:  # a glob: its files sorted
        order = paths
        src = open_source(fmt, str(tmp_path / "data" / f"part-*{SUFFIX[fmt]}"), tmp_path / "idx")
    per_file = [reference(fmt, p) for p in order]
    want = [r for records in per_file for r in records]
    assert src.paths == [str(p) for p in order]
    assert src.counts.tolist() == [len(r) for r in per_file] == [10, 10, 10]
    assert src.starts.tolist() == [0, 10, 20, 30] and len(src) == len(want) == 30
    assert src.name == order[0].name[: -len(SUFFIX[fmt])]
    assert read_all(src) == want  # file order
    rng = np.random.default_rng(7)
    ids = np.concatenate([rng.permutation(len(src)), rng.integers(0, len(src), size=40)])  # shuffled, with repeats
    assert list(src.read_many(ids)) == [want[i] for i in ids]
    assert src[0] == want[0] and src[len(src) - 1] == want[-1]
    assert list(src.read_many(np.array([5, 5, 5]))) == [want[5]] * 3
    assert list(src.read_many(np.array([], dtype=np.int64))) == []


def test_webdataset_samples_from_tarwriter_cover_the_hard_members(tmp_path):
    """TarWriter's shards: folder-prefixed keys, a folder with a dot, the two-dot ``seg.png``, 0-byte and
    512-multiple members, a pax header before every member (float mtime), a key past 100 bytes (pax path)."""
    path = tmp_path / "shard.tar"
    samples = make_webdataset_samples(32, seed=3)
    write_webdataset(path, samples)
    want = read_webdataset(path)
    assert want == samples  # the library's own round trip
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    assert all("mtime" in m.pax_headers for m in members)  # a pax header before each member
    assert any(len(m.name) > 100 and "path" in m.pax_headers for m in members)
    sizes = {len(v) for s in want for k, v in s.items() if k != "__key__"}
    assert {0, 512, 1024, 10240, 20480} <= sizes
    assert any("seg.png" in s for s in want) and any(s["__key__"].startswith("a.b/") for s in want)
    src = WebDatasetSource(path, index_cache=tmp_path / "idx")
    assert read_all(src) == want
    ids = np.random.default_rng(1).permutation(len(src))
    assert list(src.read_many(ids)) == [want[i] for i in ids]


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_webdataset_groups_members_as_the_library_does(tmp_path, tar_format):
    """Uppercase extensions lowercased, directories and ``__meta__`` files skipped (also inside a sample),
    a key seen before starting a new sample, a long key (pax path / GNU long name / ustar prefix)."""
    long_key = "deep/" + "d" * 120 + "/000003"
    members: list[tuple[str, bytes | None]] = [
        ("top/", None),
        ("__meta__", b"metadata"),
        ("__meta__/info.json", b"{}"),
        ("top/x.y/000000.TXT", b"upper"),
        ("top/x.y/000000.Seg.PNG", b"\x89PNG" + bytes(508)),  # 512 bytes
        ("top/x.y/000000/", None),  # a directory inside the sample: skipped, the sample goes on
        ("top/x.y/000000.json", b'{"a": 1}'),
        ("k/000001.txt", b""),
        (f"{long_key}.txt", b"long" * 256),
        (f"{long_key}.cls", b"3"),
        ("k/000001.cls", b"7"),  # k/000001 again: a new sample
    ]
    path = tmp_path / "special.tar"
    write_tar(path, members, fmt=tar_format)
    want = read_webdataset(path)
    assert want == [
        {"__key__": "top/x.y/000000", "txt": b"upper", "seg.png": b"\x89PNG" + bytes(508), "json": b'{"a": 1}'},
        {"__key__": "k/000001", "txt": b""},
        {"__key__": long_key, "txt": b"long" * 256, "cls": b"3"},
        {"__key__": "k/000001", "cls": b"7"},
    ]
    src = WebDatasetSource(path, index_cache=tmp_path / "idx")
    assert len(src) == 4
    assert read_all(src) == want
    assert list(src.read_many(np.array([3, 0, 2, 1, 3]))) == [want[i] for i in (3, 0, 2, 1, 3)]


@pytest.mark.parametrize("mtime", [None, 0], ids=["float-mtime", "int-mtime"])
def test_webdataset_shards_with_and_without_pax_headers(tmp_path, mtime):
    path = tmp_path / "s.tar"
    write_webdataset(path, make_webdataset_samples(20, seed=5), mtime=mtime)
    assert read_all(WebDatasetSource(path, index_cache=tmp_path / "idx")) == read_webdataset(path)


@pytest.mark.parametrize("ending", ["no-final-newline", "trailing-blanks", "final-newline"])
def test_jsonl_blank_lines_crlf_unicode_and_field(tmp_path, ending):
    lines = [
        b"\n",  # a blank first line
        '{"id": 0, "text": "a\u2028b\u2029c\x85d", "k": [1]}\r\n'.encode(),  # raw U+2028/U+2029/NEL, CRLF
        b"   \t \n",  # whitespace only
        b"\r\n",  # a blank CRLF line
        b'  \t{"id": 1, "text": "leading whitespace"}\n',
        '{"id": 2, "text": "caf\u00e9 \U0001f980 \\u2028 escaped", "k": null}\n'.encode(),
        b"\n\n",
        b'{"id": 3, "text": "", "k": {"n": 2}}',
    ]
    tail = {"no-final-newline": b"", "trailing-blanks": b"\n \t\r\n  ", "final-newline": b"\n"}[ending]
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"".join(lines) + tail)
    want = read_jsonl(path, skip_blank=True)
    assert [o["id"] for o in want] == [0, 1, 2, 3]
    assert want[0]["text"] == "a\u2028b\u2029c\x85d"
    src = JsonlSource(path, index_cache=tmp_path / "idx")
    assert len(src) == 4 and src.name == "docs"
    assert read_all(src) == want
    assert list(src.read_many(np.array([3, 1, 3, 0]))) == [want[i] for i in (3, 1, 3, 0)]
    texts = JsonlSource(path, field="text", index_cache=tmp_path / "idx")
    assert read_all(texts) == [o["text"] for o in want]
    keys = JsonlSource(path, field="id", index_cache=tmp_path / "idx")
    assert read_all(keys) == [0, 1, 2, 3]


def test_jsonl_objects_escaped_and_raw(tmp_path):
    objects = make_json_objects(40, seed=2)
    for ensure_ascii in (True, False):
        path = tmp_path / f"o-{ensure_ascii}.ndjson"
        write_jsonl(path, objects, ensure_ascii=ensure_ascii, final_newline=ensure_ascii)
        src = JsonlSource(path, index_cache=tmp_path / "idx")
        assert src.name == f"o-{ensure_ascii}"
        assert read_all(src) == read_jsonl(path) == objects


def test_tfrecord_examples_and_the_tfrecord_index(tmp_path):
    """``tf.train.Example`` records from TFRecordWriter.write; the offsets found equal tfrecord2idx's."""
    path = tmp_path / "ex.tfrecords"
    datums = [{"label": (i, "int"), "x": ([0.5 * i, -1.0], "float"), "b": (b"\0" * i, "byte")} for i in range(25)]
    want = write_tfrecord_examples(path, datums)
    assert read_tfrecords(path) == want
    src = TFRecordSource(path, index_cache=tmp_path / "idx")
    assert src.name == "ex" and read_all(src) == want
    index = write_tfrecord_index(path, tmp_path / "ex.index")
    assert src.offsets(0).tolist() == [o for o, _ in index] + [index[-1][0] + index[-1][1]]


@pytest.mark.parametrize(
    ("fmt", "file", "name"),
    [
        ("webdataset", "shard-000.tar", "shard-000"),
        ("webdataset", "SHARD.TAR", "SHARD"),
        ("webdataset", "data", "data"),
        ("tfrecord", "a.tfrecord", "a"),
        ("tfrecord", "a.tfrecords", "a"),
        ("tfrecord", "a.tfrec", "a"),
        ("jsonl", "d.jsonl", "d"),
        ("jsonl", "d.ndjson", "d"),
        ("jsonl", "d.json", "d"),
        ("jsonl", "d.jsonl.txt", "d.jsonl.txt"),
    ],
)
def test_default_name_is_the_first_file_without_its_suffix(tmp_path, fmt, file, name):
    (path,) = write_files(fmt, tmp_path / "w", n_files=1, per_file=3)
    path = path.rename(tmp_path / file)
    assert open_source(fmt, path, tmp_path / "idx").name == name
    assert open_source(fmt, path, tmp_path / "idx", name="mine").name == "mine"


# --------------------------------------------------------------------------- the index


@pytest.mark.parametrize("fmt", FORMATS)
def test_index_is_built_then_cached_and_found_for_a_copy_elsewhere(fmt, tmp_path):
    paths = write_files(fmt, tmp_path / "data", n_files=2)
    want = [r for p in paths for r in reference(fmt, p)]
    idx = tmp_path / "idx"
    src = open_source(fmt, paths, idx)
    assert src.index_sources == ["built", "built"]
    cached = built_indexes(idx)
    assert [p.name for p in cached] == sorted(
        f"{src.FORMAT}-{size}-{content}.idx" for size, content in zip(src.sizes, src.contents)
    )
    for k in range(2):
        got, why = offsets_mod.load(
            offsets_mod.cache_path(src.FORMAT, src.sizes[k], src.contents[k], idx),
            src.FORMAT,
            src.sizes[k],
            src.contents[k],
        )
        assert why == "verified" and got.tolist() == src.offsets(k).tolist()
    again = open_source(fmt, paths, idx)
    assert again.index_sources == ["cache", "cache"] and read_all(again) == want
    copy = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "data", copy)
    moved = open_source(fmt, sorted(copy.iterdir()), idx)  # keyed by the file's identity, not its path
    assert moved.index_sources == ["cache", "cache"] and read_all(moved) == want
    assert built_indexes(idx) == cached  # nothing new built
    renamed = tmp_path / "renamed" / f"other{SUFFIX[fmt]}"
    renamed.parent.mkdir()
    shutil.copy(paths[1], renamed)
    assert open_source(fmt, renamed, idx).index_sources == ["cache"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sidecar_is_used_before_the_cache(fmt, tmp_path):
    paths = write_files(fmt, tmp_path / "data", n_files=2)
    want = [r for p in paths for r in reference(fmt, p)]
    src = open_source(fmt, paths, tmp_path / "idx")
    for k in range(2):
        assert write_sidecar(src, k) == str(paths[k]) + ".quern.idx"
    side = open_source(fmt, paths, tmp_path / "idx2")
    assert side.index_sources == ["sidecar", "sidecar"] and read_all(side) == want
    assert not built_indexes(tmp_path / "idx2")  # nothing built, nothing cached
    assert open_source(fmt, paths, tmp_path / "idx").index_sources == ["sidecar", "sidecar"]  # before the cache
    # a sidecar that leaves the last record out (its checksum right) is checked against the file: not used
    write_sidecar(src, 0, src.offsets(0)[:-1])
    with pytest.warns(UserWarning, match=rf"sidecar index .*part-000.*is not used: .*{LEFT_OUT[fmt]}"):
        short = open_source(fmt, paths, tmp_path / "idx3")
    assert short.index_sources == ["built", "sidecar"] and read_all(short) == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_quern_index_writes_sidecars_the_sources_use(fmt, tmp_path):
    paths = write_files(fmt, tmp_path / "data", n_files=2)
    want = [r for p in paths for r in reference(fmt, p)]
    scanned = open_source(fmt, paths, tmp_path / "idx-scan")
    assert scanned.index_sources == ["built", "built"]
    done = quern_cmd("index", str(tmp_path / "data" / f"*{SUFFIX[fmt]}"))
    for k, p in enumerate(paths):
        assert f"{p}: 10 {fmt} records; index {p}.quern.idx written" in done.stdout
        got, why = offsets_mod.load(str(p) + ".quern.idx", fmt, scanned.sizes[k], scanned.contents[k])
        assert why == "verified" and got.tolist() == scanned.offsets(k).tolist()  # what a scan finds
    src = open_source(fmt, paths, tmp_path / "idx")
    assert src.index_sources == ["sidecar", "sidecar"] and read_all(src) == want
    assert not built_indexes(tmp_path / "idx")
    write_files(fmt, tmp_path / "data", n_files=2, per_file=11)  # both rewritten: file 0's sidecar is stale
    os.unlink(str(paths[1]) + ".quern.idx")  # file 1 has none
    again = quern_cmd("index", *map(str, paths))
    for p in paths:
        assert f"{p}: 11 {fmt} records; index {p}.quern.idx written" in again.stdout
    kept = quern_cmd("index", *map(str, paths))
    for p in paths:
        assert f"{p}: 11 {fmt} records; index {p}.quern.idx already right, kept" in kept.stdout
    fresh = open_source(fmt, paths, tmp_path / "idx-fresh")
    assert fresh.index_sources == ["sidecar", "sidecar"] and len(fresh) == 22
    assert read_all(fresh) == [r for p in paths for r in reference(fmt, p)]


def test_a_tfrecord_sidecar_from_the_tfrecord_packages_index(tmp_path):
    """A sidecar made from tfrecord2idx's offsets (not from quern's scan) reads every record right."""
    path = tmp_path / "r.tfrecord"
    write_tfrecords(path, make_tfrecord_payloads(30, seed=4))
    index = write_tfrecord_index(path, tmp_path / "r.index")
    theirs = np.asarray([o for o, _ in index] + [index[-1][0] + index[-1][1]], np.int64)
    size = os.path.getsize(path)
    probe = TFRecordSource(path, index_cache=tmp_path / "probe")
    offsets_mod.store(
        offsets_mod.sidecar_path(str(path)), offsets_mod.dump("tfrecord", size, probe.contents[0], theirs)
    )
    src = TFRecordSource(path, index_cache=tmp_path / "idx")
    assert src.index_sources == ["sidecar"] and read_all(src) == read_tfrecords(path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", ["other-file", "flipped-byte", "data-appended", "truncated", "not-an-index"])
def test_a_stale_or_damaged_sidecar_is_not_used(fmt, bad, tmp_path):
    paths = write_files(fmt, tmp_path / "data", n_files=2)
    src = open_source(fmt, paths, tmp_path / "idx")
    sidecar = offsets_mod.sidecar_path(str(paths[1]))
    if bad == "other-file":  # file 0's index beside file 1
        write_sidecar(src, 0, path=str(paths[1]))
        why = "made for a file of"
    elif bad == "flipped-byte":
        write_sidecar(src, 1)
        flip_byte(sidecar, -3)
        why = "checksum does not match"
    elif bad == "data-appended":  # the data file grew after its sidecar was written
        write_sidecar(src, 1)
        other = write_files(fmt, tmp_path / "more", n_files=1, per_file=1, seed=9)[0]
        if fmt == "webdataset":  # a tar ends with its end blocks: rewrite it with one more sample
            write_webdataset(paths[1], read_webdataset(paths[1]) + read_webdataset(other))
        else:
            with open(paths[1], "ab") as f:
                f.write(other.read_bytes())
        why = "made for a file of"
    elif bad == "truncated":
        write_sidecar(src, 1)
        os.truncate(sidecar, os.path.getsize(sidecar) - 8)
        why = "partial or damaged"
    else:
        Path(sidecar).write_bytes(b"not an index" * 20)
        why = "wrong magic"
    want = [r for p in paths for r in reference(fmt, p)]
    with pytest.warns(UserWarning, match=rf"sidecar index .*part-001{SUFFIX[fmt]}\.quern\.idx is not used: .*{why}"):
        again = open_source(fmt, paths, tmp_path / "fresh")
    assert again.index_sources == ["built", "built"]
    assert read_all(again) == want


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", ["flipped-offset", "flipped-header", "truncated", "emptied"])
def test_a_damaged_cached_index_is_rebuilt(fmt, damage, tmp_path):
    (path,) = write_files(fmt, tmp_path / "data", n_files=1)
    src = open_source(fmt, path, tmp_path / "idx")
    cached = offsets_mod.cache_path(src.FORMAT, src.sizes[0], src.contents[0], tmp_path / "idx")
    good = Path(cached).read_bytes()
    if damage == "flipped-offset":
        flip_byte(cached, 128 + 8 * 3)
    elif damage == "flipped-header":
        flip_byte(cached, 30)  # inside the data size field
    elif damage == "truncated":
        os.truncate(cached, 128 + 8)
    else:
        Path(cached).write_bytes(b"")
    assert offsets_mod.load(cached, src.FORMAT, src.sizes[0], src.contents[0])[0] is None
    with pytest.warns(UserWarning, match=r"the cached index .*\.idx is not used"):
        again = open_source(fmt, path, tmp_path / "idx")
    assert again.index_sources == ["built"]
    assert read_all(again) == reference(fmt, path)
    assert Path(cached).read_bytes() == good  # stored again
    assert open_source(fmt, path, tmp_path / "idx").index_sources == ["cache"]


def test_load_refuses_each_bad_index_with_its_reason(tmp_path):
    sample = "ab" * 16
    good = offsets_mod.dump("jsonl", 100, sample, np.array([0, 10, 100]))
    got, why = offsets_mod.load(good, "jsonl", 100, sample)
    assert why == "verified" and got.tolist() == [0, 10, 100] and got.dtype == np.int64
    stored = str(tmp_path / "i" / "x.idx")
    offsets_mod.store(stored, good)
    assert offsets_mod.load(stored, "jsonl", 100, sample)[0].tolist() == [0, 10, 100]
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF  # the last offset
    checksum = bytearray(good)
    checksum[60] ^= 0x01  # inside the header's checksum
    cases = {
        "wrong magic": (b"QUERNOX9" + good[8:], "jsonl", 100, sample),
        "an old format (version 1": (b"QUERNOX1" + good[8:], "jsonl", 100, sample),
        "an index of a jsonl file, not tfrecord": (good, "tfrecord", 100, sample),
        "made for a file of 100 bytes, not 101": (good, "jsonl", 101, sample),
        "made for other contents of a file of this size": (good, "jsonl", 100, "cd" * 16),
        "its checksum does not match (damaged)": (bytes(flipped), "jsonl", 100, sample),
        "its checksum does not match": (bytes(checksum), "jsonl", 100, sample),
        "(partial or damaged)": (good[:-8], "jsonl", 100, sample),
        "shorter than its header": (good[:100], "jsonl", 100, sample),
        "do not fit the file": (offsets_mod.dump("jsonl", 100, sample, np.array([0, 200])), "jsonl", 100, sample),
        "do not fit": (offsets_mod.dump("jsonl", 100, sample, np.array([0, 10, 10, 20])), "jsonl", 100, sample),
        "not built yet": (str(tmp_path / "missing.idx"), "jsonl", 100, sample),
    }
    for reason, (data, fmt, size, smp) in cases.items():
        got, why = offsets_mod.load(data, fmt, size, smp)
        assert got is None and reason in why, (reason, why)


# --------------------------------------------------------------------------- pickling and worker processes


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_pickled_source_reads_the_same_records(fmt, tmp_path):
    paths = write_files(fmt, tmp_path / "data", n_files=2)
    src = open_source(fmt, paths, tmp_path / "idx")
    ids = np.random.default_rng(3).permutation(len(src))
    want = list(src.read_many(ids))
    blob = pickle.dumps(src)
    copy = pickle.loads(blob)
    assert list(copy.read_many(ids)) == want and len(copy) == len(src) and copy.identity() == src.identity()
    assert pickle.loads(pickle.dumps(copy)).read_many(ids) == want
    # the offsets travel as their index file, verified again where unpickled; where it is missing
    # (another machine, a cleaned cache) the file is indexed again there
    for k in range(2):
        os.unlink(offsets_mod.cache_path(src.FORMAT, src.sizes[k], src.contents[k], tmp_path / "idx"))
    assert pickle.loads(blob).read_many(ids) == want
    # an index file that now leaves the last record out (its checksum right) is checked against the file,
    # refused and made again
    k0 = offsets_mod.cache_path(src.FORMAT, src.sizes[0], src.contents[0], tmp_path / "idx")
    offsets_mod.store(k0, offsets_mod.dump(src.FORMAT, src.sizes[0], src.contents[0], src.offsets(0)[:-1]))
    with pytest.warns(UserWarning, match=rf"the cached index .* is not used: .*{LEFT_OUT[fmt]}"):
        assert pickle.loads(blob).read_many(ids) == want


def test_a_pickled_jsonl_source_keeps_its_field(tmp_path):
    (path,) = write_files("jsonl", tmp_path / "data", n_files=1)
    src = JsonlSource(path, field="text", index_cache=tmp_path / "idx")
    copy = pickle.loads(pickle.dumps(src))
    assert copy.field == "text" and read_all(copy) == [o["text"] for o in read_jsonl(path)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_worker_processes_give_the_batches_of_batch_at(fmt, tmp_path):
    paths = write_files(fmt, tmp_path / "data")
    want = [r for p in paths for r in reference(fmt, p)]
    src = open_source(fmt, str(tmp_path / "data" / "part-*"), tmp_path / "idx")
    fn = ARRAYS[fmt]
    plain = quern.Pipeline.from_source(src, seed=1).map(fn).batch(4)
    for step in range(3):  # unshuffled: the records of the library, in order
        rows = [fn(want[i]) for i in range(4 * step, 4 * step + 4)]
        assert_batches_equal(plain.batch_at(step), {k: np.stack([r[k] for r in rows]) for k in rows[0]}, f"step {step}")
    pipe = quern.Pipeline.from_source(src, seed=11).shuffle().map(fn).batch(4)
    with pipe.iterator(num_workers=2) as it:
        for step in range(12):  # past one epoch (7 steps)
            assert_batches_equal(next(it), pipe.batch_at(step), f"{fmt} step {step}")
        assert it.stats()["computed_in_parent"] == 0


# --------------------------------------------------------------------------- identity


def _payload_offset(fmt: str, path: Path) -> int:
    """The offset of a byte inside a record's payload (changing it breaks no framing)."""
    data = path.read_bytes()
    if fmt == "webdataset":
        return data.index(b"\xff\xd8\xff") + 3  # inside a jpg
    if fmt == "tfrecord":
        return 16 + 12  # record 1's first data byte (record 0 is empty)
    return data.index(b'"plain') + 2  # inside a string


@pytest.mark.parametrize("fmt", FORMATS)
def test_identity_follows_the_content_not_the_folder(fmt, tmp_path):
    (path,) = write_files(fmt, tmp_path / "data", n_files=1)
    first = open_source(fmt, path, tmp_path / "idx").identity()
    assert first["files"][0]["file"] == path.name and first["files"][0]["records"] == 10
    assert first["files"][0]["size"] == os.path.getsize(path)
    (tmp_path / "copy").mkdir()
    shutil.copy(path, tmp_path / "copy" / path.name)
    assert open_source(fmt, tmp_path / "copy" / path.name, tmp_path / "idx").identity() == first
    flip_byte(path, _payload_offset(fmt, path))  # same size, a byte changed (a small file is hashed whole)
    with pytest.warns(UserWarning, match="changed in place since it was last opened here"):
        flipped = open_source(fmt, path, tmp_path / "idx")
    assert flipped.index_sources == ["built"]  # another file: its own index
    assert flipped.identity() != first and flipped.identity()["files"][0]["size"] == first["files"][0]["size"]
    write_files(fmt, tmp_path / "data", n_files=1, per_file=11)  # rewritten, one record more
    with pytest.warns(UserWarning, match="changed in place since it was last opened here"):
        grown = open_source(fmt, path, tmp_path / "idx").identity()
    assert grown["files"][0]["records"] == 11 and grown["files"][0]["size"] != first["files"][0]["size"]
    assert grown != first


def test_jsonl_field_is_part_of_the_identity(tmp_path):
    (path,) = write_files("jsonl", tmp_path / "data", n_files=1)
    whole = JsonlSource(path, index_cache=tmp_path / "idx").identity()
    text = JsonlSource(path, field="text", index_cache=tmp_path / "idx").identity()
    assert whole["field"] is None and text["field"] == "text"
    assert len({json.dumps(i, sort_keys=True) for i in (whole, text)}) == 2
    assert JsonlSource(path, field="text", index_cache=tmp_path / "idx").identity() == text


def test_a_big_file_change_outside_the_sampled_bytes_changes_the_identity_and_the_index(tmp_path):
    """Over 1 MiB the sampled hash reads ranges of a file; the content hash reads every byte: a change
    outside the sampled ranges is another file (another identity, an index of its own, a warning), and
    the record's CRC still names the damaged record at read."""
    path = tmp_path / "big.tfrecord"
    payloads = [bytes([i]) * 50_000 for i in range(40)]  # 2 MB
    write_tfrecords(path, payloads)
    size = os.path.getsize(path)
    first = TFRecordSource(path, index_cache=tmp_path / "idx")
    ident = first.identity()
    off = first.offsets(0)
    ranges = sample_ranges(size)
    assert len(ranges) > 1

    def sampled(at: int) -> bool:
        return any(lo <= at < hi for lo, hi in ranges)

    unsampled = [k for k in range(40) if not any(sampled(a) for a in range(int(off[k]), int(off[k + 1])))]
    assert unsampled, "some record lies wholly outside the sampled ranges"
    k = unsampled[0]
    flip_byte(path, int(off[k]) + 12 + 100)  # a data byte no sampled range reads
    assert tfrecord_crc_errors(path) == [k]
    with pytest.warns(UserWarning, match=r"big\.tfrecord' changed in place .* its old contents is not used"):
        same = TFRecordSource(path, index_cache=tmp_path / "idx")
    assert same.identity() != ident and same.index_sources == ["built"]
    assert same.identity()["files"][0]["records"] == 40 and same.offsets(0).tolist() == off.tolist()
    others = np.array([i for i in range(40) if i != k])
    assert list(same.read_many(others)) == [payloads[i] for i in others]
    with pytest.raises(SourceError, match=rf"big\.tfrecord' record {k} .*data's CRC does not match"):
        same.read_many(np.array([k]))
    flip_byte(path, int(off[k]) + 12 + 100)  # back: the first file again, its index found in the cache
    with pytest.warns(UserWarning, match="changed in place"):
        back = TFRecordSource(path, index_cache=tmp_path / "idx")
    assert back.identity() == ident and back.index_sources == ["cache"]


# --------------------------------------------------------------------------- URLs


@needs_nginx
@pytest.mark.parametrize("fmt", FORMATS)
def test_urls_read_like_the_local_files_and_use_a_sidecar_beside_them(fmt, tmp_path):
    www = tmp_path / "www"
    paths = write_files(fmt, www, n_files=2)
    want = [r for p in paths for r in reference(fmt, p)]
    local = open_source(fmt, paths, tmp_path / "idx-local")
    with nginx(www) as srv:
        urls = [f"{srv.url}/{p.name}" for p in paths]
        remote = open_source(fmt, urls, tmp_path / "idx-remote", cache=ShardCache(tmp_path / "cache"))
        assert remote.urls == urls and remote.index_sources == ["built", "built"]
        assert all(Path(p).is_relative_to(tmp_path / "cache") for p in remote.paths)
        ids = np.random.default_rng(5).permutation(len(want))
        assert list(remote.read_many(ids)) == [want[i] for i in ids]
        assert remote.identity() == local.identity() and remote.name == local.name
        assert remote.config()["paths"] == urls
        assert pickle.loads(pickle.dumps(remote)).read_many(ids) == [want[i] for i in ids]
        for k in range(2):  # sidecars beside the URLs
            write_sidecar(local, k)
        side = open_source(fmt, urls, tmp_path / "idx-side", cache=ShardCache(tmp_path / "cache2"))
        assert side.index_sources == ["sidecar", "sidecar"] and read_all(side) == want
        served = {r.path for r in srv.requests() if r.method == "GET"}
        assert {f"/{p.name}.quern.idx" for p in paths} <= served
        again = open_source(fmt, urls, tmp_path / "idx-side", cache=ShardCache(tmp_path / "cache2"))
        assert again.index_sources == ["cache", "cache"] and read_all(again) == want


@needs_nginx
def test_a_damaged_sidecar_beside_a_url_is_not_used(tmp_path):
    www = tmp_path / "www"
    (path,) = write_files("jsonl", www, n_files=1)
    local = JsonlSource(path, index_cache=tmp_path / "idx-local")
    flip_byte(write_sidecar(local, 0), -1)
    with nginx(www) as srv:
        url = f"{srv.url}/{path.name}"
        with pytest.warns(UserWarning, match=r"sidecar index http://.*\.quern\.idx is not used: .*checksum"):
            remote = JsonlSource(url, index_cache=tmp_path / "idx", cache=ShardCache(tmp_path / "cache"))
        assert remote.index_sources == ["built"] and read_all(remote) == read_jsonl(path)


def test_import_quern_leaves_crc32c_out_until_a_crc_is_checked():
    """``import quern`` does not import ``crc32c`` (which imports ``importlib.metadata``: about 40 ms of every
    command's start); the first TFRecord CRC imports it and checks with it."""
    code = (
        "import sys, quern\n"
        "print('crc32c' in sys.modules)\n"
        "from quern.pipeline.sources.tfrecord import masked_crc\n"
        "print(hex(masked_crc(b'')), hex(masked_crc(b'123456789')), 'crc32c' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # CRC-32C("123456789") is 0xe3069283 (RFC 3720's check value), masked as TFRecord frames hold it
    crc = 0xE3069283
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert out.stdout.splitlines() == ["False", f"0xa282ead8 {hex(masked)} True"], out.stdout


def test_the_fork_servers_preloads_name_crc32c_for_tfrecord_whether_or_not_this_process_imported_it(
    tmp_path, monkeypatch
):
    """A TFRecord source read through a cached index has computed no CRC here: the modules the workers' fork
    server imports before it forks them (``preloads``) still name crc32c, so no worker imports it itself."""
    from quern.pipeline.iterate.workers.handles import preloads

    path = tmp_path / "a.tfrecord"
    write_tfrecords(path, make_tfrecord_payloads(6))
    records = quern.Pipeline.from_source(TFRecordSource(str(path), index_cache=tmp_path / "idx"), seed=0)
    monkeypatch.delitem(sys.modules, "crc32c", raising=False)
    assert preloads(records.batch(2)) == ("crc32c",)
    other = quern.Pipeline.from_source({"x": np.arange(4)}, seed=0)
    mixed = quern.mix({"a": records, "b": other}, weights={"a": 0.5, "b": 0.5}, seed=1)
    assert preloads(mixed.batch(2)) == ("crc32c",)  # a mixture counts its components' readers
