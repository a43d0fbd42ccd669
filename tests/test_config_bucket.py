"""Length buckets and mixtures of packed components as configuration: the ``bucket:``
section, ``pack:`` inside a mixture's component, ``to_config`` round trips, the messages,
and the bucket and padding ``quern inspect``, ``run`` and ``explain`` print."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid

import numpy as np
import pytest
import yaml
from helpers import DELETE, assert_same_pipeline, case_ids, config_refusal, docs_folder, load_without_scan, write_config

import quern
from quern.pipeline.cli import main
from quern.pipeline.streams import BucketedStream

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("isolated_cache")]

HELPERS = '''
import numpy as np


def long_enough(record, min_len=5):
    """A filter's predicate on the Parquet records: at least ``min_len`` tokens."""
    return len(record["tokens"]) >= min_len


def shift(batch, by=1):
    return {**batch, "shifted": np.roll(batch["tokens"], -by, axis=1)}


def jitter(batch, keys):
    """A random_map_batch: a key-dependent bit per row."""
    return {**batch, "bit": (keys % 2).astype(np.int8)}


def drop_length(batch):
    return {k: v for k, v in batch.items() if k != "length"}


def plus_one(row):
    return {**row, "tokens": row["tokens"] + 1}


def mask_some(row, rng, rate=0.1):
    hit = (rng.random(row["tokens"].shape) < rate) & (row["segment_ids"] > 0)
    return {**row, "tokens": np.where(hit, 0, row["tokens"])}
'''

BOUNDS, SIZES = [32, 64, 128], [16, 8, 4]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with ``docs.parquet`` (300 documents of 1-149 tokens: a list column ``tokens``
    and a ragged ``mask``), ArrayRecord shards ``toks-*.array_record`` (600 byte records) and a
    module of helpers (importable: the folder is on ``sys.path``), where configs are written
    too: ``(folder, module)``."""
    with docs_folder(tmp_path_factory.mktemp("bucket"), 300, 150, 1, HELPERS, "quern_test_bucket") as got:
        yield got


def _parquet(d):
    return quern.sources.ParquetSource(str(d / "docs.parquet"), columns=["tokens"])


def _bucketed(d, h, **kw):
    """The Parquet documents (``tokens`` only) shuffled, filtered, in length buckets; shifted, jittered."""
    return (
        quern.Pipeline.from_source(_parquet(d), seed=4)
        .shuffle()
        .filter(functools.partial(h.long_enough, min_len=3))
        .bucket(kw.pop("bounds", BOUNDS), kw.pop("sizes", SIZES), key="tokens", **kw)
        .map_batch(functools.partial(h.shift, by=2))
        .random_map_batch(h.jitter)
    )


def _records_file(has_field: str) -> bool:
    return has_field in {f.name for f in dataclasses.fields(BucketedStream)}


# --------------------------------------------------------------------------- round trips


def test_bucketed_pipelines_round_trip(folder):
    d, h = folder
    pipe = _bucketed(d, h, pad_value=-1, block=64)
    cfg = pipe.to_config()
    assert cfg["bucket"] == {
        "boundaries": BOUNDS,
        "batch_sizes": SIZES,
        "key": "tokens",
        "pad_value": -1,
        "block": 64,
        "lengths": None,
    }
    assert "batch" not in cfg and "pack" not in cfg and "num_epochs" not in cfg
    assert [t["kind"] for t in cfg["transforms"]] == ["filter"]
    assert [(t["fn"], t["kind"]) for t in cfg["batch_transforms"]] == [
        (f"{h.__name__}:shift", "map_batch"),
        (f"{h.__name__}:jitter", "random_map_batch"),
    ]
    assert_same_pipeline(pipe, quern.load_config(cfg, allow=[h.__name__]), (0, 7, 30))
    assert_same_pipeline(
        pipe, quern.load_config(write_config(d, cfg, "bucket")), (0, 11)
    )  # YAML beside the helpers: allowed as is
    loaded = quern.load_config(write_config(d, cfg, "bucket", "json"))
    assert_same_pipeline(pipe, loaded, (5,))
    assert loaded.explain(5) == pipe.explain(5) and loaded.to_config() == cfg
    widths = {loaded.batch_at(s)["tokens"].shape for s in range(40)}
    assert widths == {(16, 32), (8, 64), (4, 128)}  # one static shape per bucket
    other = {**cfg, "bucket": {**cfg["bucket"], "pad_value": 0}}
    assert quern.load_config(other, allow=[h.__name__]).fingerprint() != pipe.fingerprint()


def test_a_hand_written_config_is_the_python_pipeline(folder):
    d, h = folder
    text = f"""
source: {{type: array_record, paths: "toks-*.array_record"}}
seed: 2
num_epochs: null
shuffle: {{mode: block, block: 50, window: 4}}
transforms: [{{name: decode, kwargs: {{dtype: uint8}}}}]
bucket:
  boundaries: [8, 16, 40]
  batch_sizes: [12, 6, 4]
batch_transforms: [{{fn: "{h.__name__}:shift"}}]
"""
    path = d / f"hand-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(text)
    got = quern.load_config(path)
    src = quern.sources.ArrayRecordSource(str(d / "toks-*.array_record"))
    want = (
        quern.Pipeline.from_source(src, seed=2)
        .shuffle("block", block_size=50, window=4)
        .map(quern.transforms.decode(np.uint8))
        .bucket([8, 16, 40], [12, 6, 4])
        .map_batch(h.shift)
    )
    assert_same_pipeline(want, got, (0, 7, 30))
    assert set(got.batch_at(0)) == {"tokens", "length", "shifted"}
    assert got.to_config()["bucket"] == {
        "boundaries": [8, 16, 40],
        "batch_sizes": [12, 6, 4],
        "key": None,
        "pad_value": 0,
        "block": 1024,
        "lengths": None,
    }


def test_a_lengths_file_is_read_instead_of_a_scan(folder, tmp_path, isolated_cache):
    d, h = folder
    pipe = _bucketed(d, h)
    np.save(tmp_path / "lengths.npy", pipe.stream.inner.length_index("tokens"))  # -1 where the filter drops
    cfg = pipe.to_config()
    cfg["bucket"]["lengths"] = "lengths.npy"  # relative to the config file
    path = tmp_path / "with-lengths.yaml"
    loaded = load_without_scan(path, cfg, isolated_cache, allow=[h.__name__])
    assert_same_pipeline(pipe, loaded, (0, 7, 30))  # the index's content is the fingerprint's, not where it came from
    written = loaded.to_config()
    # the file, absolute, when the bucketing records it; else null (the config scans, or finds the cache)
    want = str(tmp_path / "lengths.npy") if _records_file("lengths_file") else None
    assert written["bucket"]["lengths"] == want
    assert_same_pipeline(pipe, quern.load_config(written, allow=[h.__name__]), (5,))
    np.save(tmp_path / "short.npy", np.arange(5))
    cfg["bucket"]["lengths"] = "short.npy"
    path.write_text(yaml.safe_dump(cfg))
    message = config_refusal(path, allow=[h.__name__])
    assert message.startswith(f"{path}: bucket.lengths: ") and "shape (300,)" in message, message
    assert message.count(str(path)) == 1, message


# --------------------------------------------------------------------------- messages


def _good(d) -> dict:
    return {
        "source": {"type": "parquet", "paths": str(d / "docs.parquet"), "columns": ["tokens"]},
        "shuffle": "global",
        "bucket": {"boundaries": [32, 64, 128], "batch_sizes": [16, 8, 4], "key": "tokens"},
    }


BAD = [
    ("bucket.boundaries", [64, 32, 128], "bucket.boundaries: must be increasing, got [64, 32, 128]: item 1 (32)"),
    ("bucket.boundaries", [32, 32, 128], "bucket.boundaries: must be increasing"),
    ("bucket.boundaries", [0, 64, 128], "bucket.boundaries: item 0 is not an integer >= 1: 0"),
    ("bucket.boundaries", [], "bucket.boundaries: List should have at least 1 item"),
    ("bucket.boundaries", DELETE, "bucket.boundaries: Field required"),
    ("bucket.batch_sizes", [16, 8], "bucket.batch_sizes: 2 batch sizes for 3 buckets (boundaries [32, 64, 128])"),
    ("bucket.batch_sizes", [16, 8, 2.5], "bucket.batch_sizes: item 2 is not an integer >= 1: 2.5"),
    ("bucket.pad_value", "x", "bucket.pad_value: must be a number (the value of padding tokens), got 'x'"),
    ("bucket.block", 0, "bucket.block: Input should be greater than or equal to 1 (got 0)"),
    ("bucket.key", 3, "bucket.key: Input should be a valid string (got 3)"),
    ("bucket.bounds", [1], "bucket.bounds: unknown key 'bounds'"),
    ("bucket.lengths", "missing.npy", "bucket.lengths: no file '"),
    ("bucket.lengths", "", "bucket.lengths: must be the path of a .npy file, got ''"),
    ("boundaries", [1], "boundaries: unknown key 'boundaries'; it belongs under bucket"),
    ("batch", 8, "batch: bucket makes the batches (bucket.batch_sizes, one size per bucket); give either batch or"),
    ("pack", 64, "pack: give either pack (rows of seq_len tokens) or bucket"),
    ("row_transforms", [{"name": "pad", "kwargs": {"length": 4}}], "row_transforms: transforms of packed rows; a"),
    ("num_epochs", 2, "num_epochs: must be null, got 2: a bucketed stream is endless"),
    ("transforms", [{"name": "pad", "kind": "random_map", "kwargs": {"length": 4}}], "transforms.0.kind: a random_"),
    ("batch_transforms", [{"name": "pad", "kind": "map"}], "batch_transforms.0.kind: 'map' does not belong here"),
    ("bucket", None, "batch: Field required (or a bucket: section, for batches of length buckets)"),
]


@pytest.mark.parametrize("path,value,fragment", BAD, ids=case_ids(BAD))
def test_bad_bucket_configs_name_the_key(folder, path, value, fragment):
    d, _ = folder
    cfg = _good(d)
    message = config_refusal(cfg, (path, value))
    assert fragment in message, message


def test_bucket_refuses_a_mixture_and_checks_each_batch_size_against_the_hosts(folder):
    d, _ = folder
    src = {"type": "parquet", "paths": str(d / "docs.parquet")}
    cfg = {
        "mix": {"components": {"web": {"source": src}, "code": {"source": src}}, "weights": {"web": 1, "code": 1}},
        "bucket": _good(d)["bucket"],
        "batch": 8,
    }
    with pytest.raises(quern.ConfigError, match=re.escape("bucket: length buckets are for a single source")):
        quern.load_config(cfg)
    cfg["mix"]["components"]["web"]["bucket"] = _good(d)["bucket"]
    del cfg["bucket"]
    with pytest.raises(quern.ConfigError, match=re.escape("mix.components.web.bucket: unknown key 'bucket'")):
        quern.load_config(cfg)
    with pytest.raises(quern.ConfigError, match=r"^bucket.batch_sizes.1: the global batch size 6 is not divisible"):
        quern.load_config({**_good(d), "bucket": {"boundaries": [32, 64], "batch_sizes": [8, 6]}}, process_count=4)
    with pytest.raises(quern.ScanError, match=r"^bucket: length scan, record \d+ of source 'docs': no key 'text'"):
        quern.load_config({**_good(d), "bucket": {"boundaries": [32], "batch_sizes": [8], "key": "text"}})


# --------------------------------------------------------------------------- the command


def _line(pipe, step, process_index=0, process_count=1) -> str:
    """The bucket line of a step, from the batch itself (its width: the bucket; ``length``: real tokens)."""
    batch = pipe.batch_at(step, process_index, process_count)
    rows, width = batch["tokens"].shape
    padding = 1 - batch["length"].sum() / (rows * width)
    return f"bucket len<={width}: {rows} rows, padding {padding:.3f} (step {step})"


def test_inspect_and_explain_show_the_bucket_and_padding(folder, capsys):
    d, h = folder
    pipe = _bucketed(d, h)
    path = write_config(d, pipe.to_config(), "bucket")
    seen = set()
    for step, host in [(0, (0, 1)), (3, (0, 1)), (5, (1, 2)), (9, (0, 1)), (17, (0, 1))]:
        args = [str(path), "--step", str(step), "--process-index", str(host[0]), "--process-count", str(host[1])]
        expected = _line(pipe, step, *host)
        seen.add(expected.split(":")[0])
        assert main(["inspect", *args]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[1] == f"  {expected}" and "batch['shifted']: int64 (" in out, out
        assert main(["explain", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        bucket = expected.split(",")[0]  # the padding too when the bucketing keeps its length index
        assert lines[1].startswith(f"  {bucket}") and lines[1].endswith(f" (step {step})"), lines
        named = [[int(x)] for x in re.findall(r"docs\[(\d+)\]", "\n".join(lines[2:]))]
        assert named == [[r for _, r in row] for row in pipe.explain(step, *host)]
    assert len(seen) >= 2, seen  # steps from more than one bucket
    assert main(["explain", str(path), "--step", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    width = pipe.batch_at(3)["tokens"].shape[1]
    assert {k: got["bucket"][k] for k in ("name", "bound", "rows")} == {
        "name": f"len<={width}",
        "bound": width,
        "rows": len(pipe.positions(3)),
    }
    assert [r["records"] for r in got["rows"]] == [[list(x) for x in row] for row in pipe.explain(3)]


def test_run_prints_each_bucket_and_the_padding_of_the_steps_run(folder, capsys):
    d, h = folder
    pipe = _bucketed(d, h)
    path = write_config(d, pipe.to_config(), "bucket")
    assert main(["run", str(path), "--steps", "30", "--start-step", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    batches = [pipe.batch_at(s) for s in range(2, 32)]
    widths = [b["tokens"].shape[1] for b in batches]
    rows = [b["tokens"].shape[0] for b in batches]
    real = [int(b["length"].sum()) for b in batches]
    assert out[0].startswith(f"30 steps, {sum(rows):,} records in "), out
    for w in BOUNDS:
        sel = [i for i, x in enumerate(widths) if x == w]
        if not sel:
            continue
        n = sum(rows[i] for i in sel)
        pad = 1 - sum(real[i] for i in sel) / (n * w)
        assert f"bucket len<={w}: {len(sel)} steps, {n:,} rows, padding {pad:.3f}" in out, out
    pads = [1 - r / (n * w) for r, n, w in zip(real, rows, widths)]
    total = 1 - sum(real) / sum(n * w for n, w in zip(rows, widths))
    lo, hi = int(np.argmin(pads)), int(np.argmax(pads))
    assert out[-1] == (
        f"bucketing: padding {total:.3f} (steps 2-31, {sum(rows):,} rows); padding per step: "
        f"min {pads[lo]:.3f} (step {2 + lo}), max {pads[hi]:.3f} (step {2 + hi})"
    ), out
    cfg = pipe.to_config()  # batches without 'length': the buckets still, the padding only from an index
    cfg["batch_transforms"].append({"fn": f"{h.__name__}:drop_length"})
    path = write_config(d, cfg, "bucket")
    assert main(["run", str(path), "--steps", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("bucketing: ") and any(x.startswith("bucket len<=") for x in out), out


def test_unbucketed_configs_say_nothing_about_buckets(folder, capsys):
    d, _ = folder
    cfg = {
        "source": {"type": "parquet", "paths": "docs.parquet", "columns": ["tokens"]},
        "transforms": [{"name": "pad", "kwargs": {"length": 150, "key": "tokens"}}],
        "batch": 4,
    }
    path = write_config(d, cfg, "bucket")
    for command in (["inspect", str(path), "--step", "2"], ["explain", str(path), "--step", "2"]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "bucket" not in out and out.startswith("step 2, host 0 of 1"), out
    assert main(["run", str(path), "--steps", "2"]) == 0
    assert "bucket" not in capsys.readouterr().out
    assert "bucket" not in quern.load_config(path).to_config()


# --------------------------------------------------------------------------- mixtures of packed components


def _packed_mixture(d, h):
    """Two packed components of the Parquet documents (one with a filter and row transforms),
    mixed 0.7 / 0.3, batched, shifted."""
    web = (
        quern.Pipeline.from_source(_parquet(d), seed=1)
        .shuffle()
        .filter(functools.partial(h.long_enough, min_len=4))
        .pack(96, key="tokens")
        .random_map(functools.partial(h.mask_some, rate=0.2))
        .map(h.plus_one)
    )
    code = quern.Pipeline.from_source(_parquet(d), seed=2).pack(96, mode="concat", key="tokens")
    return (
        quern.mix({"web": web, "code": code}, weights={"web": 0.7, "code": 0.3}, seed=5)
        .batch(8)
        .map_batch(functools.partial(h.shift, by=2))
    )


def test_a_mixture_of_packed_components_from_yaml(folder, capsys):
    d, h = folder
    text = f"""
mix:
  seed: 5
  components:
    web:
      source: {{type: parquet, paths: docs.parquet, columns: [tokens]}}
      seed: 1
      shuffle: global
      transforms: [{{fn: "{h.__name__}:long_enough", kind: filter, kwargs: {{min_len: 4}}}}]
      pack: {{seq_len: 96, key: tokens}}
      row_transforms:
        - {{fn: "{h.__name__}:mask_some", kind: random_map, kwargs: {{rate: 0.2}}}}
        - {{fn: "{h.__name__}:plus_one"}}
    code:
      source: {{type: parquet, paths: docs.parquet, columns: [tokens]}}
      seed: 2
      pack: {{seq_len: 96, mode: concat, key: tokens}}
  weights: {{web: 0.7, code: 0.3}}
batch: 8
batch_transforms: [{{fn: "{h.__name__}:shift", kwargs: {{by: 2}}}}]
"""
    path = d / f"packed-mix-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(text)
    got = quern.load_config(path)
    pipe = _packed_mixture(d, h)
    assert_same_pipeline(pipe, got, (0, 7, 30))
    assert set(got.batch_at(0)) == {"tokens", "segment_ids", "positions", "shifted"}
    assert got.explain(4) == pipe.explain(4)
    # round trips: the dict, a YAML file
    cfg = pipe.to_config()
    web, code = cfg["mix"]["components"]
    assert web["name"] == "web" and web["pack"] == {"seq_len": 96, "mode": "best_fit", "key": "tokens", "lengths": None}
    assert [t["kind"] for t in web["transforms"]] == ["filter"]
    assert [t["kind"] for t in web["row_transforms"]] == ["random_map", "map"]
    assert code["pack"]["mode"] == "concat" and code["row_transforms"] == []
    assert_same_pipeline(pipe, quern.load_config(cfg, allow=[h.__name__]), (3,))
    again = quern.load_config(write_config(d, cfg, "packed-mix"))
    assert_same_pipeline(pipe, again, (2, 9))
    assert again.to_config() == cfg
    # the commands: the components drawn (rows, not documents), the rows run
    assert main(["explain", str(path), "--step", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    seg = pipe.segments(pipe.positions(4))
    share = np.bincount(seg.component, minlength=2) / 8
    assert lines[1] == f"  components drawn: web {share[0]:.3f}, code {share[1]:.3f} (step 4, 8 rows)", lines
    assert main(["run", str(path), "--steps", "3"]) == 0
    assert capsys.readouterr().out.startswith("3 steps, 24 rows in ")


PACKED_BAD = [
    ("mix.components.web.pack.seqlen", 64, "mix.components.web.pack.seqlen: unknown key 'seqlen'; did you mean"),
    ("mix.components.web.pack.seq_len", 0, "mix.components.web.pack.seq_len: Input should be greater than or equal"),
    (
        "mix.components.web.row_transforms",
        [{"name": "pad", "kwargs": {"length": 4}}],
        "mix.components.code.row_transforms: transforms of packed rows need a pack: section; put the transforms of "
        "records under mix.components.code.transforms",
    ),
    (
        "mix.components.web.transforms",
        [{"name": "pad", "kind": "random_map", "kwargs": {"length": 4}}],
        "mix.components.web.transforms.0.kind: a random_map before pack: the lengths packing plans with must not",
    ),
    (
        "mix.components.web.row_transforms",
        [{"name": "pad", "kind": "filter"}],
        "mix.components.web.row_transforms.0.kind: 'filter' does not belong here; filter the records before pack "
        "(under mix.components.web.transforms)",
    ),
    ("mix.components.web.pack.lengths", "missing.npy", "mix.components.web.pack.lengths: no file '"),
    ("pack", 64, "pack: a mixture is not packed itself: pack its components (mix.components.<name>.pack)"),
    ("row_transforms", [{"name": "pad"}], "row_transforms: transforms of packed rows belong to a packed component"),
]


@pytest.mark.parametrize("path,value,fragment", PACKED_BAD, ids=case_ids(PACKED_BAD, 50))
def test_bad_packed_components_name_the_key(folder, path, value, fragment):
    d, _ = folder
    src = {"type": "parquet", "paths": str(d / "docs.parquet"), "columns": ["tokens"]}
    cfg = {
        "mix": {
            "components": {
                "web": {"source": src, "pack": {"seq_len": 96, "key": "tokens"}},
                "code": {"source": src, "pack": {"seq_len": 96, "key": "tokens"}},
            },
            "weights": {"web": 1, "code": 1},
        },
        "batch": 8,
    }
    if fragment.startswith("mix.components.code.row_transforms"):  # code unpacked, with row transforms
        del cfg["mix"]["components"]["code"]["pack"]
        path = "mix.components.code.row_transforms"
    message = config_refusal(cfg, (path, value))
    assert fragment in message, message
