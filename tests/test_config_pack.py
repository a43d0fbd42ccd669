"""Packing as configuration (issue 12, point 8, pack): the ``pack:`` and ``row_transforms``
keys, ``to_config`` round trips, the messages, and the fill and padding ``quern inspect``,
``run`` and ``explain`` print for a packed config."""

from __future__ import annotations

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
from quern.pipeline.streams import MixtureStream

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("isolated_cache")]

HELPERS = '''
import numpy as np


def long_enough(record, min_len=5):
    """A filter's predicate on the Parquet records: at least ``min_len`` tokens."""
    return len(record["tokens"]) >= min_len


def mask_some(row, rng, rate=0.1):
    """A random_map on packed rows: zero some real tokens."""
    hit = (rng.random(row["tokens"].shape) < rate) & (row["segment_ids"] > 0)
    return {**row, "tokens": np.where(hit, 0, row["tokens"])}


def plus_one(row):
    return {**row, "tokens": row["tokens"] + 1}


def shift(batch, by=1):
    return {**batch, "shifted": np.roll(batch["tokens"], -by, axis=1)}
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with ``docs.parquet`` (400 documents: list columns ``tokens`` and ``mask``, of
    1-89 tokens), ArrayRecord shards ``toks-*.array_record`` (600 byte records) and a module of
    helpers (importable: the folder is on ``sys.path``), where configs are written too:
    ``(folder, module)``."""
    with docs_folder(tmp_path_factory.mktemp("pack"), 400, 90, 0, HELPERS, "quern_test_pack") as got:
        yield got


def _docs(d, h, mode="best_fit", seq_len=128, num_epochs=None):
    """The Parquet documents filtered, shuffled, packed by ``tokens``; rows masked, batched, shifted."""
    return (
        quern.Pipeline.from_source(quern.sources.ParquetSource(str(d / "docs.parquet")), seed=4, num_epochs=num_epochs)
        .shuffle()
        .filter(functools.partial(h.long_enough, min_len=8))
        .pack(seq_len, mode=mode, key="tokens")
        .random_map(functools.partial(h.mask_some, rate=0.2))
        .map(h.plus_one)
        .batch(8)
        .map_batch(functools.partial(h.shift, by=2))
    )


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("mode", ["best_fit", "concat"])
def test_packed_pipelines_round_trip(folder, mode):
    d, h = folder
    pipe = _docs(d, h, mode, num_epochs=2)
    cfg = pipe.to_config()
    assert cfg["pack"] == {"seq_len": 128, "mode": mode, "key": "tokens", "lengths": None}
    assert [t["kind"] for t in cfg["transforms"]] == ["filter"]  # records, before pack
    assert [(t["fn"], t["kind"]) for t in cfg["row_transforms"]] == [
        (f"{h.__name__}:mask_some", "random_map"),
        (f"{h.__name__}:plus_one", "map"),
    ]
    assert cfg["num_epochs"] == 2 and cfg["seed"] == 4 and cfg["shuffle"] == "global"
    last = pipe.num_steps - 1
    assert_same_pipeline(pipe, quern.load_config(cfg, allow=[h.__name__]), (0, 7, last))
    assert_same_pipeline(
        pipe, quern.load_config(write_config(d, cfg, "pack")), (0, last)
    )  # YAML beside the helpers: allowed as is
    json_path = d / f"pack-{uuid.uuid4().hex[:6]}.json"
    json_path.write_text(json.dumps(cfg))
    loaded = quern.load_config(json_path)
    assert_same_pipeline(pipe, loaded, (3,))
    assert loaded.explain(3) == pipe.explain(3) and loaded.to_config() == cfg


def test_a_hand_written_config_is_the_python_pipeline(folder):
    d, h = folder
    text = f"""
source: {{type: parquet, paths: docs.parquet}}
seed: 4
num_epochs: 2
shuffle: global
transforms: [{{fn: "{h.__name__}:long_enough", kind: filter, kwargs: {{min_len: 8}}}}]
pack: {{seq_len: 128, key: tokens}}
row_transforms:
  - {{fn: "{h.__name__}:mask_some", kind: random_map, kwargs: {{rate: 0.2}}}}
  - {{fn: "{h.__name__}:plus_one"}}
batch: 8
batch_transforms: [{{fn: "{h.__name__}:shift", kwargs: {{by: 2}}}}]
"""
    path = d / f"hand-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(text)
    pipe = quern.load_config(path)
    assert_same_pipeline(_docs(d, h, num_epochs=2), pipe, (0, 7, 30))
    assert set(pipe.batch_at(0)) == {"tokens", "segment_ids", "positions", "mask", "shifted"}
    # the short form: records that are token arrays (bytes decoded), best_fit
    shards = {"source": {"type": "array_record", "paths": "toks-*.array_record"}, "batch": 4}
    path = write_config(
        d, {**shards, "transforms": [{"name": "decode", "kwargs": {"dtype": "uint8"}}], "pack": 64}, "pack"
    )
    packed = quern.load_config(path)
    src = quern.sources.ArrayRecordSource(str(d / "toks-*.array_record"))
    assert_same_pipeline(
        packed, quern.Pipeline.from_source(src).map(quern.transforms.decode(np.uint8)).pack(64).batch(4), (0, 7, 30)
    )
    assert packed.to_config()["pack"] == {"seq_len": 64, "mode": "best_fit", "key": None, "lengths": None}


def test_a_lengths_file_is_read_instead_of_a_scan_and_written_back(folder, tmp_path, isolated_cache):
    d, h = folder
    pipe = _docs(d, h)
    np.save(tmp_path / "lengths.npy", pipe.stream.lengths)  # the scanned index (-1 for what the filter drops)
    cfg = pipe.to_config()
    cfg["pack"]["lengths"] = "lengths.npy"  # relative to the config file
    path = tmp_path / "with-lengths.yaml"
    loaded = load_without_scan(path, cfg, isolated_cache, allow=[h.__name__])
    assert_same_pipeline(pipe, loaded, (0, 7, 30))  # the index's content is the fingerprint's, not where it came from
    written = loaded.to_config()
    assert written["pack"]["lengths"] == str(tmp_path / "lengths.npy")  # absolute: loads from anywhere
    assert_same_pipeline(pipe, quern.load_config(written, allow=[h.__name__]), (5,))
    assert not list(isolated_cache.glob("lengths/*"))


def test_a_given_lengths_array_is_written_as_the_scanned_index(folder):
    d, h = folder
    src = quern.sources.ParquetSource(str(d / "docs.parquet"))
    scanned = quern.Pipeline.from_source(src, seed=2).length_index("tokens")
    pipe = quern.Pipeline.from_source(src, seed=2).pack(100, mode="concat", key="tokens", lengths=scanned).batch(5)
    cfg = pipe.to_config()
    assert cfg["pack"]["lengths"] is None  # an array has no config form: the config scans (or finds the cache)
    assert_same_pipeline(pipe, quern.load_config(cfg), (0, 7, 30))


# --------------------------------------------------------------------------- messages


def _good(d) -> dict:
    return {
        "source": {"type": "parquet", "paths": str(d / "docs.parquet")},
        "shuffle": "global",
        "pack": {"seq_len": 128, "key": "tokens"},
        "batch": 8,
    }


def _mixed(d) -> dict:
    src = {"type": "parquet", "paths": str(d / "docs.parquet")}
    return {"mix": {"components": {"web": {"source": src}, "code": {"source": src}}, "weights": {"web": 1, "code": 1}}}


BAD = [
    ("pack.seq_len", 0, "pack.seq_len: Input should be greater than or equal to 1 (got 0)"),
    ("pack.seq_len", DELETE, "pack.seq_len: Field required"),
    ("pack.mode", "tight", "pack.mode: Input should be 'best_fit', 'concat' or 'first_fit' (got 'tight')"),
    ("pack.mode", "first_fit", "pack: pack(mode='first_fit') needs num_bins: the rows of each packing batch"),
    ("pack.num_bins", 0, "pack.num_bins: Input should be greater than or equal to 1 (got 0)"),
    ("pack.num_bins", 4, "pack: pack(num_bins=...) is first_fit's setting; mode 'best_fit' takes none"),
    ("pack.pad_value", "x", "pack.pad_value"),
    ("pack.seqlen", 64, "pack.seqlen: unknown key 'seqlen'; did you mean 'seq_len'?"),
    ("pack.key", 3, "pack.key: Input should be a valid string (got 3)"),
    ("pack", 0, "pack: Input should be greater than or equal to 1 (got 0)"),
    ("seq_len", 64, "seq_len: unknown key 'seq_len'; it belongs under pack"),
    ("pack.lengths", "missing.npy", "pack.lengths: no file '"),
    ("pack.lengths", "", "pack.lengths: must be the path of a .npy file, got ''"),
    ("row_transforms", [{"name": "pad", "kind": "filter"}], "here; filter the records before pack (under transforms)"),
    ("row_transforms", [{"name": "pad", "kind": "map_batch"}], "row_transforms.0.kind: 'map_batch' does not belong"),
    ("transforms", [{"name": "pad", "kind": "random_map"}], "transforms.0.kind: a random_map before pack: the lengths"),
    ("pack", None, "row_transforms: transforms of packed rows need a pack: section"),  # with the row_transforms below
]


@pytest.mark.parametrize("path,value,fragment", BAD, ids=case_ids(BAD))
def test_bad_pack_configs_name_the_key(folder, path, value, fragment):
    d, _ = folder
    cfg = _good(d)
    if fragment.startswith("row_transforms: transforms of packed rows"):
        cfg["row_transforms"] = [{"name": "pad", "kwargs": {"length": 4}}]
    message = config_refusal(cfg, (path, value))
    assert fragment in message, message


@pytest.mark.parametrize(
    "where,fragment",
    [
        ("top", "pack: a mixture is not packed itself: pack its components (mix.components.<name>.pack)"),
        ("rows", "row_transforms: transforms of packed rows belong to a packed component"),
    ],
)
def test_a_mixture_itself_is_not_packed(folder, where, fragment):
    d, _ = folder
    cfg = {**_mixed(d), "batch": 8}
    if where == "top":
        cfg["pack"] = {"seq_len": 128, "key": "tokens"}
    else:
        cfg["row_transforms"] = [{"name": "pad", "kwargs": {"length": 4}}]
    with pytest.raises(quern.ConfigError, match=re.escape(fragment)):
        quern.load_config(cfg)
    ok = {**_mixed(d), "batch": 8, "pack": None, "row_transforms": []}  # no packing, said explicitly
    ok["mix"]["components"]["web"]["pack"] = None
    assert isinstance(quern.load_config(ok).stream, MixtureStream)


def test_a_mixtures_components_may_be_packed(folder):
    d, _ = folder
    cfg = {**_mixed(d), "batch": 4}
    for c in cfg["mix"]["components"].values():
        c["source"]["columns"] = ["tokens"]
        c["pack"] = {"seq_len": 64, "key": "tokens"}
    pipe = quern.load_config(cfg)
    assert [c.stream.seq_len for c in pipe.stream.components] == [64, 64]
    src = quern.sources.ParquetSource(str(d / "docs.parquet"), columns=["tokens"])
    part = quern.Pipeline.from_source(src).pack(64, key="tokens")
    assert_same_pipeline(quern.mix({"web": part, "code": part}, weights={"web": 1, "code": 1}).batch(4), pipe, (0, 5))
    written = pipe.to_config()
    assert [c["pack"]["seq_len"] for c in written["mix"]["components"]] == [64, 64]
    assert_same_pipeline(pipe, quern.load_config(written), (3,))


def test_bad_lengths_files_and_records_without_tokens(folder, tmp_path):
    d, _ = folder
    np.save(tmp_path / "short.npy", np.arange(5))
    (tmp_path / "text.npy").write_text("not an array")
    for name, fragment in [
        ("short.npy", "must hold one integer per record of source 'docs' (shape (400,)); it has shape (5,)"),
        ("text.npy", "as a .npy array: "),
    ]:
        path = tmp_path / f"bad-{name}.yaml"
        cfg = _good(d)
        cfg["pack"]["lengths"] = name
        path.write_text(yaml.safe_dump(cfg))
        message = config_refusal(path)
        assert message.startswith(f"{path}: pack.lengths: ") and fragment in message, message
        assert message.count(str(path)) == 1, message
    cfg = _good(d)
    cfg["pack"]["key"] = "text"
    with pytest.raises(quern.ScanError, match=r"^pack: length scan, record \d+ of source 'docs': no key 'text'"):
        quern.load_config(cfg)


# --------------------------------------------------------------------------- the command


def _expected(pipe, step: int, process_index: int = 0, process_count: int = 1) -> str:
    """The packing line of a step, from the rows themselves (``segment_ids`` 0: padding)."""
    batch = pipe.batch_at(step, process_index, process_count)
    seg = batch["segment_ids"]
    fill = float((seg > 0).mean())
    documents = int(sum(len(np.unique(row[row > 0])) for row in seg))
    rows, seq_len = seg.shape
    return (
        f"packing: fill {fill:.3f}, padding {1 - fill:.3f}, {documents:,} documents "
        f"(step {step}, {rows} rows of {seq_len} tokens)"
    )


@pytest.mark.parametrize("mode", ["best_fit", "concat"])
def test_inspect_and_explain_show_fill_padding_and_documents(folder, capsys, mode):
    d, h = folder
    pipe = _docs(d, h, mode)
    path = write_config(d, pipe.to_config(), "pack")
    for step, host in [(3, (0, 1)), (11, (1, 2))]:
        args = [str(path), "--step", str(step), "--process-index", str(host[0]), "--process-count", str(host[1])]
        expected = _expected(pipe, step, *host)
        assert main(["inspect", *args]) == 0
        out = capsys.readouterr().out
        assert f"\n  {expected}\n" in out and "batch['segment_ids']: int32 (" in out, out
        assert main(["explain", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == f"  {expected}", lines
        pieces = pipe.pieces(pipe.positions(step, *host))
        for i, (line, row) in enumerate(zip(lines[2:], pipe.explain(step, *host))):  # every document of each row
            named = [int(x) for x in re.findall(r"docs\[(\d+)\]", line)]
            assert named == [r for _, r in row] and len(named) >= 1, line
            assert f" {int(pieces.length[pieces.row == i].sum())} tokens " in line, line
        assert len(lines) == 2 + len(pipe.positions(step, *host))
    assert main(["explain", str(path), "--step", "5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["records"] for r in got["rows"]] == [[list(x) for x in row] for row in pipe.explain(5)]
    seg = pipe.batch_at(5)["segment_ids"]
    assert [r["tokens"] for r in got["rows"]] == (seg > 0).sum(axis=1).tolist()
    assert got["packing"]["fill"] == pytest.approx((seg > 0).mean()) and got["packing"]["seq_len"] == 128
    if mode == "concat":  # documents cut over rows: their token ranges
        assert any(re.search(r"docs\[\d+\]\[\d+:\d+\]", line) for line in lines), lines


def test_run_prints_the_fill_of_the_steps_run(folder, capsys):
    d, h = folder
    pipe = _docs(d, h, num_epochs=1)
    path = write_config(d, pipe.to_config(), "pack")
    steps = pipe.num_steps
    assert main(["run", str(path), "--steps", "1000"]) == 0  # capped at the end of the stream
    out = capsys.readouterr().out
    segs = [pipe.batch_at(s)["segment_ids"] for s in range(steps)]
    fills = [float((s > 0).mean()) for s in segs]
    fill = float(np.mean([(s > 0).mean() for s in segs]))
    documents = sum(len(np.unique(row[row > 0])) for s in segs for row in s)
    expected = (
        f"packing: fill {fill:.3f}, padding {1 - fill:.3f}, {documents:,} documents (steps 0-{steps - 1}, "
        f"{8 * steps:,} rows of 128 tokens); fill per step: min {min(fills):.3f} (step {int(np.argmin(fills))}), "
        f"max {max(fills):.3f}"
    )
    assert expected in out.splitlines(), out
    assert out.startswith(f"{steps} steps, {8 * steps:,} rows in "), out
    assert main(["run", str(path), "--start-step", "2", "--steps", "1"]) == 0
    assert f"\n{_expected(pipe, 2)}\n" in capsys.readouterr().out


def test_a_bad_pack_is_exit_2_and_a_bad_key_exit_1(folder, tmp_path, capsys):
    d, _ = folder
    cfg = _good(d)
    cfg["pack"]["mode"] = "tight"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["inspect", str(path), "--step", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"quern: {path}: invalid config:\n  pack.mode: Input should be 'best_fit', 'concat' or 'first_fit'"
    ), err
    cfg["pack"] = {"seq_len": 16, "key": "text"}
    path.write_text(yaml.safe_dump(cfg))
    assert main(["explain", str(path), "--step", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"quern: {path}: pack: length scan, record ") and err.count("\n") == 1, err


def test_unpacked_configs_say_nothing_about_packing(folder, capsys):
    d, _ = folder
    path = write_config(
        d, {"source": {"type": "parquet", "paths": "docs.parquet", "columns": ["tokens"]}, "batch": 4}, "pack"
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["transforms"] = [{"name": "pad", "kwargs": {"length": 90, "key": "tokens"}}]
    path.write_text(yaml.safe_dump(cfg))
    for command in (["inspect", str(path), "--step", "2"], ["explain", str(path), "--step", "2"]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "packing" not in out and "tokens  " not in out and out.startswith("step 2, host 0 of 1"), out
    assert "pack" not in quern.load_config(path).to_config()
