"""examples/train_lm.py: killed after a checkpoint and restarted, it resumes with exactly
the losses of an uninterrupted run."""

import math
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")

pytestmark = pytest.mark.timeout(600)


def _cmd(tmp_path, ckpt: str, steps: int) -> list[str]:
    return [
        sys.executable,
        SCRIPT,
        "--data",
        str(tmp_path / "data"),
        "--ckpt-dir",
        str(tmp_path / ckpt),
        "--steps",
        str(steps),
        "--ckpt-every",
        "4",
        "--batch",
        "16",
    ]


def _losses(text: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)", text, re.MULTILINE)}


def test_killed_and_resumed_run_has_the_same_losses(tmp_path):
    whole = subprocess.run(_cmd(tmp_path, "whole", 12), capture_output=True, text=True, timeout=300, check=False)
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = _losses(whole.stdout)
    assert sorted(reference) == list(range(12))
    # equal losses below mean equal data only if the losses are real numbers that follow the data
    values = [float(reference[s]) for s in range(12)]
    assert all(math.isfinite(v) for v in values) and len(set(values)) == 12
    assert max(values[-4:]) < values[0] - 1  # it learns: the batches reach the model
    assert re.search(r"data wait: .* ms per step = .*% of step time", whole.stdout)

    proc = subprocess.Popen(_cmd(tmp_path, "killed", 12), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stdout:  # kill it as soon as the step-8 checkpoint is on disk
        seen.append(line)
        if line.startswith("checkpoint saved at step 8"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    first = _losses("".join(seen))
    assert first == {s: reference[s] for s in range(8)}

    resumed = subprocess.run(_cmd(tmp_path, "killed", 12), capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 8" in resumed.stdout
    assert _losses(resumed.stdout) == {s: reference[s] for s in range(8, 12)}
