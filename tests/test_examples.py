"""The examples run end to end on data they make themselves."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_and_resumes_exactly(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--out", str(tmp_path), "--steps", "60",
         "--stop-at", "20"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "with 2 worker processes: next 5 batches identical to the uninterrupted run: True" in out.stdout
    assert "Parquet copy agrees with ArrayRecord on the 64 records of step 20: True" in out.stdout
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.suffix != ".json") == [".array_record"] * 4 + [".parquet"] * 4
