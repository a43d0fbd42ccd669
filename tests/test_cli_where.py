"""Tests of ``quern where`` (pipeline/cli): the ``(step, row)`` pairs of a source record (issue 24, point 4).

The command prints ``pipe.where(record, component=, epochs=)`` of the config's pipeline, one
``step S row R`` line per pair (``--json``: a list), and exits 2 naming the bad argument.
"""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import quern_cmd, write_shards

import quern

pytestmark = pytest.mark.timeout(300)


def _config(tmp_path, cfg, name):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def configs(tmp_path):
    for sub, seed in (("a", 1), ("b", 2)):
        (tmp_path / sub).mkdir()
        write_shards(tmp_path / sub, seed=seed)
    plain = {
        "source": {"type": "array_record", "paths": "a/toks-*.array_record"},
        "seed": 5,
        "shuffle": "global",
        "num_epochs": 3,
        "transforms": [{"name": "decode", "kwargs": {"dtype": "uint8"}}, {"name": "pad", "kwargs": {"length": 8}}],
        "batch": {"size": 8},
    }
    mix = {
        "mix": {
            "seed": 3,
            "components": {
                "web": {"source": {"type": "array_record", "paths": "a/toks-*.array_record", "name": "a"}, "seed": 1},
                "code": {"source": {"type": "array_record", "paths": "b/toks-*.array_record", "name": "b"}, "seed": 2},
            },
            "weights": {"web": 0.7, "code": 0.3},
        },
        "transforms": plain["transforms"],
        "batch": 8,
    }
    return _config(tmp_path, plain, "plain.yaml"), _config(tmp_path, mix, "mix.yaml")


def test_quern_where_prints_the_pairs_of_pipe_where(configs):
    plain, mix = configs
    pipe = quern.load_config(plain)
    want = pipe.where(123, epochs=3)
    assert len(want) == 3 and all(pipe.explain(s)[r] == [("toks", 123)] for s, r in want)
    out = quern_cmd("where", plain, 123, "--epochs", 3)
    assert out.stdout.splitlines() == [f"step {s} row {r}" for s, r in want]
    assert json.loads(quern_cmd("where", plain, 123, "--epochs", 3, "--json").stdout) == [list(p) for p in want]
    assert quern_cmd("where", plain, 123).stdout.splitlines() == [f"step {s} row {r}" for s, r in want[:1]]
    mixture = quern.load_config(mix)
    got = json.loads(quern_cmd("where", mix, 7, "--component", "code", "--epochs", 2, "--json").stdout)
    assert got == [list(p) for p in mixture.where(7, component="code", epochs=2)] and got
    assert all(("code", 7) in mixture.explain(s)[r] for s, r in got)


def test_quern_where_refuses_bad_records_and_components(configs):
    plain, mix = configs
    for config, args, says in (
        (plain, [600], "record 600 is not a record of source"),
        (plain, [5, "--component", "web"], "the pipeline is not a mixture"),
        (mix, [5], "code"),  # a mixture needs component=: the components are listed
        (mix, [5, "--component", "nope"], "nope"),
        (plain, [-1], "must be >= 0"),
        (plain, [1, "--epochs", 0], "must be >= 1"),
    ):
        out = quern_cmd("where", config, *args, check=False)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
