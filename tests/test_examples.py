"""The examples run end to end on data they make themselves; their outputs are checked
here against batches recomputed by this test, and against the files read without quern."""

import glob
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pyarrow.parquet as pq
from helpers import read_array_records

import quern

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_and_resumes_exactly(tmp_path):
    data, saved = tmp_path / "data", tmp_path / "resumed.npz"
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "quickstart.py"),
            "--out",
            str(data),
            "--steps",
            "60",
            "--stop-at",
            "20",
            "--save",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    folder, pq_paths = data / "stdlib", sorted(data.glob("*.parquet"))
    ar_paths = sorted(folder.glob("*.array_record"))
    assert len(pq_paths) == 4 and len(ar_paths) > 1  # prepared into shards of about 1 MB
    assert sorted(p.name for p in data.iterdir()) == sorted([p.name for p in pq_paths] + ["state.json", "stdlib"])
    manifest = json.loads((folder / "manifest.json").read_text())  # written by quern prepare, shards in order
    assert [s["file"] for s in manifest["shards"]] == [p.name for p in ar_paths]

    # the quickstart's pipeline, defined again here: shuffled stdlib chunks padded to 512, batches of 64
    pipe = (
        quern.Pipeline.from_source(quern.sources.ArrayRecordSource(str(folder)), seed=2026)
        .shuffle()
        .map(quern.transforms.decode(np.uint8))
        .map(quern.transforms.pad(512))
        .batch(64)
    )
    state = json.loads((data / "state.json").read_text())
    assert (state["step"], state["fingerprint"]) == (20, pipe.fingerprint())  # the same definition, stopped at 20
    assert state == pipe.state_at(20)

    with np.load(saved) as z:
        steps, tokens, lengths = z["steps"].tolist(), z["batch.tokens"], z["batch.length"]
    assert steps == [20, 21, 22, 23, 24] and tokens.shape == (5, 64, 512) and tokens.dtype == np.uint8
    records = read_array_records(ar_paths)
    # prepare's record order: the stdlib's top-level .py files by name, each cut in order into <= 512 bytes
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    assert b"".join(records) == b"".join(open(p, "rb").read() for p in files)
    assert max(len(r) for r in records) <= 512 and manifest["records"]["count"] == len(records)
    parquet = [
        np.asarray(t, np.uint8) for p in pq_paths for t in pq.read_table(p, columns=["tokens"])["tokens"].to_pylist()
    ]
    assert len(records) == len(parquet) == len(pipe.source)
    for k, step in enumerate(steps):
        want = pipe.batch_at(step)  # the resumed run (2 worker processes) gave exactly these batches
        np.testing.assert_array_equal(tokens[k], want["tokens"], err_msg=f"step {step}")
        np.testing.assert_array_equal(lengths[k], want["length"], err_msg=f"step {step}")
        # and each row is the record explain() names: its bytes, cut or zero-padded to 512
        for row, ((_, rid),) in enumerate(pipe.explain(step)):
            raw = np.frombuffer(records[rid], np.uint8)
            n = min(len(raw), 512)
            assert lengths[k, row] == n and 0 < n
            assert tokens[k, row, :n].tobytes() == raw[:n].tobytes() and not tokens[k, row, n:].any()
            assert parquet[rid].tobytes() == raw.tobytes()  # the Parquet copy holds the same record
    assert len({tuple(r[0][1] for r in pipe.explain(s)) for s in steps}) == 5  # five different batches
