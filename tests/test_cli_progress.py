"""Tests of pipeline/progress.py.

``quern run`` draws a progress bar (steps, rates) on a terminal, and nothing otherwise."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import QUERN, on_a_terminal, write_shards

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def config(tmp_path):
    """A config of two ArrayRecord shards (600 records) in ``tmp_path``, batches of 8."""
    write_shards(tmp_path, seed=1)
    cfg = {
        "source": {"type": "array_record", "paths": "toks-*.array_record"},  # relative to the config file
        "seed": 5,
        "shuffle": "global",
        "transforms": [{"name": "decode", "kwargs": {"dtype": "uint8"}}, {"name": "pad", "kwargs": {"length": 16}}],
        "batch": {"size": 8},
    }
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def packed(tmp_path):
    """A config packing 200 Parquet documents (1-39 tokens) into rows of 64 tokens, batches of 8."""
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 1000, k).astype(np.int32).tolist() for k in rng.integers(1, 40, 200)]
    pq.write_table(pa.table({"tokens": tokens}), tmp_path / "docs.parquet")
    cfg = {"source": {"type": "parquet", "paths": "docs.parquet"}, "pack": {"seq_len": 64, "key": "tokens"}, "batch": 8}
    path = tmp_path / "packed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _command(config, steps=30):
    return [*QUERN, "run", str(config), "--steps", str(steps)]


def _env(tmp_path):
    """No ``QUERN_ALLOW`` (the configs name no function), and caches under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k != "QUERN_ALLOW"}
    env["QUERN_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def test_the_bar_is_drawn_on_a_terminal_with_steps_and_rates(config, tmp_path):
    text = on_a_terminal(_command(config), _env(tmp_path))
    assert "quern run" in text and "100%" in text and "30/30" in text, text  # the bar, at its end
    assert "step/s" in text and "240 records" in text and "records/s" in text, text  # steps/s, records and their rate
    assert "30 steps, 240 records in " in text, text  # the summary, after the bar's line
    bar = text.rindex("30/30")
    assert text.index("\n", bar) < text.index("30 steps, 240 records in "), text


def test_a_packed_pipelines_bar_counts_rows(packed, tmp_path):
    text = on_a_terminal(_command(packed, steps=3), _env(tmp_path))
    assert "quern run" in text and "100%" in text and "3/3" in text, text
    assert "24 rows" in text and "rows/s" in text and "records/s" not in text, text
    assert "3 steps, 24 rows in " in text, text


@pytest.mark.parametrize("stream", ["file", "pipe"])
def test_no_bar_when_stderr_is_not_a_terminal(config, tmp_path, stream):
    env = _env(tmp_path)
    if stream == "file":
        with open(tmp_path / "err.txt", "wb") as err:
            proc = subprocess.run(_command(config), stdout=subprocess.PIPE, stderr=err, timeout=120, env=env)
        stderr = (tmp_path / "err.txt").read_bytes()
    else:
        proc = subprocess.run(_command(config), capture_output=True, timeout=120, env=env)
        stderr = proc.stderr
    assert proc.returncode == 0, stderr
    assert stderr == b""
    assert proc.stdout.startswith(b"30 steps, 240 records in ") and b"records/s" in proc.stdout, proc.stdout
    assert b"next step 30" in proc.stdout


def test_an_error_comes_after_the_bar_on_its_own_line(config, tmp_path):
    """A failing step on a terminal: the bar's line is ended before the one ``quern: ...`` message."""
    (tmp_path / "boom.py").write_text(
        "def boom(batch):\n    raise ValueError('kaboom')\n"  # a module in the config's folder: allowed
    )
    cfg = yaml.safe_load(config.read_text())
    cfg["batch_transforms"] = [{"fn": "boom:boom"}]
    config.write_text(yaml.safe_dump(cfg))
    text = on_a_terminal(_command(config), _env(tmp_path), status=1)
    assert "Traceback" not in text, text
    lines = text.replace("\r\n", "\n").split("\n")
    message = [line for line in lines if "quern: step " in line]
    assert len(message) == 1 and message[0].startswith("quern: step "), text  # a line of its own
    assert "kaboom" in message[0], text
