"""The README's runnable example and the JAX guide's complete orbax program run as written."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
JAX_GUIDE = ROOT / "docs" / "guides" / "jax.md"


def _block(first_line: str, page: pathlib.Path = JAX_GUIDE) -> str:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"{page.name} has {len(found)} python blocks starting with {first_line!r}"
    return found[0]


def test_the_front_page_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"<!-- runnable -->\n```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no runnable example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


@pytest.mark.slow
def test_the_complete_orbax_example_saves_then_restores_and_resumes(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_block("# save, stop, restart: a complete orbax example"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    runs = [
        subprocess.run(
            [sys.executable, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    saved = re.search(r"saved at step (\d+) (\S+)", runs[0].stdout)
    resumed = re.search(r"resumed at step (\d+) (\S+)", runs[1].stdout)
    assert saved and resumed, (runs[0].stdout, runs[1].stdout)
    assert saved.group(1) == resumed.group(1) == "3"
    # the resumed step adds the mean of batch 3 to the restored weight: the restore carried the value
    import numpy as np

    import quern

    pipe = quern.Pipeline.from_source({"x": np.arange(64, dtype=np.float32)}, seed=0).shuffle().batch(8)
    w = sum(float(pipe.batch_at(s)["x"].mean()) for s in range(3))
    assert abs(float(saved.group(2)) - w) < 1e-3
    assert abs(float(resumed.group(2)) - (w + float(pipe.batch_at(3)["x"].mean()))) < 1e-3
