"""Config files <-> pipelines: round trips, validation messages, data identity."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from array_record.python import array_record_module

import quern


def shift(batch, by=1):
    """A module-level batch transform with a keyword argument (for ``fn`` configs)."""
    return {**batch, "shifted": np.roll(batch["tokens"], -by, axis=1)}


def write_shards(d, seed: int = 0) -> None:
    """Two ArrayRecord shards ``toks-{0,1}.array_record`` of 300 variable-length byte records each."""
    rng = np.random.default_rng(seed)
    for k in range(2):
        w = array_record_module.ArrayRecordWriter(str(d / f"toks-{k}.array_record"), "group_size:1")
        for _ in range(300):
            w.write(rng.integers(0, 255, size=int(rng.integers(1, 40)), dtype=np.uint8).tobytes())
        w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    write_shards(d)
    pq.write_table(pa.table({"v": [[float(i)] * (i % 4) for i in range(200)], "i": np.arange(200)}),
                   d / "part.parquet", row_group_size=50)
    return d


def _good(files) -> dict:
    return {
        "source": {"type": "array_record", "paths": str(files / "toks-*.array_record")},
        "seed": 5,
        "shuffle": "global",
        "transforms": [{"name": "decode", "kwargs": {"dtype": "uint8"}}, {"name": "pad", "kwargs": {"length": 16}}],
        "batch": {"size": 8},
        "batch_transforms": [{"fn": "test_config:shift", "kwargs": {"by": 2}}],
    }


def _same(a, b):
    assert a.fingerprint() == b.fingerprint()
    for s in [0, 7, 123]:
        x, y = a.batch_at(s), b.batch_at(s)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def test_yaml_json_and_dict_give_the_same_pipeline(files, tmp_path):
    cfg = _good(files)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "p.json").write_text(json.dumps(cfg))
    from_dict = quern.load_config(cfg)
    _same(from_dict, quern.load_config(tmp_path / "p.yaml"))
    _same(from_dict, quern.load_config(str(tmp_path / "p.json")))
    assert from_dict.batch_at(0)["shifted"].shape == (8, 16)


def test_code_built_pipeline_round_trips(files):
    src = quern.sources.ArrayRecordSource(str(files / "toks-*.array_record"))
    import functools

    pipe = (quern.Pipeline.from_source(src, seed=9, num_epochs=3).shuffle("block", block=20, window=4)
            .map(quern.transforms.decode(np.uint8)).map(quern.transforms.pad(12, mask_key="mask"))
            .batch(6, drop_remainder=False).map_batch(functools.partial(shift, by=3)))
    _same(pipe, quern.load_config(pipe.to_config()))
    _same(pipe, quern.load_config(json.loads(json.dumps(pipe.to_config()))))  # JSON-able


def test_parquet_config_round_trips(files):
    cfg = {"source": {"type": "parquet", "paths": str(files / "part.parquet"), "columns": ["v"]},
           "transforms": [{"name": "pad", "kwargs": {"length": 3, "key": "v"}}], "batch": 10}
    pipe = quern.load_config(cfg)
    _same(pipe, quern.load_config(pipe.to_config()))


def test_relative_paths_are_relative_to_the_config_file(files, tmp_path):
    cfg = _good(files)
    cfg["source"]["paths"] = "data/toks-*.array_record"
    (tmp_path / "data").mkdir()
    for p in files.glob("toks-*.array_record"):
        (tmp_path / "data" / p.name).write_bytes(p.read_bytes())
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    assert len(quern.load_config(tmp_path / "p.yaml").source) == 600


def test_pipelines_without_a_config_form_say_why(files):
    with pytest.raises(ValueError, match="no config form"):
        quern.Pipeline.from_source({"x": np.arange(10)}).batch(2).to_config()
    src = quern.sources.ArrayRecordSource(str(files / "toks-*.array_record"))
    with pytest.raises(ValueError, match="transforms.0: .* cannot be written as a config"):
        quern.Pipeline.from_source(src).map(lambda r: r).batch(2).to_config()


def test_changing_a_data_file_changes_the_fingerprint(files, tmp_path):
    for p in files.glob("toks-*.array_record"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    cfg = _good(files)
    cfg["source"]["paths"] = str(tmp_path / "toks-*.array_record")
    before = quern.load_config(cfg).fingerprint()
    w = array_record_module.ArrayRecordWriter(str(tmp_path / "toks-1.array_record"), "group_size:1")
    for i in range(300):
        w.write(bytes([i % 255]) * 5)
    w.close()
    assert quern.load_config(cfg).fingerprint() != before


def _set(cfg: dict, path: str, value):
    *head, last = path.split(".")
    node = cfg
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return cfg


_DELETE = object()

BAD = [
    ("sourse", {"type": "array_record"}, "unknown key 'sourse'; did you mean 'source'?"),
    ("shufle", "global", "unknown key 'shufle'; did you mean 'shuffle'?"),
    ("batch.sise", 3, "unknown key 'sise'; did you mean 'size'?"),
    ("source", _DELETE, "source: Field required"),
    ("source.type", "hdf5", "source: Input tag 'hdf5' found using 'type' does not match"),
    ("source.paths", "nowhere/*.array_record", "no file matches"),
    ("seed", -1, "seed: Input should be greater than or equal to 0 (got -1)"),
    ("seed", 2**64, "seed: Input should be less than 18446744073709551616"),
    ("seed", "abc", "seed: Input should be a valid integer"),
    ("num_epochs", 0, "num_epochs: Input should be greater than or equal to 1 (got 0)"),
    ("shuffle", "random", "shuffle"),
    ("batch.size", 0, "batch.size: Input should be greater than or equal to 1 (got 0)"),
    ("transforms.0.name", "decoder", "no registered transform 'decoder'"),
    ("transforms.1.kwargs", {"length": 16, "colour": "red"}, "transforms.1.kwargs: pad("),
    ("batch_transforms.0.fn", "test_config:nope", "batch_transforms.0.fn: cannot import 'test_config:nope'"),
    ("batch_transforms.0.fn", "no_colon_here", "fn must look like 'package.module:function'"),
    ("transforms.0.kind", "map_batch", "transforms.0.kind: 'map_batch' does not belong here; put it under batch_"),
    ("batch", True, "batch: Input should be a valid integer (got True)"),
    ("block", 4, "unknown key 'block'; it belongs under shuffle"),
    ("batch_transforms.0.fn", ":shift", "fn must look like 'package.module:function'"),
    ("batch_transforms.0.fn", "os:sep", "batch_transforms.0.fn: 'os:sep' is a str, not a function"),
]


@pytest.mark.parametrize("path,value,fragment", BAD, ids=[f"{p}={v!r}"[:40] for p, v, _ in BAD])
def test_bad_configs_name_the_key_the_value_and_the_expectation(files, path, value, fragment):
    cfg = _set(_good(files), path, value)
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(cfg)
    assert fragment in str(info.value)


def test_batch_size_the_host_count_does_not_divide(files):
    with pytest.raises(quern.ConfigError, match="batch size 8 is not divisible by the host count 3"):
        quern.load_config(_good(files), process_count=3)


def test_unreadable_config_files(tmp_path):
    with pytest.raises(quern.ConfigError, match="config file not found"):
        quern.load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(quern.ConfigError, match="top level must be a mapping"):
        quern.load_config(tmp_path / "list.yaml")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(quern.ConfigError, match="cannot parse"):
        quern.load_config(tmp_path / "bad.json")


def test_example_configs_are_the_example_pipelines(tmp_path):
    import os
    import shutil
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "examples"))
    import quickstart

    ar_paths, _ = quickstart.build_dataset(str(tmp_path / "data"))
    shutil.copytree(os.path.join(root, "examples", "configs"), tmp_path / "configs")
    _same(quern.load_config(tmp_path / "configs" / "quickstart.yaml"), quickstart.make_pipeline(ar_paths, 64))
    _same(quern.load_config(tmp_path / "configs" / "lm.yaml"), quickstart.make_pipeline(ar_paths, 32))
