"""The `quern` command, run as a subprocess on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from array_record.python import array_record_module

import quern
from test_config import BAD, _good, _set, write_shards

pytestmark = pytest.mark.timeout(300)


def quern_cmd(*args, check=True) -> subprocess.CompletedProcess:
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "quern.pipeline.cli", *map(str, args)],
                         capture_output=True, text=True, timeout=120, env=env)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture
def config(tmp_path):
    write_shards(tmp_path, seed=1)
    cfg = _good(tmp_path)
    cfg["source"]["paths"] = "toks-*.array_record"  # relative to the config file
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_run_prints_throughput_and_saves_state(config, tmp_path):
    out = quern_cmd("run", config, "--steps", 30, "--workers", 2, "--save-state", tmp_path / "state.json")
    assert "30 steps, 240 records" in out.stdout and "records/s" in out.stdout
    assert "30/30 steps" in out.stderr  # the progress bar
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 30


def test_run_refuses_to_resume_against_changed_data(config, tmp_path):
    quern_cmd("run", config, "--steps", 5, "--save-state", tmp_path / "state.json")
    resumed = quern_cmd("run", config, "--steps", 5, "--state", tmp_path / "state.json")
    assert "next step 10" in resumed.stdout
    w = array_record_module.ArrayRecordWriter(str(tmp_path / "toks-1.array_record"), "group_size:1")
    for i in range(300):
        w.write(bytes([1 + i % 200]) * 7)
    w.close()
    refused = quern_cmd("run", config, "--steps", 5, "--state", tmp_path / "state.json", check=False)
    assert refused.returncode == 2
    assert "does not match this pipeline's" in refused.stderr and "--force" not in refused.stdout
    forced = quern_cmd("run", config, "--steps", 5, "--state", tmp_path / "state.json", "--force")
    assert "next step 10" in forced.stdout


def test_explain_any_step_at_once(config):
    pipe = quern.load_config(config)
    out = quern_cmd("explain", config, "--step", 10**9, "--process-index", 1, "--process-count", 2, "--json")
    got = json.loads(out.stdout)
    assert [r["records"] for r in got["rows"]] == [[list(x) for x in row] for row in pipe.explain(10**9, 1, 2)]
    assert [r["position"] for r in got["rows"]] == list(range(8 * 10**9 + 4, 8 * 10**9 + 8))
    text = quern_cmd("explain", config, "--step", 3).stdout
    assert text.startswith("step 3, host 0 of 1: 8 rows") and f"toks[{pipe.explain(3)[0][0][1]}]" in text


def test_inspect_summarises_a_batch(config):
    pipe = quern.load_config(config)
    batch = pipe.batch_at(4)
    out = quern_cmd("inspect", config, "--step", 4).stdout
    assert "batch['tokens']: uint8 (8, 16)" in out
    assert f"batch['length']: int32 (8,)  min {batch['length'].min()}  max {batch['length'].max()}" in out
    pad = 1 - batch["length"].sum() / batch["tokens"].size
    assert f"padding: {pad:.1%} of 8 x 16 token slots" in out


def test_bench_times_each_stage(config):
    out = quern_cmd("bench", config, "--steps", 5).stdout
    for stage in ["read", "record transforms", "collate", "batch transforms"]:
        assert f"  {stage} " in out
    assert "bound by: " in out.splitlines()[-1]


@pytest.mark.parametrize("command", ["run", "explain", "inspect", "bench"])
def test_help(command):
    out = quern_cmd(command, "--help")
    assert out.stdout.startswith("usage: quern " + command)


@pytest.mark.parametrize("path,value,fragment", BAD, ids=[f"{p}={v!r}"[:40] for p, v, _ in BAD])
def test_bad_config_exits_2_with_the_message(tmp_path, config, path, value, fragment):
    cfg = _set(yaml.safe_load(config.read_text()), path, value)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = quern_cmd("inspect", bad, "--step", 0, check=False)
    assert out.returncode == 2 and fragment in out.stderr, out.stderr


def test_batch_size_and_host_count(config):
    out = quern_cmd("explain", config, "--step", 0, "--process-count", 3, check=False)
    assert out.returncode == 2 and "batch size 8 is not divisible by the host count 3" in out.stderr


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "quern")
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "run" in out.stdout and "explain" in out.stdout


def test_bad_arguments_and_short_streams_exit_2_or_are_capped(config, tmp_path):
    cfg = yaml.safe_load(config.read_text())
    cfg["num_epochs"] = 1  # 600 records, batch 8: 75 steps
    finite = tmp_path / "finite.yaml"
    finite.write_text(yaml.safe_dump(cfg))
    for args in [("explain", config, "--step", 0, "--process-count", 0),
                 ("inspect", config, "--step", -1),
                 ("inspect", config, "--step", 0, "--process-index", 5),
                 ("run", config, "--workers", -1),
                 ("run", finite, "--start-step", 80),
                 ("run", config, "--state", tmp_path / "missing.json"),
                 ("bench", finite, "--start-step", 75)]:
        out = quern_cmd(*args, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (args, out.stderr)
    run = quern_cmd("run", finite, "--start-step", 70, "--steps", 20)
    assert "running 5 steps" in run.stderr and "next step 75" in run.stdout
    assert "5 steps" in quern_cmd("bench", finite, "--start-step", 70).stdout
