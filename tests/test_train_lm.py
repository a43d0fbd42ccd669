"""examples/train_lm.py: killed after a checkpoint and restarted, it resumes with exactly
the losses of an uninterrupted run; on packed rows its attention and loss stay inside each
document."""

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
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


def _env(tmp_path) -> dict[str, str]:
    """The three runs share JAX's compilation cache: the step is compiled once, saving about 3 s of CPU a later run."""
    return dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _losses(text: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)", text, re.MULTILINE)}


def _load_example():
    spec = importlib.util.spec_from_file_location("quern_example_train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_attention_and_loss_stay_inside_each_document():
    import jax
    import jax.numpy as jnp

    lm = _load_example()
    params, _ = jax.jit(lm.init_state)(jax.random.key(0))
    rng = np.random.default_rng(0)
    n = lm.CONTEXT
    # one packed row: document A (50 tokens), document B (60 tokens), padding
    seg = np.array([[1] * 50 + [2] * 60 + [0] * (n - 110)], np.int32)
    pos = np.array([list(range(50)) + list(range(60)) + [0] * (n - 110)], np.int32)
    tok = rng.integers(1, 256, (1, n)).astype(np.int32)
    tok[0, 110:] = 0

    apply = jax.jit(lm.MODEL.apply)

    def logits(t, s=seg, p=pos):
        return np.asarray(apply(params, jnp.asarray(t), jnp.asarray(s), jnp.asarray(p)))

    packed = logits(tok)
    other = tok.copy()
    other[0, :50] = rng.integers(1, 256, 50)  # another document A, other padding
    other[0, 110:] = 7
    changed = logits(other)
    np.testing.assert_array_equal(changed[0, 50:110], packed[0, 50:110])  # B sees neither A nor the padding
    assert np.abs(changed[0, :50] - packed[0, :50]).max() > 0.1  # A's own tokens do count
    later = tok.copy()
    later[0, 80] = tok[0, 80] % 255 + 1
    np.testing.assert_array_equal(logits(later)[0, :80], packed[0, :80])  # causal
    alone_tok = np.zeros((1, n), np.int32)
    alone_tok[0, :60] = tok[0, 50:110]
    alone_seg = np.array([[1] * 60 + [0] * (n - 60)], np.int32)
    alone_pos = np.array([list(range(60)) + [0] * (n - 60)], np.int32)
    alone = logits(alone_tok, alone_seg, alone_pos)
    np.testing.assert_allclose(alone[0, :60], packed[0, 50:110], atol=1e-4)  # B packed == B alone

    # the loss counts the targets that continue their document: 49 of A, 59 of B
    row = np.concatenate([tok, tok[:, :1]], axis=1)
    batch = {
        "tokens": row.astype(np.uint8),
        "segment_ids": np.concatenate([seg, np.zeros((1, 1), np.int32)], axis=1),
        "positions": np.concatenate([pos, np.zeros((1, 1), np.int32)], axis=1),
    }
    loss, count = jax.jit(lm.loss_fn)(params, batch)
    assert int(count) == 49 + 59 and np.isfinite(float(loss))


@pytest.mark.slow
def test_killed_and_resumed_run_has_the_same_losses(tmp_path):
    env = _env(tmp_path)
    whole = subprocess.run(_cmd(tmp_path, "whole", 12), capture_output=True, text=True, timeout=300, env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = _losses(whole.stdout)
    assert sorted(reference) == list(range(12))
    # equal losses below mean equal data only if the losses are real numbers that follow the data
    values = [float(reference[s]) for s in range(12)]
    assert all(math.isfinite(v) for v in values) and len(set(values)) == 12
    assert max(values[-4:]) < values[0] - 1  # it learns: the batches reach the model
    # every 10 steps, the iterator's own figures (10 steps of 12: one line), and a summary
    lines = re.findall(
        r"^data: wait (\S+) ms/step, period (\S+) ms, bubble rate (\S+)%, health (\w+)", whole.stdout, re.M
    )
    assert len(lines) == 1, whole.stdout
    wait, period, bubble, health = lines[0]
    assert 0 <= float(wait) <= float(period) and 0 <= float(bubble) <= 100
    assert health in ("healthy", "warning", "alarm")
    assert re.search(r"^data wait over the run: \S+ ms per step, bubble rate \S+%", whole.stdout, re.M)
    # packed rows: each row's first token of every document and its padding are no target
    counts = [int(c) for c in re.findall(r"^step \d+ loss \S+ tokens (\d+)", whole.stdout, re.MULTILINE)]
    assert len(counts) == 12 and all(0 < c < 16 * 128 for c in counts)

    proc = subprocess.Popen(
        _cmd(tmp_path, "killed", 12), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
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

    resumed = subprocess.run(_cmd(tmp_path, "killed", 12), capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 8" in resumed.stdout
    assert _losses(resumed.stdout) == {s: reference[s] for s in range(8, 12)}
