"""Tests of pipeline/progress.py.

``quern prepare`` draws a progress bar (bytes, rates, ETA) on a terminal, and nothing otherwise."""

import subprocess

import pytest
from helpers import QUERN, on_a_terminal


def _input(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(300):
        (docs / f"{i:04d}.txt").write_bytes(bytes(range(256)) * (i % 17 + 1))
    return docs


def _command(docs, out):
    return [*QUERN, "prepare", str(docs), "--output", str(out), "--workers", "0"]


def test_the_bar_is_drawn_on_a_terminal_with_rates_and_eta(tmp_path):
    docs = _input(tmp_path)
    text = on_a_terminal(_command(docs, tmp_path / "out"))
    assert "quern prepare" in text and "100%" in text, text
    assert "rec/s" in text and "B/s" in text, text  # records/s and bytes/s
    assert "300 records" in text and "<" in text, text  # the count, and tqdm's "elapsed<remaining"


@pytest.mark.parametrize("stream", ["file", "pipe"])
def test_no_bar_when_stderr_is_not_a_terminal(tmp_path, stream):
    docs = _input(tmp_path)
    if stream == "file":
        with open(tmp_path / "err.txt", "wb") as err:
            proc = subprocess.run(_command(docs, tmp_path / "out"), stdout=subprocess.PIPE, stderr=err, timeout=120)
        stderr = (tmp_path / "err.txt").read_bytes()
    else:
        proc = subprocess.run(_command(docs, tmp_path / "out"), capture_output=True, timeout=120)
        stderr = proc.stderr
    assert proc.returncode == 0
    assert stderr == b""
    assert b"prepared 300 records" in proc.stdout
