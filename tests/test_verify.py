"""Tests of pipeline/verify.py (``quern.verify``) and ``quern verify`` (issue 24, point 3; issue 36, points 7, 9).

The step digests agree across 1/2/4 hosts, 0/2 workers and resumes (a ``balance_hosts``
pipeline within the same host count); a change the fingerprint cannot see (a helper a transform
reaches through a module attribute, edited on disk) makes ``quern verify CONFIG --ledger`` in a
fresh process exit 1 naming the step, row, record and leaf; two runs' ledgers are compared
without the data. A ledger line at an absurd step (``2**63``, ``-1``, ``1e30``, ``"3"``, past
the addressable stream) is a bad line named by file and line, found in small memory; a ledger of
another pipeline is refused (exit 2) whatever the config's edits and wherever its lines are. The
command runs as a subprocess, on the quern this test imports.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers import quern_cmd, unique_name, write_shards

import quern
import quern.verify

pytestmark = pytest.mark.timeout(300)

QUERN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(quern.__file__)))
"""The folder holding the quern this test imports: the commands run on it too."""


def _mixed(n, seed):
    src = {"x": np.arange(n * 3, dtype=np.int64).reshape(n, 3) + 100 * seed, "y": np.arange(n) * 0.5}
    return quern.Pipeline.from_source(src, seed=seed).shuffle()


def _mixture():
    return quern.mix({"a": _mixed(40, 1), "b": _mixed(25, 2)}, weights={"a": 0.6, "b": 0.4}, seed=2).batch(8)


def test_the_step_digests_agree_across_hosts_workers_and_resumes():
    result = quern.verify.compare_topologies(_mixture(), range(2, 8), hosts=[1, 2, 4], workers=[0, 2], resume_at=[5])
    assert result.ok and result.first is None and result.differences == [], result.lines()
    assert len(result.summary_lines) == 1 + 3 * 2 * 2
    digests = {line.rsplit("digest ", 1)[1] for line in result.summary_lines if "resumed" not in line}
    assert len(digests) == 1  # every topology's steps 2..7 hash to the reference's
    assert "hosts 4, workers 2, resumed at 5: 3 step(s) (5..7) agree with the reference" in "\n".join(result.lines())


def test_a_balanced_pipeline_is_compared_within_the_same_host_count():
    src = {"x": np.arange(400).reshape(100, 4)}
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle().balance_hosts(lengths=np.arange(100) % 17).batch(8)
    joined = [d for h in range(2) for d in pipe.row_digests(1, h, 2)]
    assert joined != pipe.row_digests(1) and sorted(joined) == sorted(pipe.row_digests(1))  # by design
    result = quern.verify.compare_topologies(pipe, 4, hosts=[1, 2], workers=[0])
    assert result.ok, result.lines()
    assert result.notes == [
        "hosts 2: a batch's rows are ordered by the host count (balance_hosts, by design): compared with "
        "batch_at over 2 hosts, not with 1 host"
    ]
    assert "(batch_at, 2 hosts)" in result.summary_lines[2]


def _in_worker(batch, parent):
    """Row 1 of a batch made in another process than ``parent`` is changed: a topology-dependent bug."""
    if os.getpid() != parent:
        batch = {**batch, "y": batch["y"].copy()}
        batch["y"][1] += 1
    return batch


def test_a_difference_under_workers_names_the_topology_step_row_records_and_leaf():
    pipe = _mixture().map_batch(functools.partial(_in_worker, parent=os.getpid()))
    result = quern.verify.compare_topologies(pipe, range(3, 6), hosts=[1, 2], workers=[0, 2])
    assert not result.ok
    assert [d.topology for d in result.differences] == ["hosts 1, workers 2", "hosts 2, workers 2"]
    first = result.first
    assert (first.kind, first.step, first.process_index, first.process_count, first.row, first.leaf) == (
        "digest",
        3,
        0,
        1,
        1,
        "batch['y']",
    )
    assert first.records == pipe.explain(3)[1]
    second = result.differences[1]  # 2 hosts: row 1 of each host's slice, the first in host 0's
    assert (second.process_index, second.row, second.records) == (0, 1, pipe.explain(3, 0, 2)[1])
    text = "\n".join(result.lines())
    assert "hosts 1, workers 0: 3 step(s) (3..5) agree" in text
    assert "hosts 1, workers 2: 3 of 3 step(s) differ from the reference (batch_at, 1 host), the first 3" in text
    assert f"records: {first.records[0][0]}[{first.records[0][1]}]" in text and "leaf: batch['y']" in text


def test_bad_steps_hosts_and_resumes_are_refused():
    pipe = _mixture()
    with pytest.raises(ValueError, match=r"resume_at \[9\]: a resume step must be one of the steps checked"):
        quern.verify.compare_topologies(pipe, 4, resume_at=[9])
    with pytest.raises(ValueError, match="not divisible by the host count"):
        quern.verify.compare_topologies(pipe, 2, hosts=[3], workers=[0])
    finite = quern.Pipeline.from_source({"x": np.arange(20)}, seed=0, num_epochs=1).batch(4)
    with pytest.raises(IndexError, match="past the end"):
        quern.verify.compare_topologies(finite, range(3, 9))


# --------------------------------------------------------------------------- the command


HELPER = "import numpy as np\n\n\ndef scale(record):\n    return record\n"
TRANSFORM = "import {helper}\n\n\ndef touch(record):\n    return {helper}.scale(record)\n"


@pytest.fixture
def run_config(tmp_path):
    """A config whose record transform calls ``helper.scale`` (a module attribute: not in the fingerprint).

    The helper module's name is ``run_config.helper`` (``tmp_path / f"{helper}.py"``); both modules have
    names no other test uses (modules are global to a process).
    """
    write_shards(tmp_path, seed=3)
    helper, tfm = unique_name("helpers_mod"), unique_name("tfm_mod")
    (tmp_path / f"{helper}.py").write_text(HELPER)
    (tmp_path / f"{tfm}.py").write_text(TRANSFORM.format(helper=helper))
    cfg = {
        "source": {"type": "array_record", "paths": "toks-*.array_record"},
        "seed": 5,
        "shuffle": "global",
        "transforms": [
            {"name": "decode", "kwargs": {"dtype": "uint8"}},
            {"name": "pad", "kwargs": {"length": 16}},
            {"fn": f"{tfm}:touch"},
        ],
        "batch": {"size": 8},
    }
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "helper.txt").write_text(helper)
    return path


def _quern(*args, cwd, check=True):
    """``quern ARGS`` in ``cwd``, importing modules there (workers import helpers_mod) and this test's quern."""
    return quern_cmd(*args, cwd=cwd, pythonpath=os.pathsep.join([str(cwd), QUERN_ROOT]), check=check)


def _verify(*args, cwd, check=True):
    out = _quern("verify", *args, cwd=cwd, check=False)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_quern_verify_passes_across_topologies_and_resumes(run_config, tmp_path):
    out = _verify(
        run_config, "--steps", "1:5", "--hosts", "1,2,4", "--workers", "0,2", "--resume-at", "3", cwd=tmp_path
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 13 and lines[0].startswith("reference (batch_at, 1 host): 4 step(s) (1..4), digest ")
    assert all(" agree with the reference " in line for line in lines[1:]), out.stdout
    assert len({line.rsplit(" ", 1)[1] for line in lines if "resumed" not in line}) == 1


def test_quern_verify_finds_a_change_the_fingerprint_cannot_see(run_config, tmp_path):
    cwd = tmp_path
    run = _quern("run", run_config, "--steps", 6, "--ledger", tmp_path / "a.jsonl", cwd=cwd)
    assert "6 steps" in run.stdout
    assert _verify(run_config, "--ledger", tmp_path / "a.jsonl", cwd=cwd).stdout.startswith(
        f"ledger {tmp_path / 'a.jsonl'}: 6 step(s) (0..5) logged by 1 host(s), every host slice agrees"
    )
    pipe = quern.load_config(run_config)  # the record at step 2, row 3 is the one the edited helper changes
    record = pipe.explain(2)[3][0][1]
    target = pipe.batch_at(2)["tokens"][3]
    edited = (
        "import numpy as np\n\nTARGET = bytes(" + repr(list(target.tobytes())) + ")\n\n\n"
        "def scale(record):\n"
        "    if record['tokens'].tobytes() == TARGET:\n"
        "        return {**record, 'tokens': record['tokens'] + np.uint8(1)}\n"
        "    return record\n"
    )
    (tmp_path / f"{(tmp_path / 'helper.txt').read_text()}.py").write_text(edited)  # the fingerprint cannot see it
    out = _verify(run_config, "--ledger", tmp_path / "a.jsonl", cwd=cwd, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "1 step(s) do not check" in text
    assert re.search(r"first difference: step 2, row 3 \(.*a\.jsonl:3\) differs from its recomputation", text), text
    assert "  at step 2, host 0 of 1, row 3" in text
    assert f"  records: toks[{record}]" in text and "  leaf: batch['tokens']" in text
    # a second run with the edited helper, on 2 workers, compared with the first without the data
    _quern("run", run_config, "--steps", 6, "--workers", 2, "--ledger", tmp_path / "b.jsonl", cwd=cwd)
    same = _verify("--compare", tmp_path / "a.jsonl", tmp_path / "a.jsonl", cwd=cwd)
    assert same.stdout.splitlines()[-1] == "compared 6 step(s) (0..5): they agree"
    diff = _verify("--compare", tmp_path / "a.jsonl", tmp_path / "b.jsonl", cwd=cwd, check=False)
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert "compared 6 step(s) (0..5): 1 step(s) differ or do not check" in diff.stdout
    assert "first difference: step 2, row 3 (" in diff.stdout and "differs from run B (" in diff.stdout
    assert "records:" not in diff.stdout  # without the data
    named = _verify(run_config, "--compare", tmp_path / "a.jsonl", tmp_path / "b.jsonl", cwd=cwd, check=False)
    assert named.returncode == 1 and f"  records: toks[{record}]" in named.stdout


def test_quern_verify_reports_gaps_and_refuses_bad_input(run_config, tmp_path):
    cwd = tmp_path
    _quern("run", run_config, "--steps", 5, "--ledger", tmp_path / "a.jsonl", cwd=cwd)
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "gap.jsonl").write_text("".join(lines[:2] + lines[3:]))
    out = _verify(run_config, "--ledger", tmp_path / "gap.jsonl", cwd=cwd, check=False)
    assert out.returncode == 1 and "first difference: step 2 is missing from the ledger" in out.stdout, out.stdout
    other = tmp_path / "other.yaml"
    other.write_text(run_config.read_text().replace("seed: 5", "seed: 6"))
    refused = _verify(other, "--ledger", tmp_path / "a.jsonl", cwd=cwd, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert re.search(
        r"a\.jsonl:1: step 0 was logged by another pipeline: the line's fingerprint \w+, this pipe", refused.stderr
    )
    for args in (["--ledger", tmp_path / "nope.jsonl"], ["--steps", "5:2"], ["--hosts", "0"], []):
        bad = _verify(*([run_config] if args else []), *args, cwd=cwd, check=False)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
    both = _verify(run_config, "--ledger", tmp_path / "a.jsonl", "--hosts", "2", cwd=cwd, check=False)
    assert both.returncode == 2 and "--hosts and --resume-at do not apply" in both.stderr
    result = json.loads(lines[0])
    assert set(result) >= {"step", "fingerprint", "rows", "row_digests", "leaf_digests"}


# --------------------------------------------------------------------------- absurd steps, foreign ledgers (issue 36)

LIMITED = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
sys.argv[0] = "quern"
runpy.run_module("quern", run_name="__main__", alter_sys=True)
"""
"""``python -m quern`` in at most 2 GiB of address space: a command that materialises a huge range fails."""


def _verify_small(*args, cwd):
    """``quern verify ARGS`` in 2 GiB of address space (:data:`LIMITED`), within 60 s; not checked."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), QUERN_ROOT])}
    command = [sys.executable, "-c", LIMITED, "verify", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False)


def _run(config, ledger, cwd, steps=6):
    _quern("run", config, "--steps", steps, "--ledger", ledger, cwd=cwd)
    return ledger.read_text().splitlines(keepends=True)


@pytest.mark.parametrize(
    "step, shown",
    [
        (2**63, str(2**63)),  # past int64
        (2**62, str(2**62)),  # past any pipeline's steps (positions stay below 2**62)
        (2**61, str(2**61)),  # past this pipeline's addressable steps (batch 8)
        (-1, "-1"),
        (1e30, "1e+30"),
        ("3", "'3'"),
    ],
    ids=["2**63", "2**62", "2**61", "-1", "1e30", "str"],
)
def test_quern_verify_names_a_line_with_an_absurd_step_in_small_memory(run_config, tmp_path, step, shown):
    lines = _run(run_config, tmp_path / "a.jsonl", tmp_path)
    doc = json.loads(lines[3])
    doc["step"] = step
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:3] + [json.dumps(doc) + "\n"] + lines[4:]))
    out = _verify_small(run_config, "--ledger", bad, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr  # a ledger that does not check: a bad line
    first = next((line for line in out.stdout.splitlines() if line.startswith("first difference: ")), "")
    assert first.startswith(f"first difference: {bad}:4: step {shown} is not a step"), out.stdout
    assert "5 step(s) (0..2, 4..5) logged by 1 host(s), 1 step(s) do not check" in out.stdout  # the others checked
    assert out.stdout.endswith("2 differences in all\n")  # the bad line, and step 3 missing


def test_quern_verify_refuses_a_foreign_ledger_whatever_the_edits(run_config, tmp_path):
    own = _run(run_config, tmp_path / "a.jsonl", tmp_path)
    mine = json.loads(own[0])["fingerprint"]
    cfg = yaml.safe_load(run_config.read_text())
    edited = tmp_path / "edited.yaml"  # this pipeline, with an edit from step 0
    edited.write_text(yaml.safe_dump({**cfg, "skip": [{"start": 0, "stop": 1}]}))
    other = tmp_path / "other.yaml"  # another pipeline (another seed), with the same edit
    other.write_text(yaml.safe_dump({**cfg, "seed": 6, "skip": [{"start": 0, "stop": 1}]}))
    theirs = quern.load_config(other).fingerprint_at(0)
    refused = _verify(other, "--ledger", tmp_path / "a.jsonl", cwd=tmp_path, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"a.jsonl:1: step 0 was logged by another pipeline: the line's fingerprint {mine}" in refused.stderr
    assert f"this pipeline's {theirs} (for step 0)" in refused.stderr
    # this pipeline's own run before the edit: nothing to check, said plainly (not "by  host(s)")
    before = _verify(edited, "--ledger", tmp_path / "a.jsonl", cwd=tmp_path, check=False)
    assert before.returncode == 1, before.stdout + before.stderr
    assert before.stdout.splitlines()[0] == (
        f"ledger {tmp_path / 'a.jsonl'}: no step checked of the 6 step(s) (0..5) logged by 1 host(s)"
    )
    assert "6 step(s) (0..5) were logged before this pipeline's edits" in before.stdout
    assert "by  host" not in before.stdout


@pytest.mark.parametrize("where", ["first", "last"])
def test_quern_verify_refuses_a_foreign_duplicate_line_wherever_it_is(run_config, tmp_path, where):
    own = _run(run_config, tmp_path / "a.jsonl", tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(run_config.read_text().replace("seed: 5", "seed: 6"))
    foreign = _run(other, tmp_path / "b.jsonl", tmp_path)[2]  # step 2 of another pipeline's run
    lines = [foreign, *own] if where == "first" else [*own, foreign]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(lines))
    at = 1 if where == "first" else len(lines)
    out = _verify(run_config, "--ledger", mixed, cwd=tmp_path, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    mine, theirs = json.loads(own[2])["fingerprint"], json.loads(foreign)["fingerprint"]
    assert (
        f"mixed.jsonl:{at}: step 2 was logged by another pipeline: the line's fingerprint {theirs}, "
        f"this pipeline's {mine} (for step 2)"
    ) in out.stderr
