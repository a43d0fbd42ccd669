"""examples/mixture.py runs end to end: a scheduled mixture of the standard library's
modules and tests, resumed across its switch with an edited future; its checks and
the drawn proportions are read back from its output."""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "mixture.py")


def _share(text, label):
    m = re.search(
        rf"{label} the switch \(steps \d+-\d+\): modules share ([\d.]+) \(weight [\d.]+\), "
        rf"tests share ([\d.]+) \(weight [\d.]+\)",
        text,
    )
    assert m, f"no {label!r} line in:\n{text}"
    return float(m.group(1)), float(m.group(2))


def test_mixture_example_resumes_across_the_switch(tmp_path):
    out = subprocess.run(
        [sys.executable, EXAMPLE, "--out", str(tmp_path), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "resumed batches 150..259 equal the edited pipeline's batch_at: True" in text
    assert "resumed batches 150..259 equal the original pipeline's batch_at: True" in text
    assert re.search(r"the \d+ rows of steps .* hold the files explain\(\) names: True", text), text
    assert "a schedule edited before step 150 is refused" in text
    assert "mixture example OK" in text

    modules_before, tests_before = _share(text, "before")
    modules_after, tests_after = _share(text, "after")
    assert abs(tests_before - 0.1) < 0.03 and abs(modules_before + tests_before - 1) < 1e-3
    assert abs(tests_after - 0.5) < 0.05 and abs(modules_after + tests_after - 1) < 1e-3

    # the saved state belongs to the example's original pipeline, rebuilt here from its own code
    spec = importlib.util.spec_from_file_location("_example_mixture", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    pipe, _ = example.make_pipeline(
        argparse.Namespace(out=str(tmp_path), min_lines=50), [(0, example.STAGE0), (example.SWITCH, example.STAGE1)]
    )
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["step"] == 150 and state["fingerprint"] == pipe.fingerprint()
    assert list((tmp_path / "cache" / "filters").glob("*.survivors")), "the filter's survivors were not cached"
