"""The reliability suite (benchmarks/faults.py), run briefly: every scenario holds in every trial.

The full run, with more trials and the figures, is ``.venv/bin/python benchmarks/faults.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "faults.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import faults  # noqa: E402
import faults_live  # noqa: E402
from redisserver import REDIS_MISSING, redis_binary  # noqa: E402


# Formats without a checksum (faults.KNOWN_LIMITS) cannot hold for every overwritten byte: the
# benchmark reports how often they do; the checksummed formats are held to every trial here.
@pytest.mark.slow
@pytest.mark.parametrize("scenario", [name for name in faults.SCENARIOS if name not in faults.KNOWN_LIMITS])
def test_every_scenario_holds(scenario):
    if scenario in faults_live.SCENARIOS and redis_binary() is None:
        pytest.skip(REDIS_MISSING)  # the live-stream scenarios run against a private redis-server
    out = subprocess.run(
        [sys.executable, SCRIPT, "--trials", "3", "--seed", "1", "--only", scenario],
        capture_output=True,
        text=True,
        timeout=240,
    )
    rows = [line for line in out.stdout.splitlines() if line.startswith(scenario + " ")]
    assert len(rows) == 1, out.stdout + out.stderr[-2000:]
    tried, held = map(int, rows[0][len(scenario) :].split()[:2])
    assert tried == 3 and held == tried, rows[0]
    assert out.returncode == 0
