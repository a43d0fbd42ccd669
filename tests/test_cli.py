"""Tests of pipeline/cli/.

The `quern` command, run as a subprocess on real files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml
from helpers import case_ids, doubled_prefixes, quern_cmd, set_path, write_array_record, write_parquets, write_shards
from test_config import BAD, DOUBLE, PREFIX_ONCE, _good, _transforms_module

import quern

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def allow_test_config(monkeypatch):
    """The configs here name ``test_config:shift``, a module outside their folder: allowed through
    ``QUERN_ALLOW``, here and in the commands run (tests of the trust model: test_config_security.py)."""
    monkeypatch.setenv("QUERN_ALLOW", "test_config")


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
    assert out.stderr == ""  # no bar when stderr is not a terminal (the bar: test_cli_progress.py)
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 30


def test_run_refuses_to_resume_against_changed_data(config, tmp_path):
    quern_cmd("run", config, "--steps", 5, "--save-state", tmp_path / "state.json")
    resumed = quern_cmd("run", config, "--steps", 5, "--state", tmp_path / "state.json")
    assert "next step 10" in resumed.stdout
    write_array_record(tmp_path / "toks-1.array_record", [bytes([1 + i % 200]) * 7 for i in range(300)])
    refused = quern_cmd("run", config, "--steps", 5, "--state", tmp_path / "state.json", check=False)
    assert refused.returncode == 2
    assert "does not match this pipeline's" in refused.stderr
    assert "--force" in refused.stderr and "force=True" not in refused.stderr  # says the flag, not the argument
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
    lines = out.splitlines()
    assert lines[0].startswith("5 steps, 40 records")
    for stage in ["read", "map[0] decode", "map[1] pad", "collate", "map_batch[0]"]:  # one line per stage
        assert any(line.startswith(f"  {stage}") and "ms/step" in line for line in lines), (stage, out)
    assert any(line.startswith("bound by: ") for line in lines)
    assert [line.split(":")[0] for line in lines[-4:]] == ["loop", "note", "where the data waits", "suggestion"]


@pytest.mark.parametrize("command", ["run", "explain", "inspect", "bench"])
def test_help(command):
    out = quern_cmd(command, "--help")
    assert out.stdout.startswith("usage: quern " + command)


@pytest.mark.parametrize("path,value,fragment", BAD, ids=case_ids(BAD))
def test_bad_config_exits_2_with_the_message(tmp_path, config, path, value, fragment):
    cfg = set_path(yaml.safe_load(config.read_text()), path, value)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = quern_cmd("inspect", bad, "--step", 0, check=False)
    assert out.returncode == 2 and fragment in out.stderr, out.stderr


def test_batch_size_and_host_count(config):
    out = quern_cmd("explain", config, "--step", 0, "--process-count", 3, check=False)
    assert out.returncode == 2 and "batch size 8 is not divisible by the host count (process_count) 3" in out.stderr


def test_console_script_is_installed():
    out = quern_cmd("--help", script=True)
    assert out.stdout.startswith("usage: quern ") and "run" in out.stdout and "explain" in out.stdout
    assert "exit status" in out.stdout and "--traceback" in out.stdout  # the epilog


@pytest.mark.parametrize("script", [True, False], ids=["quern", "python -m quern"])
def test_version(script):
    out = quern_cmd("--version", script=script)
    assert out.stdout.strip() == f"quern {quern.__version__}" and not out.stderr


def test_python_m_quern_is_the_quern_command(config):
    script, module = (quern_cmd("explain", config, "--step", 7, "--json", script=s) for s in (True, False))
    assert script.stdout == module.stdout and json.loads(module.stdout)["step"] == 7
    missing = [
        quern_cmd("inspect", config.parent / "missing.yaml", "--step", 0, check=False, script=s) for s in (True, False)
    ]
    assert [m.returncode for m in missing] == [2, 2] and missing[0].stderr == missing[1].stderr


def test_bad_arguments_and_short_streams_exit_2_or_are_capped(config, tmp_path):
    cfg = yaml.safe_load(config.read_text())
    cfg["num_epochs"] = 1  # 600 records, batch 8: 75 steps
    finite = tmp_path / "finite.yaml"
    finite.write_text(yaml.safe_dump(cfg))
    for args in [
        ("explain", config, "--step", 0, "--process-count", 0),
        ("inspect", config, "--step", -1),
        ("inspect", config, "--step", 0, "--process-index", 5),
        ("run", config, "--workers", -1),
        ("run", finite, "--start-step", 80),
        ("run", config, "--state", tmp_path / "missing.json"),
        ("bench", finite, "--start-step", 75),
    ]:
        out = quern_cmd(*args, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (args, out.stderr)
        one_message = out.stderr.startswith("quern: ") and out.stderr.count("\n") == 1
        assert one_message or out.stderr.startswith("usage: quern "), (args, out.stderr)  # or argparse's
    run = quern_cmd("run", finite, "--start-step", 70, "--steps", 20)
    assert "running 5 steps" in run.stderr and "next step 75" in run.stdout
    assert "5 steps" in quern_cmd("bench", finite, "--start-step", 70).stdout


# --------------------------------------------------------------------------- errors are messages

_FAILS = """import os

PARENT = os.getpid()


def boom(record):
    raise ValueError(f"kaboom: a record of {len(record)} tokens")


def boom_in_workers(record):  # fails only in a worker process (no step is computed in the parent)
    if os.getpid() != PARENT:
        raise ValueError(f"kaboom: a record of {len(record)} tokens")
    return record


def stuck(record):  # never returns (a stalled transform)
    import time

    time.sleep(1000)
    return record
"""

_STEP_ERROR = re.compile(r"step (\d+) \(host 0 of 1\), stage map\[2\] (\w+), row (\d+) = record (\d+) of source 'toks'")


@pytest.fixture
def failing(tmp_path, config):
    """A config whose third record transform raises, from a module beside it: ``(path, fn)``."""
    module = _transforms_module(tmp_path, _FAILS)

    def make(fn: str):
        cfg = yaml.safe_load(config.read_text())
        cfg["transforms"].append({"fn": f"{module}:{fn}"})
        path = tmp_path / f"{fn}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    return make


# run-in-worker: a step fails in a worker process, whose traceback the message leaves out
@pytest.mark.parametrize(
    "fn,args",
    [
        ("boom", ["run", "--steps", 5]),
        ("boom", ["run", "--steps", 5, "--workers", 2]),
        ("boom_in_workers", ["run", "--steps", 100_000, "--workers", 1]),
        ("boom", ["inspect", "--step", 3]),
        ("boom", ["bench", "--start-step", 2]),
    ],
    ids=["run", "run-workers", "run-in-worker", "inspect", "bench"],
)
def test_a_failing_step_is_one_message_and_exit_1(config, failing, tmp_path, fn, args):
    path = failing(fn)
    command, *options = args
    out = quern_cmd(command, path, *options, check=False, cwd=tmp_path.parent)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line]  # no progress bar: stderr is not a terminal
    message = lines[-1]
    assert message.startswith("quern: step ") and len(lines) == 1, out.stderr
    step, stage, row, record = _STEP_ERROR.search(message).groups()
    assert stage == fn and "ValueError: kaboom: a record of" in message
    if command == "inspect":
        assert step == "3"
    elif command == "bench":
        assert step == "2"
    assert int(record) == quern.load_config(config).explain(int(step))[int(row)][0][1]  # the right record
    full = quern_cmd(command, path, *options, "--traceback", check=False, cwd=tmp_path.parent)
    assert full.returncode == 1 and "Traceback (most recent call last)" in full.stderr
    assert "StepError: step " in full.stderr and "ValueError: kaboom" in full.stderr


def test_unreadable_records_and_collate_failures_are_messages(config, tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "big").mkdir()
    records = [rng.integers(0, 255, 1000, dtype=np.uint8).tobytes() for _ in range(200)]
    write_array_record(tmp_path / "big" / "big-0.array_record", records, "group_size:1,uncompressed")
    data = bytearray((tmp_path / "big" / "big-0.array_record").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 500] = bytes(500)  # a chunk in the middle: opens, fails to read
    (tmp_path / "big" / "big-0.array_record").write_bytes(bytes(data))
    corrupt = tmp_path / "corrupt.yaml"
    corrupt.write_text(yaml.safe_dump({"source": {"type": "array_record", "paths": "big/*.array_record"}, "batch": 10}))
    for command in [
        ("run", corrupt, "--steps", 30),
        ("run", corrupt, "--steps", 30, "--workers", 2),
        ("bench", corrupt, "--steps", 30),
    ]:
        out = quern_cmd(*command, check=False)
        message = out.stderr.splitlines()[-1]
        assert out.returncode == 1 and "Traceback" not in out.stderr, (command, out.stderr)
        assert re.match(
            r"quern: step 1[0-9] \(host 0 of 1\), stage 'read' of source 'big' \(records big \[1[0-9]{2}, ", message
        ), message
        assert "big-0.array_record" in message and "Corrupted" in message
    cfg = yaml.safe_load(config.read_text())
    del cfg["transforms"][1]  # no pad: rows of different lengths
    unpadded = tmp_path / "unpadded.yaml"
    unpadded.write_text(yaml.safe_dump(cfg))
    out = quern_cmd("inspect", unpadded, "--step", 0, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert re.fullmatch(
        r"quern: step 0 \(host 0 of 1\), stage 'collate' row \d+ = record \d+ of source 'toks': .*"
        r"arrays of different shapes cannot be stacked.*\n",
        out.stderr,
    ), out.stderr


def test_worker_tracebacks_are_left_out_of_the_message():
    from quern.pipeline.cli import _message

    error = quern.WorkerError(
        "worker 0 (pid 7) could not start: ImportError: no module x\n\n"
        "worker traceback:\nTraceback (most recent call last):\n  ...\nImportError: no module x\n"
    )
    assert _message(error) == "worker 0 (pid 7) could not start: ImportError: no module x"
    assert _message(KeyError("k")) == "KeyError: k"


# --------------------------------------------------------------------------- fn modules beside the config


def test_fn_modules_beside_the_config_or_allowed_in_the_current_directory(config, tmp_path, monkeypatch):
    monkeypatch.delenv("QUERN_ALLOW")
    cfg = yaml.safe_load(config.read_text())
    (tmp_path / "elsewhere").mkdir()
    for folder in [tmp_path, tmp_path / "elsewhere"]:  # beside the config; the current directory
        module = _transforms_module(folder, DOUBLE)
        cfg["batch_transforms"] = [{"fn": f"{module}:double"}]
        (tmp_path / "double.yaml").write_text(yaml.safe_dump(cfg))
        allow = [] if folder == tmp_path else ["--allow", module]  # the current directory is not trusted
        for workers in [0, 1]:  # the console script: neither folder is on sys.path, nor PYTHONPATH set
            out = quern_cmd(
                "run",
                tmp_path / "double.yaml",
                "--steps",
                300,
                "--workers",
                workers,
                *allow,
                script=True,
                cwd=tmp_path / "elsewhere",
                pythonpath=None,
            )
            assert "300 steps, 2,400 records" in out.stdout, (folder, workers, out.stderr)
        if allow:
            args = ("run", tmp_path / "double.yaml", "--steps", 3)
            refused = quern_cmd(*args, check=False, script=True, cwd=tmp_path / "elsewhere", pythonpath=None)
            assert refused.returncode == 2 and f"--allow {module}" in refused.stderr, refused.stderr


# --------------------------------------------------------------------------- each prefix once


@pytest.mark.parametrize("change,fragment", [c[1:] for c in PREFIX_ONCE], ids=[c[0] for c in PREFIX_ONCE])
def test_config_messages_say_each_prefix_once(config, tmp_path, change, fragment):
    write_parquets(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(change(yaml.safe_load(config.read_text()), tmp_path)))
    out = quern_cmd("inspect", bad, "--step", 0, check=False)
    assert out.returncode == 2 and out.stderr.startswith(f"quern: {bad}: "), out.stderr
    assert out.stderr.count(str(bad)) == 1 and fragment in out.stderr and not doubled_prefixes(out.stderr), out.stderr


def test_unparsable_and_missing_configs_name_the_file_once(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for path, what in [(tmp_path / "bad.json", "cannot parse"), (tmp_path / "missing.yaml", "config file not found")]:
        out = quern_cmd("run", path, check=False)
        assert out.returncode == 2 and out.stderr.startswith(f"quern: {path}: {what}"), out.stderr
        assert out.stderr.count(path.name) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_run_step_timeout_names_the_step_and_stage_and_exits_1(config, failing, tmp_path, workers):
    """``quern run --step-timeout``: a transform that never returns ends the run with exit 1 and one
    message naming the step, the stage and the deadline, instead of a hang."""
    path = failing("stuck")
    out = quern_cmd(
        "run", path, "--steps", 3, "--workers", workers, "--step-timeout", 1, check=False, cwd=tmp_path.parent
    )
    assert out.returncode == 1, out.stderr
    message = [line for line in out.stderr.splitlines() if line][-1]
    assert message.startswith("quern: step 0 (host 0 of 1)"), out.stderr
    assert "map[2] stuck" in message and "1 s" in message, message


@pytest.mark.parametrize("value", ["0", "-1", "inf", "x"])
def test_run_step_timeout_must_be_a_positive_number(config, value):
    out = quern_cmd("run", config, "--step-timeout", value, check=False)
    assert out.returncode == 2 and "--step-timeout" in out.stderr, out.stderr


# the fork server the tests' ``python -m quern`` goes through (tests/cli_server.py)
@pytest.mark.parametrize(
    "args",
    [["--version"], ["explain", "CONFIG", "--step", 3, "--json"], ["inspect", "MISSING", "--step", 0], ["run", "BOOM"]],
    ids=["version", "explain", "missing", "failing-step"],
)
def test_the_forked_command_is_the_fresh_one(config, failing, tmp_path, monkeypatch, args):
    """A command forked from the tests' server (its startup imports made once) prints and exits as a fresh
    ``python -m quern``, with the caller's folder, ``PYTHONPATH`` and environment (the failing step's module is
    imported from the folder, its config module from ``PYTHONPATH``)."""
    names = {"CONFIG": config, "MISSING": tmp_path / "missing.yaml", "BOOM": failing("boom")}
    args = [names.get(a, a) if isinstance(a, str) else a for a in args]
    fork = quern_cmd(*args, check=False, cwd=tmp_path)
    monkeypatch.setenv("QUERN_TESTS_CLI", "subprocess")
    fresh = quern_cmd(*args, check=False, cwd=tmp_path)
    assert (fork.returncode, fork.stdout, fork.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fork.returncode == {"version": 0, "explain": 0}.get(args[0], fork.returncode)


def test_a_forked_command_past_its_timeout_is_killed(failing, tmp_path):
    """As ``subprocess.run``: past ``timeout`` the command is killed and :class:`subprocess.TimeoutExpired` raised."""
    import os
    import subprocess
    import time

    from helpers import TESTS, run_quern

    began = time.monotonic()
    env = {**os.environ, "PYTHONPATH": TESTS}
    with pytest.raises(subprocess.TimeoutExpired):
        out = run_quern("run", failing("stuck"), "--steps", 3, cwd=tmp_path.parent, env=env, timeout=3)
        pytest.fail(f"it ended: {out}")
    assert time.monotonic() - began < 30
