"""examples/train_torch.py: DDP on 2 CPU processes (gloo, 127.0.0.1) with quern.interop.torch; from its
checkpoint of step 4 (what a run stopped there leaves), it resumes on 2 processes with bit-equal losses and on 1
with the same global batches."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_torch.py")

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _run(tmp_path, ckpt: str, steps: int, world: int) -> str:
    cmd = [sys.executable, SCRIPT, "--data", str(tmp_path / "data"), "--ckpt-dir", str(tmp_path / ckpt)]
    cmd += ["--steps", str(steps), "--ckpt-every", "4", "--world-size", str(world), "--batch", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    _run.last = out.stdout
    return out.stdout


def _steps(text: str) -> dict[int, tuple[str, str]]:
    return {int(s): (loss, h) for s, loss, h in re.findall(r"^step (\d+) loss (\S+) batch (\w+)", text, re.M)}


def test_ddp_stops_and_resumes_on_the_same_and_another_world_size(tmp_path):
    whole = _steps(_run(tmp_path, "whole", 8, 2))
    assert sorted(whole) == list(range(8))
    assert len({loss for loss, _ in whole.values()}) == 8  # real losses that follow the data
    spec = importlib.util.spec_from_file_location("quern_example_train_torch", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pipe = example.make_pipeline(str(tmp_path / "data" / "stdlib"), 8, str(tmp_path / "data" / "quern_cache"))
    for s, (_, h) in whole.items():  # the global batches are quern's, whatever the ranks
        assert h == hashlib.sha256(pipe.batch_at(s)["tokens"].tobytes()).hexdigest()[:16], s
    assert "checkpoint saved at step 4" in _run.last  # the run stopped at step 4 is this one's checkpoint of step 4
    for folder in ("stopped", "stopped1"):
        (tmp_path / folder).mkdir()
        shutil.copyfile(tmp_path / "whole" / "step-4.pt", tmp_path / folder / "latest.pt")
    same = _run(tmp_path, "stopped", 8, 2)
    assert "resumed from checkpoint at step 4 on 2 process(es)" in same
    assert _steps(same) == {s: whole[s] for s in range(4, 8)}  # bit-equal losses and batches
    one = _run(tmp_path, "stopped1", 8, 1)
    assert "resumed from checkpoint at step 4 on 1 process(es)" in one
    assert {s: h for s, (_, h) in _steps(one).items()} == {s: whole[s][1] for s in range(4, 8)}  # the same batches
