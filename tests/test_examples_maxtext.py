"""examples/maxtext_pipeline.py runs end to end: MaxText's pretrain and eval pipelines in quern
(tf.train.Example parsing, BOS/EOS tokenization, flat_map chunking, first-fit packing of inputs
and targets, the shift, a mixture, global arrays, an orbax save and restore, eval padding); its
checks are read back from its output."""

import os
import re
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "maxtext_pipeline.py")


def test_the_maxtext_example_trains_resumes_and_evaluates(tmp_path):
    out = subprocess.run(
        [sys.executable, EXAMPLE, "--out", str(tmp_path), "--docs", "200"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "'inputs': (16, 64)" in text and "'targets_segment_ids': (16, 64)" in text, text
    fill = float(re.search(r"fill of step 0: ([\d.]+)", text).group(1))
    assert fill > 0.9, text
    assert "resumed at step 3: the next 3 batches equal batch_at: True" in text, text
    assert "on 2 hosts the global batches are the same: True" in text, text
    m = re.search(
        r"eval: (\d+) steps of 16 rows; the last has (\d+) real rows, each of 2 hosts gets \[8, 8\] rows", text
    )
    assert m and 1 <= int(m.group(2)) <= 16, text
    m = re.search(r"eval rows through global arrays: (\d+) \(packed rows of the split: (\d+)\)", text)
    assert m and m.group(1) == m.group(2), text
