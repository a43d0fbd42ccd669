"""Tests of ``quern prepare`` on WebDataset tar shards and TFRecord files (prepare/inputs.py, records.py).

Every input is written here by its own library (``webdataset.TarWriter``, the ``tfrecord``
package's writer and framing: ``tests/formatfiles.py``), and every expected record is what
that library reads back (``formatfiles.read_webdataset``, ``formatfiles.read_tfrecords``),
never what quern's sources read. The prepared folders are read with ``ArrayRecordSource``.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import formatfiles as ff
import numpy as np
import pytest
from helpers import prepare_cli, prepared_records, run_prepare, tree

import quern
from quern.pipeline.sources.webdataset import WebDatasetSource, read_sample
from quern.prepare import PrepareError, prepare

pytestmark = pytest.mark.timeout(120)


def _prepare(inp, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    return prepare(inp, out, **kw)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A WebDataset shard of 40 varied samples (pax headers, long names, two-dot extensions, 0 to ~100 KB
    members), and the samples as the webdataset library reads it."""
    path = tmp_path_factory.mktemp("wds") / "shard-000.tar"
    ff.write_webdataset(path, ff.make_webdataset_samples(40, seed=1))
    return path, ff.read_webdataset(path)


# --------------------------------------------------------------------------- TFRecord


def test_tfrecord_records_are_the_record_bytes_in_file_order(tmp_path):
    payloads = ff.make_tfrecord_payloads(60, seed=2)  # 0 bytes to ~50 KB
    paths = [tmp_path / "in" / "a.tfrecord", tmp_path / "in" / "b.tfrec"]
    os.makedirs(paths[0].parent)
    ff.write_tfrecords(paths[0], payloads[:35])
    ff.write_tfrecords(paths[1], payloads[35:])
    (tmp_path / "in" / "c.tfrecords").write_bytes(b"")  # no record: a valid empty file
    expected = ff.read_tfrecords(paths[0]) + ff.read_tfrecords(paths[1])
    assert expected == payloads

    m = _prepare(str(tmp_path / "in" / "*"), tmp_path / "out", shard_size="64KB")
    assert prepared_records(tmp_path / "out") == expected
    assert len(m["shards"]) > 3  # items of whole records, several per file
    assert m["input"]["inputs"] == [
        {"name": "*", "format": "tfrecord", "files": 3, "bytes": sum(len(p) + ff.TFRECORD_OVERHEAD for p in payloads)}
    ]
    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    assert src.metadata["length"].tolist() == [len(p) for p in payloads]


def test_tfrecord_cut_short_is_an_error_naming_it(tmp_path):
    path = tmp_path / "cut.tfrecord"
    ff.write_tfrecords_cut_short(path, ff.make_tfrecord_payloads(5))
    with pytest.raises(PrepareError, match=r"'cut\.tfrecord'.*not a readable TFRecord file.*cut short"):
        _prepare(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_tfrecord_bad_data_crc_is_a_record_error(tmp_path):
    """A damaged record's data (its length CRC intact) is found when read: an error naming the file, or skipped."""
    path = tmp_path / "d.tfrecord"
    payloads = [b"a" * 100, b"b" * 100, b"c" * 100]
    ff.write_tfrecords(path, payloads)
    ff.flip_byte(path, ff.TFRECORD_OVERHEAD + 100 + 12 + 50)  # inside record 1's data
    assert ff.tfrecord_crc_errors(path) == [1]
    with pytest.raises(PrepareError, match=r"d\.tfrecord record 1: .*CRC"):
        _prepare(path, tmp_path / "out")
    m = _prepare(path, tmp_path / "out2", skip_errors=True)
    assert prepared_records(tmp_path / "out2") == [payloads[0], payloads[2]]
    assert m["skipped"]["count"] == 1 and m["skipped"]["first"][0]["where"] == "d.tfrecord record 1"


# --------------------------------------------------------------------------- WebDataset


def _library_sample(record: bytes, tmp_path) -> dict:
    """The sample the webdataset library reads from a tar holding ``record``'s bytes."""
    path = tmp_path / "one.tar"
    path.write_bytes(record)
    (sample,) = ff.read_webdataset(path)
    return sample


def test_webdataset_sample_kept_whole_as_a_tar(tmp_path, shard):
    path, samples = shard
    m = _prepare(path, tmp_path / "out", shard_size="128KB")
    assert len(m["shards"]) > 3
    assert m["input"]["inputs"][0]["format"] == "webdataset"
    records = prepared_records(tmp_path / "out")
    assert [read_sample(r) for r in records] == samples
    with open(path, "rb") as f:
        data = f.read()
    for record, sample in zip(records, samples):
        assert record.endswith(bytes(1024)) and record[:-1024] in data  # the shard's own bytes, then the end blocks
        assert _library_sample(record, tmp_path) == sample  # webdataset reads it back
        with tarfile.open(fileobj=io.BytesIO(record)) as tar:  # and so does tarfile
            members = {i.name[len(sample["__key__"]) + 1 :]: tar.extractfile(i).read() for i in tar.getmembers()}
            assert members == {k: v for k, v in sample.items() if k != "__key__"}


def test_webdataset_member_is_the_record(tmp_path, shard, capsys):
    """``--member JPG`` (the CLI): the record is each sample's jpg bytes; a folder with ``--format webdataset``
    reads its tars in path order and leaves their offset sidecars (``quern index``) out."""
    path, samples = shard
    folder = tmp_path / "in"
    folder.mkdir()
    more = ff.make_webdataset_samples(7, seed=3)
    ff.write_webdataset(folder / "b.tar", more)
    os.symlink(path, folder / "a.tar")
    WebDatasetSource.write_sidecars([str(folder / "a.tar"), str(folder / "b.tar")])
    assert sorted(os.listdir(folder)) == ["a.tar", "a.tar.quern.idx", "b.tar", "b.tar.quern.idx"]

    rc, out, err = prepare_cli(
        capsys, folder, "--output", tmp_path / "out", "--format", "webdataset", "--member", "JPG", "--workers", "0"
    )
    assert rc == 0, err
    assert "prepared 47 records" in out
    assert prepared_records(tmp_path / "out") == [s["jpg"] for s in samples + ff.read_webdataset(folder / "b.tar")]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["options"]["member"] == "jpg"
    (described,) = manifest["input"]["inputs"]
    assert (described["name"], described["format"], described["files"]) == ("in", "webdataset", 2)
    rc, out, err = prepare_cli(capsys, folder / "*", "--output", tmp_path / "glob", "--member", "jpg", "--workers", "0")
    assert rc == 0, err  # by name: the tars, and not their sidecars
    assert prepared_records(tmp_path / "glob") == prepared_records(tmp_path / "out")


def test_webdataset_sample_without_the_member(tmp_path, shard):
    path, samples = shard
    missing = [i for i, s in enumerate(samples) if "json" not in s]
    assert missing and missing[0] == 4
    key = samples[4]["__key__"]
    with pytest.raises(
        PrepareError, match=rf"shard-000\.tar sample 4 \(key '{key}'\): this sample has no member 'json'"
    ):
        _prepare(path, tmp_path / "out", member="json")
    m = _prepare(path, tmp_path / "out2", member=".json", skip_errors=True)
    assert prepared_records(tmp_path / "out2") == [s["json"] for s in samples if "json" in s]
    assert m["skipped"]["count"] == len(missing)
    assert [e["where"] for e in m["skipped"]["first"]] == [
        f"shard-000.tar sample {i} (key {samples[i]['__key__']!r})" for i in missing
    ]


MAP_MODULE = '''
import json


def describe(sample):
    """The sample dict as JSON (bytes as hex), and its member count as a field."""
    assert isinstance(sample, dict) and all(isinstance(v, bytes) for k, v in sample.items() if k != "__key__")
    text = json.dumps({k: v if k == "__key__" else v.hex() for k, v in sample.items()})
    return {"record": text, "members": len(sample) - 1}
'''


def test_webdataset_map_receives_the_sample_dict(tmp_path, shard):
    path, samples = shard
    (tmp_path / "wdsmap.py").write_text(MAP_MODULE)
    args = [path, "--output", tmp_path / "out", "--map", "wdsmap:describe", "--fields", "members", "--workers", "0"]
    done = run_prepare(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = [json.loads(r) for r in prepared_records(tmp_path / "out")]
    assert got == [{k: v if k == "__key__" else v.hex() for k, v in s.items()} for s in samples]
    src = quern.sources.ArrayRecordSource(tmp_path / "out")
    assert src.metadata["members"].tolist() == [len(s) - 1 for s in samples]


def test_webdataset_and_tfrecord_in_worker_processes_give_the_same_bytes(tmp_path, shard):
    path, _ = shard
    ff.write_tfrecords(tmp_path / "r.tfrecord", ff.make_tfrecord_payloads(30, seed=4))
    inputs = [path, tmp_path / "r.tfrecord"]
    one = _prepare(inputs, tmp_path / "one", shard_size="256KB")
    two = _prepare(inputs, tmp_path / "two", shard_size="256KB", num_workers=2)
    assert one == two and len(one["shards"]) > 2
    assert tree(tmp_path / "one") == tree(tmp_path / "two")


@pytest.mark.parametrize("how", ["gzip", "gzip-by-format", "truncated", "not-a-tar"])
def test_webdataset_unreadable_shard_is_an_error_naming_it(tmp_path, shard, how):
    path, _ = shard
    kw = {}
    if how == "gzip":
        bad = tmp_path / "packed.tar"
        ff.gzip_copy(path, bad)
        match = r"'packed\.tar' .* is gzip-compressed"
    elif how == "gzip-by-format":
        bad = tmp_path / "packed.tar.gz"
        ff.gzip_copy(path, bad)
        kw["format"] = "webdataset"
        match = r"'packed\.tar\.gz' .* is gzip-compressed"
    elif how == "truncated":
        bad = tmp_path / "cut.tar"
        bad.write_bytes(path.read_bytes()[:50_000])
        match = r"'cut\.tar' .* is not a readable WebDataset tar shard: .*(cut short|truncated)"
    else:
        bad = tmp_path / "text.tar"
        bad.write_bytes(b"just some text, not a tar\n" * 40)
        match = r"'text\.tar' .* is not a readable WebDataset tar shard: .*bad tar header"
    with pytest.raises(PrepareError, match=match):
        _prepare(bad, tmp_path / "out", **kw)


def test_empty_shard_adds_nothing_and_member_needs_a_tar(tmp_path, shard):
    path, samples = shard
    ff.write_webdataset(tmp_path / "empty.tar", [])  # end blocks only: a tar of no sample
    m = _prepare([tmp_path / "empty.tar", path], tmp_path / "out", member="cls")
    assert prepared_records(tmp_path / "out") == [s["cls"] for s in samples]
    assert [i["files"] for i in m["input"]["inputs"]] == [1, 1]
    ff.write_tfrecords(tmp_path / "r.tfrecord", [b"x"])
    with pytest.raises(ValueError, match="member applies to WebDataset tar shards"):
        _prepare(tmp_path / "r.tfrecord", tmp_path / "out2", member="jpg")


CHANGE_MODULE = '''
import os

TARGET = os.environ["QUERN_TEST_TARGET"]


def grow(sample):
    """Append to the input shard while prepare reads it."""
    with open(TARGET, "ab") as f:
        f.write(bytes(512))
    return sample["cls"]
'''


def test_webdataset_shard_changed_during_the_run(tmp_path, shard):
    path, _ = shard
    target = tmp_path / "mine.tar"
    target.write_bytes(path.read_bytes())
    (tmp_path / "growmap.py").write_text(CHANGE_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["QUERN_TEST_TARGET"] = str(target)
    done = run_prepare(
        target, "--output", tmp_path / "out", "--map", "growmap:grow", "--workers", "0", cwd=tmp_path, env=env
    )
    assert done.returncode == 1
    assert "'mine.tar'" in done.stderr and "changed during the run" in done.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_read_sample_refuses_what_is_not_one_sample():
    def tar(*members):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    assert read_sample(tar(("k.txt", b"a"), ("__meta__", b"m"), ("k.Seg.PNG", b"p"))) == {
        "__key__": "k",
        "txt": b"a",
        "seg.png": b"p",
    }
    with pytest.raises(quern.SourceError, match="more than one sample"):
        read_sample(tar(("a.txt", b"a"), ("b.txt", b"b")))
    with pytest.raises(quern.SourceError, match="no sample"):
        read_sample(tar())
    with pytest.raises(quern.SourceError, match="cut short"):
        read_sample(tar(("a.txt", b"x" * 1000))[:700])
    assert np.array_equal(np.frombuffer(read_sample(tar(("a.bin", b"\x01\x02")))["bin"], np.uint8), [1, 2])


def test_a_jsonl_sidecar_beside_its_file_is_not_an_input(tmp_path):
    """``quern index`` writes ``x.jsonl.quern.idx``: a glob or a folder holding both reads the lines only."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "x.jsonl").write_text("".join(json.dumps({"t": i}) + "\n" for i in range(5)))
    quern.sources.JsonlSource.write_sidecars(str(data / "x.jsonl"))
    assert (data / "x.jsonl.quern.idx").exists()
    for inputs in ([str(data / "*")], [str(data)]):
        out = tmp_path / f"out{len(inputs[0])}"
        fmt = "jsonl" if inputs[0] == str(data) else None
        manifest = quern.prepare.prepare(inputs, str(out), num_workers=0, format=fmt)
        assert manifest["records"]["count"] == 5, inputs
