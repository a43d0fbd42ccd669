"""Tests of pipeline/config/.

Config files <-> pipelines: round trips, validation messages, data identity."""

from __future__ import annotations

import json
import os
import re
import sys
from uuid import uuid4  # noqa: F401 (re-exported from here: a config may not name it as test_config:uuid4)

import numpy as np
import pytest
import yaml
from helpers import (
    DELETE,
    assert_same_pipeline,
    case_ids,
    doubled_prefixes,
    set_path,
    write_array_record,
    write_module,
    write_parquets,
    write_shards,
)

import quern


@pytest.fixture(autouse=True)
def allow_test_config(monkeypatch):
    """The configs here name ``test_config:shift``, a module outside their folder: allowed
    through ``QUERN_ALLOW`` (tests of the trust model itself are in test_config_security.py)."""
    monkeypatch.setenv("QUERN_ALLOW", "test_config")


def shift(batch, by=1):
    """A module-level batch transform with a keyword argument (for ``fn`` configs)."""
    return {**batch, "shifted": np.roll(batch["tokens"], -by, axis=1)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    write_shards(d)
    write_parquets(d)
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


def test_yaml_json_and_dict_give_the_same_pipeline(files, tmp_path):
    cfg = _good(files)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "p.json").write_text(json.dumps(cfg))
    from_dict = quern.load_config(cfg)
    assert_same_pipeline(from_dict, quern.load_config(tmp_path / "p.yaml"))
    assert_same_pipeline(from_dict, quern.load_config(str(tmp_path / "p.json")))
    assert from_dict.batch_at(0)["shifted"].shape == (8, 16)
    for name, text in (("bom.json", json.dumps(cfg)), ("bom.yaml", yaml.safe_dump(cfg))):  # a byte-order mark first
        (tmp_path / name).write_bytes(("\ufeff" + text).encode())
        assert_same_pipeline(from_dict, quern.load_config(tmp_path / name))


def test_code_built_pipeline_round_trips(files):
    src = quern.sources.ArrayRecordSource(str(files / "toks-*.array_record"))
    import functools

    pipe = (
        quern.Pipeline.from_source(src, seed=9, num_epochs=3)
        .shuffle("block", block_size=20, window=4)
        .map(quern.transforms.decode(np.uint8))
        .map(quern.transforms.pad(12, mask_key="mask"))
        .batch(6, drop_remainder=False)
        .map_batch(functools.partial(shift, by=3))
    )
    assert_same_pipeline(pipe, quern.load_config(pipe.to_config()))
    assert_same_pipeline(pipe, quern.load_config(json.loads(json.dumps(pipe.to_config()))))  # JSON-able


def test_parquet_config_round_trips(files):
    cfg = {
        "source": {"type": "parquet", "paths": str(files / "part.parquet"), "columns": ["v"]},
        "transforms": [{"name": "pad", "kwargs": {"length": 3, "key": "v"}}],
        "batch": 10,
    }
    pipe = quern.load_config(cfg)
    assert_same_pipeline(pipe, quern.load_config(pipe.to_config()))


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
    write_array_record(tmp_path / "toks-1.array_record", [bytes([i % 255]) * 5 for i in range(300)])
    assert quern.load_config(cfg).fingerprint() != before


BAD = [
    ("sourse", {"type": "array_record"}, "unknown key 'sourse'; did you mean 'source'?"),
    ("shufle", "global", "unknown key 'shufle'; did you mean 'shuffle'?"),
    ("batch.sise", 3, "unknown key 'sise'; did you mean 'size'?"),
    ("source", DELETE, "source: Field required"),
    ("source.type", "hdf5", "source: Input tag 'hdf5' found using 'type' does not match"),
    ("source.paths", "nowhere/*.array_record", "source: ArrayRecordSource: no file matches"),
    ("seed", -1, "seed: Input should be greater than or equal to 0 (got -1)"),
    ("seed", 2**64, "seed: Input should be less than 18446744073709551616"),
    ("seed", "abc", "seed: Input should be a valid integer"),
    ("num_epochs", 0, "num_epochs: Input should be greater than or equal to 1 (got 0)"),
    ("shuffle", "random", "shuffle: Input should be 'global' or 'block' (got 'random')"),
    ("batch.size", 0, "batch.size: Input should be greater than or equal to 1 (got 0)"),
    ("transforms.0.name", "decoder", "no registered transform 'decoder'"),
    ("transforms.1.kwargs", {"length": 16, "colour": "red"}, "transforms.1.kwargs: pad("),
    ("batch_transforms.0.fn", "test_config:nope", "batch_transforms.0.fn: cannot import 'test_config:nope'"),
    ("batch_transforms.0.fn", "no_colon_here", "batch_transforms.0: fn must look like 'package.module:function'"),
    ("transforms.0.kind", "map_batch", "transforms.0.kind: 'map_batch' does not belong here; put it under batch_"),
    ("batch", True, "batch: Input should be a valid integer (got True)"),
    ("block", 4, "unknown key 'block'; it belongs under shuffle"),
    ("batch_transforms.0.fn", ":shift", "fn must look like 'package.module:function'"),
    ("batch_transforms.0.fn", "test_config:DOUBLE", "batch_transforms.0.fn: 'test_config:DOUBLE' is a str, not a"),
    ("batch_transforms.0.fn", ".test_config:shift", "fn must look like 'package.module:function'"),
    ("batch_transforms.0.fn", "test_config:_good", "a name after ':' starting with '_' (a private or special"),
    ("batch_transforms.0.fn", "os:system", "batch_transforms.0.fn: module 'os' is not allowed: "),
    ("batch_transforms.0.fn", "test_config:os.system", "reaches the module 'os' through 'test_config'"),
    ("batch_transforms.0.fn", "test_config:uuid4", "'test_config:uuid4' is defined in uuid, which is not allowed"),
]


@pytest.mark.parametrize("path,value,fragment", BAD, ids=case_ids(BAD))
def test_bad_configs_name_the_key_the_value_and_the_expectation(files, path, value, fragment):
    cfg = set_path(_good(files), path, value)
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(cfg)
    assert fragment in str(info.value)


def test_batch_size_the_host_count_does_not_divide(files):
    with pytest.raises(
        quern.ConfigError, match="batch size 8 is not divisible by the host count \\(process_count\\) 3"
    ):
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
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(tmp_path / "list.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'list.yaml'}: ") and str(info.value).count("list.yaml") == 1


@pytest.mark.parametrize("parser", ["libyaml", "python"])
def test_a_yaml_syntax_error_shows_each_place_with_its_line_and_a_caret(tmp_path, monkeypatch, parser):
    from quern.pipeline.config import limits, load

    if parser == "python":
        monkeypatch.setattr(load, "LOADER", limits.Loader)
    elif limits.LOADER is limits.Loader:
        pytest.skip("PyYAML here has no libyaml: its parser is the Python one, tested beside")
    path = tmp_path / "cfg.yaml"
    path.write_text("source:\n  type: arrays\n\tpath: x\n")  # a tab where an indent goes
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{path}: cannot parse: ") and "<unicode string>" not in str(info.value)
    at = lines.index("  at line 3, column 1:")
    assert lines[at + 1 :] == ["    \tpath: x", "    ^"]
    long = "x" * 100
    path.write_text(f"source: {{type: arrays, path: {long}] }}\nbatch: 4\n")  # a ] in a {...}, at column 130
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(path)
    lines = str(info.value).splitlines()
    assert lines[lines.index("  at line 1, column 9:") + 1 :][:2] == [
        "    source: {type: arrays, path: " + "x" * 47 + "...",  # the line's first 76 characters
        " " * 12 + "^",
    ]
    at = lines.index("  at line 1, column 130:")
    assert lines[at + 1 :] == ["    ..." + "x" * 73 + "] }", "    " + " " * 76 + "^"]  # its last 76
    path.write_text("source: [1, 2\n")  # the place the parser names is past the last line
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(path)
    lines = str(info.value).splitlines()
    assert lines[lines.index("  at line 2, column 1:") + 1 :] == ["    (the end of the text)"]
    for huge in (f"a: *{'y' * 5000}\n", f"a: !{'y' * 5000} 1\n"):  # an alias, a tag: quoted by the parser
        path.write_text(huge)
        with pytest.raises(quern.ConfigError) as info:
            quern.load_config(path)
        first = str(info.value).splitlines()[0]
        assert re.search(r"y\.\.\. \(4,\d{3} more characters\)$", first) and len(first) < 600, first[:3000]
    path.write_bytes("\ufeffsource: [1, 2\nbatch: 4\n".encode())  # a byte-order mark: no column of the parsers'
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(path)
    lines = str(info.value).splitlines()
    assert lines[lines.index("  at line 1, column 9:") + 1 :][:2] == ["    source: [1, 2", " " * 12 + "^"]


def test_doubled_prefixes_are_found():
    assert doubled_prefixes("source: source: ArrayRecordSource: no file matches 'x'") == [("source", "source")]
    assert doubled_prefixes("cfg.yaml: cfg.yaml: cannot parse")
    assert doubled_prefixes("source: source 'toks' is empty")
    assert not doubled_prefixes("source: ArrayRecordSource: no file matches 'x'")


# (id, change to the good config given the data folder, what the message says: each prefix once)
PREFIX_ONCE = [
    (
        "missing glob",
        lambda c, d: set_path(c, "source.paths", "nowhere/*.array_record"),
        "source: ArrayRecordSource: no file matches",
    ),
    (
        "missing file",
        lambda c, d: set_path(c, "source.paths", str(d / "nowhere.array_record")),
        "source: ArrayRecordSource: file not found",
    ),
    ("no paths", lambda c, d: set_path(c, "source.paths", []), "source: ArrayRecordSource: no files given"),
    (
        "not array_record",
        lambda c, d: set_path(c, "source.paths", str(d / "part.parquet")),
        "source: ArrayRecordSource: cannot open",
    ),
    (
        "bad columns",
        lambda c, d: set_path(c, "source", {"type": "parquet", "paths": str(d / "part.parquet"), "columns": ["zz"]}),
        "source: ParquetSource: columns ['zz'] not in",
    ),
    (
        "not parquet",
        lambda c, d: set_path(c, "source", {"type": "parquet", "paths": str(d / "toks-0.array_record")}),
        "source: ParquetSource: cannot open",
    ),
    (
        "empty source",
        lambda c, d: set_path(c, "source", {"type": "parquet", "paths": str(d / "empty.parquet")}),
        "source 'empty' is empty",
    ),
    (
        "tensorstore",
        lambda c, d: set_path(c, "source", {"type": "tensorstore", "spec": str(d / "nope.zarr")}),
        "source: TensorStoreSource: ",
    ),
    (
        "fn format",
        lambda c, d: set_path(c, "batch_transforms.0.fn", "no_colon_here"),
        "batch_transforms.0: fn must look like 'package.module:function', got 'no_colon_here'",
    ),
    (
        "short stream",
        lambda c, d: set_path(set_path(c, "num_epochs", 1), "batch.size", 1000),
        "batch: source 'toks' (600 records) x 1 epoch(s), fewer than one batch of 1000",
    ),
]


@pytest.mark.parametrize("change,fragment", [c[1:] for c in PREFIX_ONCE], ids=[c[0] for c in PREFIX_ONCE])
def test_each_prefix_is_said_once(files, tmp_path, change, fragment):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(change(_good(files), files)))
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and message.count(str(path)) == 1, message
    assert fragment in message and not doubled_prefixes(message), message
    assert "Value error" not in message, message
    with pytest.raises(quern.ConfigError) as info:  # a dict: no file to name
        quern.load_config(change(_good(files), files))
    assert fragment in str(info.value) and not doubled_prefixes(str(info.value)), str(info.value)


def _transforms_module(folder, body: str) -> str:
    """A module of transforms, with a name no other test uses, written in ``folder``; its name."""
    return write_module(folder, body, "quern_test_tx")


DOUBLE = "import numpy as np\n\ndef double(batch):\n    return {**batch, 'tokens': batch['tokens'] * np.uint8(2)}\n"


def test_fn_modules_are_found_in_the_config_folder(files, tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    module = _transforms_module(tmp_path / "cfg", DOUBLE)
    cfg = set_path(_good(files), "batch_transforms", [{"fn": f"{module}:double"}])
    (tmp_path / "cfg" / "pipe.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    path_before = list(sys.path)
    pipe = quern.load_config(tmp_path / "cfg" / "pipe.yaml")
    assert sys.path == path_before  # the folder was searched while importing, and taken off again
    plain = quern.load_config(set_path(_good(files), "batch_transforms", []))
    assert np.array_equal(pipe.batch_at(3)["tokens"], plain.batch_at(3)["tokens"] * 2)
    # worker processes start with the parent's sys.path, without the config folder: they get the module by value
    with pipe.iterator(num_workers=1, read_ahead=1) as it:
        assert it.wait_for_workers(timeout=120)  # a worker that cannot unpickle the pipeline fails here
        batches = [next(it) for _ in range(12)]
        stats = it.stats()
    assert stats["delivered_by_worker"][0] > 0, stats
    for s, batch in enumerate(batches):
        assert np.array_equal(batch["tokens"], pipe.batch_at(s)["tokens"])


def test_allowed_fn_modules_are_found_in_the_current_directory(files, tmp_path, monkeypatch):
    module = _transforms_module(tmp_path, DOUBLE)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != os.getcwd()])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfgs").mkdir()
    as_dict = set_path(_good(files), "batch_transforms", [{"fn": f"{module}:double"}])
    in_another_folder = tmp_path / "cfgs" / "pipe.yaml"
    in_another_folder.write_text(yaml.safe_dump(as_dict))
    for config in [as_dict, in_another_folder]:
        with pytest.raises(quern.ConfigError, match=f"module '{module}' is not allowed: .* --allow {module}"):
            quern.load_config(config)  # the current directory is not the config's folder: not trusted
    assert module not in sys.modules  # refused before the import
    for config in [as_dict, in_another_folder]:
        path_before = list(sys.path)
        assert quern.load_config(config, allow=[module]).batch_at(0)["tokens"].max() % 2 == 0
        assert sys.path == path_before


def test_a_missing_fn_module_says_where_it_was_looked_for(files, tmp_path):
    cfg = set_path(_good(files), "batch_transforms", [{"fn": "quern_test_no_such_module:f"}])
    with pytest.raises(quern.ConfigError, match="batch_transforms.0.fn: cannot import 'quern_test_no_such_module:f'"):
        quern.load_config(cfg, allow=["quern_test_no_such_module"])


def test_example_configs_are_the_example_pipelines(tmp_path, monkeypatch):
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "examples"))
    import quickstart

    folder, _ = quickstart.build_dataset(str(tmp_path / "data"))
    shutil.copytree(os.path.join(root, "examples", "configs"), tmp_path / "configs")
    assert_same_pipeline(
        quern.load_config(tmp_path / "configs" / "quickstart.yaml"), quickstart.make_pipeline(folder, 64)
    )
    assert_same_pipeline(quern.load_config(tmp_path / "configs" / "lm.yaml"), quickstart.make_pipeline(folder, 32))
