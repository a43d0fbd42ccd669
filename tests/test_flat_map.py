"""Tests of Pipeline.flat_map (pipeline/definition/flat_mapping.py): one record to zero or more, step
addressable, on a Parquet file of documents written by pyarrow."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers import (
    assert_batches_equal,
    assert_host_slices_make_the_batch,
    assert_iterator_gives_batch_at,
    docs_folder,
    write_module,
)

import quern
from quern.pipeline.core.errors import ScanError, StepError

HELPERS = """
import numpy as np

CALLS = []


def chunk(record, size=16):
    toks = np.asarray(record["tokens"])
    return [{"tokens": toks[i : i + size], "start": np.int64(i)} for i in range(0, len(toks), size)]


def chunk_long_only(record):
    toks = np.asarray(record["tokens"])
    return [] if len(toks) < 20 else chunk(record)


def not_a_list(record):
    return (x for x in [record])


def grows(record):  # more outputs at each call: the count scan and a read disagree
    CALLS.append(1)
    return [record] * len(CALLS)


def long_doc(record):
    return len(record["tokens"]) >= 20
"""


@pytest.fixture
def docs(tmp_path, isolated_cache):
    with docs_folder(tmp_path, 60, 50, seed=3, helpers=HELPERS, prefix="fm") as (d, module):
        yield d, module


def source(d):
    return quern.sources.ParquetSource(str(d / "docs.parquet"), columns=["tokens"], name="docs")


def expected_outputs(d, fn):
    """The outputs of ``fn`` over the documents in order, computed here from pyarrow's reading."""
    import pyarrow.parquet as pq

    rows = pq.read_table(d / "docs.parquet").to_pylist()
    out = []
    for i, row in enumerate(rows):
        for j, o in enumerate(fn({"tokens": np.asarray(row["tokens"], dtype=np.int32)})):
            out.append((i, j, o))
    return out


def test_outputs_in_record_order_are_the_functions_outputs_and_explain_names_record_and_output(docs):
    d, m = docs
    want = expected_outputs(d, m.chunk)
    pipe = quern.Pipeline.from_source(source(d), num_epochs=1).flat_map(m.chunk)
    assert pipe.stream_len == len(want) > 60  # documents of up to 49 tokens: 1 to 4 chunks each
    got = [pipe.batch(1).batch_at(s) for s in range(len(want))]
    for g, (_, _, o) in zip(got, want):
        assert np.array_equal(g["tokens"][0], o["tokens"]) and int(g["start"][0]) == int(o["start"])
    names = pipe.batch(4).explain(1)
    assert names == [[("docs", f"record {i} output {j}")] for i, j, _ in want[4:8]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_at_is_the_iterator_with_workers_on_one_and_two_hosts_and_after_a_resume(docs, num_workers):
    d, m = docs
    pipe = (
        quern.Pipeline.from_source(source(d), seed=5, num_epochs=3)
        .shuffle()
        .flat_map(m.chunk)
        .map(lambda r: {"n": np.int64(len(r["tokens"])), "start": r["start"]})
        .batch(4)
    )
    assert_iterator_gives_batch_at(pipe, num_workers=num_workers)
    assert_iterator_gives_batch_at(pipe, start_step=7, count=5, num_workers=num_workers)
    assert_host_slices_make_the_batch(pipe, (0, 9))


def test_a_shuffle_permutes_the_outputs_and_each_epoch_has_each_once(docs):
    d, m = docs
    want = sorted((int(o["start"]), tuple(o["tokens"].tolist())) for _, _, o in expected_outputs(d, m.chunk))
    pipe = quern.Pipeline.from_source(source(d), seed=1, num_epochs=2).shuffle().flat_map(m.chunk).batch(1)
    n = len(want)
    epochs = [[pipe.batch_at(s) for s in range(e * n, (e + 1) * n)] for e in range(2)]
    for epoch in epochs:
        assert sorted((int(b["start"][0]), tuple(b["tokens"][0].tolist())) for b in epoch) == want
    assert [int(b["start"][0]) for b in epochs[0]] != [int(b["start"][0]) for b in epochs[1]]
    after = quern.Pipeline.from_source(source(d), seed=1, num_epochs=2).flat_map(m.chunk).shuffle().batch(1)
    assert after.fingerprint() == pipe.fingerprint()  # the shuffle applies to the outputs wherever it is written


def test_filters_before_and_after_and_a_record_with_no_output(docs):
    d, m = docs
    base = quern.Pipeline.from_source(source(d), num_epochs=1)
    before = base.filter(m.long_doc).flat_map(m.chunk)
    want = [o for i, _, o in expected_outputs(d, m.chunk_long_only)]
    assert before.stream_len == len(want)
    empty = base.flat_map(m.chunk_long_only)  # short documents give no output at all
    assert empty.stream_len == len(want)
    for s in (0, len(want) - 1):
        for p in (before, empty):
            assert np.array_equal(p.batch(1).batch_at(s)["tokens"][0], want[s]["tokens"])
    after = base.flat_map(m.chunk).filter(lambda r: int(r["start"]) > 0)
    assert after.stream_len == sum(int(o["start"]) > 0 for _, _, o in expected_outputs(d, m.chunk))


def test_the_counts_are_scanned_once_and_the_fingerprint_sees_the_function_and_the_stages_before(docs, monkeypatch):
    from quern.pipeline.definition import scan

    d, m = docs
    scans = []
    real = scan._measure
    monkeypatch.setattr(scan, "_measure", lambda *a, **k: scans.append(a[2]) or real(*a, **k))
    one = quern.Pipeline.from_source(source(d)).flat_map(m.chunk)
    two = quern.Pipeline.from_source(source(d)).flat_map(m.chunk)
    assert scans == ["counts"] and one.fingerprint() == two.fingerprint()
    other = quern.Pipeline.from_source(source(d)).flat_map(m.chunk_long_only)
    mapped = quern.Pipeline.from_source(source(d)).map(lambda r: r).flat_map(m.chunk)
    assert len({one.fingerprint(), other.fingerprint(), mapped.fingerprint()}) == 3


def test_the_config_form_loads_back_to_the_same_pipeline(docs):
    d, m = docs
    pipe = (
        quern.Pipeline.from_source(source(d), seed=2, num_epochs=2)
        .shuffle()
        .filter(m.long_doc)
        .flat_map(m.chunk)
        .map(quern.transforms.pad(16, key="tokens"))
        .batch(4)
    )
    cfg = pipe.to_config()
    kinds = [t.get("kind") for t in cfg["transforms"]]
    assert kinds == ["filter", "flat_map", "map"] and cfg["transforms"][1]["fn"] == f"{m.__name__}:chunk"
    path = d / "flat.yaml"
    path.write_text(yaml.safe_dump(cfg))
    back = quern.load_config(path)
    assert back.fingerprint() == pipe.fingerprint()
    for s in (0, 5):
        assert_batches_equal(back.batch_at(s), pipe.batch_at(s), f"step {s}")


def test_pack_after_flat_map(docs):
    d, m = docs
    pipe = quern.Pipeline.from_source(source(d), num_epochs=1).flat_map(m.chunk).pack(32, key="tokens").batch(1)
    tokens = np.concatenate([o["tokens"] for _, _, o in expected_outputs(d, m.chunk)])
    rows = [pipe.batch_at(s) for s in range(pipe.num_steps)]
    packed = np.concatenate([r["tokens"][r["segment_ids"] > 0] for r in rows])
    assert sorted(packed.tolist()) == sorted(tokens.tolist())


def test_bad_functions_and_places_are_clear_errors(docs, tmp_path):
    d, m = docs
    base = quern.Pipeline.from_source(source(d))
    with pytest.raises(
        ScanError,
        match=r"flat_map stage flat_map\[0\] not_a_list, record 0 of source 'docs': it "
        r"returned generator; a flat map returns a list",
    ):
        base.flat_map(m.not_a_list)
    grows = base.flat_map(m.grows).batch(2)
    with pytest.raises(StepError, match=r"record 0 of source 'docs': it gave \d+ outputs where the count scan found"):
        grows.batch_at(0)
    with pytest.raises(TypeError, match="flat_map\\(\\) needs a callable"):
        base.flat_map(3)
    with pytest.raises(ValueError, match=r"flat_map\(\) after random_map\(\)"):
        base.random_map(lambda r, rng: r).flat_map(m.chunk)
    with pytest.raises(ValueError, match="flat_map"):
        base.batch(2).flat_map(m.chunk)
    with pytest.raises(ValueError, match="gives no output for any record"):
        base.flat_map(write_fn(tmp_path, "def none(record):\n    return []\n", "none"))
    with pytest.raises(ValueError, match="flat_map"):
        quern.mix({"a": base, "b": base}, weights=[1, 1]).flat_map(m.chunk)


def write_fn(folder, body, name):
    import importlib
    import sys

    module = write_module(folder, body, "fmfn")
    sys.path.insert(0, str(folder))
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        sys.path.remove(str(folder))


def test_the_count_scan_in_processes_counts_as_this_process_does(docs, tmp_path, monkeypatch):
    """With num_workers=2 and enough records, the counts are scanned in 2 fresh processes (each checks it loaded
    this definition): the same counts, the same outputs, and a child's error names the record."""
    from helpers import spy_scan_processes

    d, m = docs
    spawned = spy_scan_processes(monkeypatch, process_min=10)
    here = quern.Pipeline.from_source(source(d)).flat_map(m.chunk, cache_dir=tmp_path / "one", num_workers=0)
    there = quern.Pipeline.from_source(source(d)).flat_map(m.chunk, cache_dir=tmp_path / "two", num_workers=2)
    assert spawned == [2]
    assert np.array_equal(there.source.counts, here.source.counts) and there.fingerprint() == here.fingerprint()
    with pytest.raises(ScanError, match=r"flat_map stage flat_map\[0\] not_a_list, record \d+ of source 'docs'"):
        quern.Pipeline.from_source(source(d)).flat_map(m.not_a_list, cache_dir=tmp_path / "three", num_workers=2)
