"""Filters, mixtures and schedules as configuration (issue 11, point 7): the YAML keys,
``to_config`` round trips, the messages, and what ``quern explain/inspect/run`` say
about a mixture's components."""

from __future__ import annotations

import functools
import json
import random
import re
import sys
import uuid

import numpy as np
import pytest
import yaml
from helpers import (
    DELETE,
    assert_same_pipeline,
    case_ids,
    config_refusal,
    importable,
    quern_cmd,
    set_path,
    write_module,
    write_shards,
)

import quern
from quern.pipeline.cli import main
from quern.pipeline.core.registry import REGISTRY
from quern.pipeline.order.components import QUANTUM, quantize
from quern.pipeline.streams.config_form import weights_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("isolated_cache")]

HELPERS = '''
import dataclasses

import numpy as np


def longer(record, min_len=10):
    """A filter's predicate: records (bytes) of at least ``min_len`` bytes."""
    return len(record) >= min_len


def shift(batch, by=1):
    return {**batch, "shifted": np.roll(batch["tokens"], -by, axis=1)}


def boom(record):
    raise ValueError(f"kaboom: a record of {len(record)} bytes")


@dataclasses.dataclass(frozen=True)
class MinLen:
    """A filter to register: a dataclass, so that to_config writes it back by name."""

    min_len: int = 10

    def __call__(self, record):
        return len(record) >= self.min_len
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with two sets of shards (``a/``, ``b/``) and a module of helpers (importable:
    the folder is on ``sys.path``): ``(folder, module)``. Configs are written there too, so
    the module is also the one beside them."""
    d = tmp_path_factory.mktemp("plan")
    for sub, seed in [("a", 0), ("b", 1)]:
        (d / sub).mkdir()
        write_shards(d / sub, seed=seed)
    with importable(d, write_module(d, HELPERS, "quern_test_plan")) as module:
        yield d, module


def _source(d, sub):
    return quern.sources.ArrayRecordSource(str(d / sub / "toks-*.array_record"), name=sub)


def _mixture(folder, schedule=None, weights=None, batch=16, block=1024):
    """web (shuffled, filtered) and code, mixed, decoded and padded at the mixture level,
    batched, shifted."""
    d, h = folder
    web = quern.Pipeline.from_source(_source(d, "a"), seed=1).shuffle().filter(functools.partial(h.longer, min_len=12))
    code = quern.Pipeline.from_source(_source(d, "b"), seed=2).shuffle("block", block_size=30, window=4)
    return (
        quern.mix({"web": web, "code": code}, weights=weights, schedule=schedule, seed=7, block=block)
        .map(quern.transforms.decode(np.uint8))
        .map(quern.transforms.pad(16))
        .batch(batch)
        .map_batch(functools.partial(h.shift, by=2))
    )


SCHEDULE = [(0, {"web": 0.9, "code": 0.1}), (20, {"web": 0.25, "code": 0.75}), (50, {"web": 3, "code": 1})]


# --------------------------------------------------------------------------- weights


def test_quantized_weights_are_written_so_that_they_quantize_back():
    rng = random.Random(0)
    for _ in range(3000):
        c = rng.randint(1, 6)
        raw = [rng.random() ** rng.choice([1, 4, 20]) * rng.choice([0, 1, 1]) for _ in range(c)]
        if not sum(raw):
            continue
        q = quantize(raw)
        assert sum(q) == QUANTUM and quantize(list(q)) == q  # the integers themselves give them back
        assert quantize([w / QUANTUM for w in q]) == q  # and so do they over 2**32 (exact in a double)
        written = weights_config(tuple(f"c{i}" for i in range(c)), q)
        assert quantize(list(written.values())) == q, (raw, written)
    assert weights_config(("web", "code"), quantize([0.7, 0.3])) == {"web": 0.7, "code": 0.3}
    assert weights_config(("web", "code"), quantize([7, 3])) == {"web": 0.7, "code": 0.3}  # relative weights


# --------------------------------------------------------------------------- filters


def test_filtered_pipeline_round_trips(folder, tmp_path, isolated_cache):
    d, h = folder
    pipe = (
        quern.Pipeline.from_source(_source(d, "a"), seed=3, num_epochs=2)
        .shuffle()
        .filter(functools.partial(h.longer, min_len=12))
        .map(quern.transforms.decode(np.uint8))
        .map(quern.transforms.pad(40))
        .batch(8)
        .map_batch(h.shift)
    )
    cfg = pipe.to_config()
    assert cfg["transforms"][0] == {"fn": f"{h.__name__}:longer", "kind": "filter", "kwargs": {"min_len": 12}}
    assert list(isolated_cache.glob("filters/*.survivors"))  # the scan's cache: under QUERN_CACHE_DIR
    loaded = quern.load_config(cfg, allow=[h.__name__])
    assert_same_pipeline(pipe, loaded, steps=(0, 5, pipe.num_steps - 1))
    assert np.array_equal(loaded.survivors, pipe.survivors)
    assert all(batch.min() >= 12 for batch in [loaded.batch_at(s)["length"] for s in range(10)])
    path = d / f"filtered-{uuid.uuid4().hex[:6]}.yaml"  # beside the module: named without --allow
    path.write_text(yaml.safe_dump(json.loads(json.dumps(cfg))))
    assert_same_pipeline(pipe, quern.load_config(path), steps=(0, 107))
    with pytest.raises(quern.ConfigError, match=rf"transforms.0.fn: module '{h.__name__}' is not allowed"):
        quern.load_config(cfg)  # a dict has no folder: the same trust rule as any fn


def test_a_registered_filter_by_name(folder, monkeypatch):
    d, h = folder
    name = f"quern_test_min_len_{uuid.uuid4().hex[:6]}"
    monkeypatch.setitem(REGISTRY, name, h.MinLen)
    cfg = {
        "source": {"type": "array_record", "paths": str(d / "a" / "toks-*.array_record")},
        "transforms": [
            {"name": name, "kind": "filter", "kwargs": {"min_len": 30}},
            {"name": "decode"},
            {"name": "pad", "kwargs": {"length": 40}},
        ],
        "batch": 4,
    }
    pipe = quern.load_config(cfg)
    assert pipe.record_ops[0].kind == "filter" and 0 < len(pipe.survivors) < 600
    assert all(len(r) >= 30 for r in pipe.source.read_many(pipe.survivors.tolist()))
    assert pipe.to_config()["transforms"][0] == {"name": name, "kind": "filter", "kwargs": {"min_len": 30}}
    assert_same_pipeline(pipe, quern.load_config(pipe.to_config()))


# --------------------------------------------------------------------------- mixtures


def test_scheduled_mixture_round_trips_through_yaml_and_json(folder):
    d, h = folder
    pipe = _mixture(folder, schedule=SCHEDULE, block=256)
    cfg = pipe.to_config()
    mix = cfg["mix"]
    assert [c["name"] for c in mix["components"]] == ["web", "code"] and mix["seed"] == 7 and mix["block"] == 256
    assert mix["components"][0]["transforms"][0]["kind"] == "filter"
    assert mix["schedule"] == [
        {"start_step": 0, "weights": {"web": 0.9, "code": 0.1}},
        {"start_step": 20, "weights": {"web": 0.25, "code": 0.75}},
        {"start_step": 50, "weights": {"web": 0.75, "code": 0.25}},
    ]
    assert "source" not in cfg and "shuffle" not in cfg and [t["name"] for t in cfg["transforms"]] == ["decode", "pad"]
    steps = (0, 7, 19, 20, 21, 49, 50, 300)
    assert_same_pipeline(pipe, quern.load_config(cfg, allow=[h.__name__]), steps)
    assert_same_pipeline(pipe, quern.load_config(json.loads(json.dumps(cfg)), allow=[h.__name__]), steps)
    path = d / f"mixture-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(cfg))  # sorts mappings' keys: the components' order is kept by the list
    loaded = quern.load_config(path)
    assert_same_pipeline(pipe, loaded, steps)
    assert loaded.explain(21) == pipe.explain(21) and {n for row in loaded.explain(0) for n, _ in row} <= {
        "web",
        "code",
    }
    single = _mixture(folder, weights={"web": 7, "code": 3})
    assert single.to_config()["mix"]["weights"] == {"web": 0.7, "code": 0.3}
    assert_same_pipeline(single, quern.load_config(single.to_config(), allow=[h.__name__]))


def test_a_hand_written_mixture_is_the_python_one(folder):
    d, h = folder
    text = f"""
mix:
  seed: 7
  components:
    web:
      source: {{type: array_record, paths: "a/toks-*.array_record", name: a}}
      seed: 1
      shuffle: global
      transforms: [{{fn: "{h.__name__}:longer", kind: filter, kwargs: {{min_len: 12}}}}]
    code:
      source: {{type: array_record, paths: "b/toks-*.array_record", name: b}}
      seed: 2
      num_epochs: null
      shuffle: {{mode: block, block: 30, window: 4}}
  schedule:
    - {{start_step: 0, weights: {{web: 0.9, code: 0.1}}}}
    - {{start_step: 20, weights: {{web: 0.25, code: 0.75}}}}
    - {{start_step: 50, weights: {{web: 3, code: 1}}}}
transforms: [{{name: decode, kwargs: {{dtype: uint8}}}}, {{name: pad, kwargs: {{length: 16}}}}]
batch: 16
batch_transforms: [{{fn: "{h.__name__}:shift", kwargs: {{by: 2}}}}]
"""
    path = d / f"hand-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(text)
    assert_same_pipeline(_mixture(folder, schedule=SCHEDULE), quern.load_config(path), (0, 20, 50))


def _good_mix(d, h) -> dict:
    src = {"type": "array_record", "paths": str(d / "a" / "toks-*.array_record")}
    return {
        "mix": {
            "components": {
                "web": {"source": src, "seed": 1, "shuffle": "global"},
                "code": {"source": {**src, "paths": str(d / "b" / "toks-*.array_record")}},
            },
            "schedule": [
                {"start_step": 0, "weights": {"web": 0.9, "code": 0.1}},
                {"start_step": 10, "weights": {"web": 1, "code": 1}},
            ],
        },
        "transforms": [{"name": "decode", "kwargs": {"dtype": "uint8"}}, {"name": "pad", "kwargs": {"length": 16}}],
        "batch": 8,
    }


_FILTER = {"fn": "HELPERS:longer", "kind": "filter"}

BAD_MIX = [
    ("source", {"type": "array_record", "paths": "x"}, "source: give either source (one source) or mix"),
    ("mix", DELETE, "source: Field required (or a mix: section"),
    ("seed", 3, "seed: with mix, the mixture's seed is mix.seed"),
    ("shuffle", "global", "shuffle: a mixture is not shuffled itself: shuffle its components"),
    ("num_epochs", 2, "num_epochs: a mixture is endless"),
    ("mix.weights", {"web": 1, "code": 1}, "mix: give exactly one of 'weights'"),
    ("mix.schedule", DELETE, "mix: give exactly one of 'weights'"),
    ("mix.schedule", [], "mix.schedule: List should have at least 1 item"),
    ("mix.schedule.1.weights", {"web": 1}, "mix.schedule.1.weights: weights must name exactly the components"),
    ("mix.schedule.1.weights", {"web": -1, "code": 1}, "mix.schedule.1.weights: the weight of 'web' is -1.0; weig"),
    ("mix.schedule.1.weights", {"web": 0, "code": 0}, "mix.schedule.1.weights: every weight is zero"),
    ("mix.schedule.1.weights", {"web": "x", "code": 1}, "mix.schedule.1.weights: the weight of 'web' must be a n"),
    ("mix.schedule.1.weights", {"web": float("nan"), "code": 1}, "mix.schedule.1.weights: the weight of 'web' is nan"),
    ("mix.schedule.1.start_step", 0, "mix.schedule.1.start_step: 0 is not after the start of stage 0"),
    ("mix.schedule.0.start_step", 5, "mix.schedule.0.start_step: the first stage must start at step 0, got 5"),
    ("mix.schedule.1.start", 3, "mix.schedule.1.start: unknown key 'start'; did you mean 'start_step'?"),
    ("mix.seed", -1, "mix.seed: Input should be greater than or equal to 0"),
    ("mix.block", 0, "mix.block: Input should be greater than or equal to 1"),
    ("mix.components", {}, "mix.components: Dictionary should have at least 1 item"),
    ("mix.components.web.num_epochs", 0, "mix.components.web.num_epochs: Input should be greater than or equal to 1"),
    ("mix.stop", "never", "mix.stop: Input should be 'first' or 'last'"),
    ("mix.components.web.batch", 8, "mix.components.web.batch: unknown key 'batch'; it belongs under the top level"),
    ("mix.components.web.shufle", "global", "mix.components.web.shufle: unknown key 'shufle'; did you mean 'shuf"),
    ("mix.components.web.source.paths", "nowhere/*.array_record", "mix.components.web.source: ArrayRecordSource: no"),
    ("mix.components.web.transforms", [{**_FILTER, "kwargs": {"min_len": 99}}], "mix.components.web.transforms.0: "),
    ("mix.components.web.transforms", [{"fn": "os:system", "kind": "filter"}], "transforms.0.fn: module 'os' is not"),
    ("mix.components.web.transforms", [{"name": "decode", "kind": "random_map"}, _FILTER], "filter() after random_m"),
    ("transforms", [_FILTER], "transforms.0.kind: 'filter' does not belong here; a mixture's records are filtered"),
    ("batch_transforms", [_FILTER], "batch_transforms.0.kind: 'filter' does not belong here; put it under transforms"),
    ("weights", {"web": 1}, "weights: unknown key 'weights'; it belongs under mix"),
]


@pytest.mark.parametrize("path,value,fragment", BAD_MIX, ids=case_ids(BAD_MIX))
def test_bad_mixture_configs_name_the_key(folder, tmp_path, path, value, fragment):
    d, h = folder
    value = json.loads(json.dumps(value).replace("HELPERS", h.__name__)) if value is not DELETE else value
    message = config_refusal(_good_mix(d, h), (path, value), allow=[h.__name__])
    assert fragment in message, message


def test_mixture_errors_in_a_file_say_the_file_once(folder, tmp_path):
    d, h = folder
    cfg = set_path(_good_mix(d, h), "mix.schedule.1.weights", {"web": -1, "code": 1})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(path)
    message = str(info.value)
    assert message == f"{path}: mix.schedule.1.weights: the weight of 'web' is -1.0; weights must be >= 0", message


def test_components_as_a_list_and_their_order(folder):
    d, h = folder
    cfg = _good_mix(d, h)
    as_list = json.loads(json.dumps(cfg))
    as_list["mix"]["components"] = [{"name": k, **v} for k, v in cfg["mix"]["components"].items()]
    assert_same_pipeline(quern.load_config(cfg), quern.load_config(as_list))
    reordered = json.loads(json.dumps(cfg))
    reordered["mix"]["components"] = dict(reversed(list(cfg["mix"]["components"].items())))
    assert quern.load_config(reordered).fingerprint() != quern.load_config(cfg).fingerprint()  # order is meaning
    twice = json.loads(json.dumps(as_list))
    twice["mix"]["components"][1]["name"] = "web"
    with pytest.raises(quern.ConfigError, match="mix.components: item 1: component 'web' is named twice"):
        quern.load_config(twice)


# --------------------------------------------------------------------------- the command


def _write_mixture(d, h, batch=64, extra_transform=None) -> tuple:
    """A mixture config file beside the helpers (weights 0.9/0.1, then 0.5/0.5 from step 200):
    ``(path, pipeline)``."""
    schedule = [(0, {"web": 0.9, "code": 0.1}), (200, {"web": 0.5, "code": 0.5})]
    pipe = _mixture((d, h), schedule=schedule, batch=batch)
    cfg = pipe.to_config()
    if extra_transform is not None:
        cfg["mix"]["components"][0]["transforms"].append(extra_transform)
    path = d / f"cli-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, pipe


_DRAWN = re.compile(r"components drawn: web (\d\.\d{3}), code (\d\.\d{3}) \((steps? [\d-]+), ([\d,]+) rows\)")


def test_run_prints_the_proportions_drawn(folder):
    d, h = folder
    path, _ = _write_mixture(d, h)
    for args, weights, steps in [
        (["--steps", 48], (0.9, 0.1), "steps 0-47"),  # 3 whole blocks of 1024 rows: within 2 rows of the weights
        (["--start-step", 200, "--steps", 48, "--workers", 1], (0.5, 0.5), "steps 200-247"),
    ]:
        out = quern_cmd("run", path, *args)  # a subprocess; the helpers beside the config, for workers too
        web, code, said, rows = _DRAWN.search(out.stdout).groups()
        assert said == steps and rows == "3,072", out.stdout
        assert abs(float(web) - weights[0]) < 0.002 and abs(float(code) - weights[1]) < 0.002, out.stdout


def test_the_counts_run_prints_are_those_of_the_plan(folder):
    """``quern run`` counts the rows per component in O(stages + block) (a long run's millions
    of positions): the same counts as the segments of every position."""
    from quern.pipeline.cli import _count

    d, h = folder
    web = quern.Pipeline.from_source(_source(d, "a"), seed=1).shuffle().filter(functools.partial(h.longer, min_len=12))
    other = quern.Pipeline.from_source(_source(d, "b"), seed=5)
    pipe = quern.mix(
        {"web": web, "code": other, "zero": other},
        schedule=[(0, [0.9, 0.1, 0]), (3, [0.2, 0.3, 0.5]), (40, [1, 0, 0]), (41, [0.01, 0.5, 0.49])],
        seed=11,
        block=100,
    ).batch(48)
    rng = np.random.default_rng(0)
    edges = [0, 1, 144, 1919, 1920, 1968, 1969, 48 * 41]
    ranges = [(a, b) for a in edges for b in edges if a <= b] + [
        (int(a), int(a + n)) for a, n in zip(rng.integers(0, 3000, 40), rng.integers(0, 3000, 40))
    ]
    for first, end in ranges:
        seg = pipe.segments(np.arange(first, end))
        assert np.array_equal(_count(pipe, first, end), np.bincount(seg.component, minlength=3)), (first, end)
    assert _count(pipe, 0, 48 * 40 + 3)[2] == _count(pipe, 0, 48 * 40)[2]  # a weight of 0 from step 40


def test_inspect_and_explain_show_the_components(folder, capsys):
    d, h = folder
    path, pipe = _write_mixture(d, h)
    for step in [3, 230]:
        names = [name for row in pipe.explain(step) for name, _ in row]
        expected = f"web {names.count('web') / 64:.3f}, code {names.count('code') / 64:.3f} (step {step}, 64 rows)"
        assert main(["inspect", str(path), "--step", str(step)]) == 0
        out = capsys.readouterr().out
        assert f"  components drawn: {expected}" in out and "batch['shifted']: uint8 (64, 16)" in out, out
        assert main(["explain", str(path), "--step", str(step)]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[1] == f"  components drawn: {expected}", out
        row_names = [re.search(r"position \d+  (\w+)\[\d+\]$", line).group(1) for line in lines[2:]]
        assert row_names == names and set(names) == {"web", "code"}
    assert main(["explain", str(path), "--step", "230", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["components"] == {"web": names.count("web"), "code": names.count("code")}
    assert [r["records"] for r in got["rows"]] == [[list(x) for x in row] for row in pipe.explain(230)]


def test_a_failing_filter_is_a_data_error_naming_its_key(folder, capsys):
    d, h = folder
    path, _ = _write_mixture(d, h, extra_transform={"fn": f"{h.__name__}:boom", "kind": "filter"})
    assert main(["inspect", str(path), "--step", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"quern: {path}: mix.components.web.transforms.1: filter scan, stage filter[1] boom"), err
    assert "ValueError: kaboom" in err and err.count("\n") == 1 and "unexpected" not in err, err
    with pytest.raises(quern.ScanError, match=r"^mix.components.web.transforms.1: filter scan"):
        quern.load_config(yaml.safe_load(path.read_text()), allow=[h.__name__])


def test_single_source_commands_say_nothing_about_components(folder, capsys):
    d, h = folder
    path = d / f"plain-{uuid.uuid4().hex[:6]}.yaml"
    cfg = {
        "source": {"type": "array_record", "paths": "a/toks-*.array_record"},
        "transforms": [
            {"fn": f"{h.__name__}:longer", "kind": "filter"},
            {"name": "decode"},
            {"name": "pad", "kwargs": {"length": 8}},
        ],
        "batch": 4,
    }
    path.write_text(yaml.safe_dump(cfg))
    for command in (["inspect", str(path), "--step", "2"], ["explain", str(path), "--step", "2"]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "components drawn" not in out and out.startswith("step 2, host 0 of 1"), out
    assert sys.modules[h.__name__] is h  # the module beside the config is the one imported
