"""Tests of pipeline/samedef.py.

Fresh processes (scan processes, the fork server and its workers, a task shipped
with a definition) refuse to compute when the definition they load is not the
parent's: a module global changed at run time is seen there with its value at
import, and would silently give other data under the parent's fingerprint."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import uuid

import numpy as np
import pytest
from helpers import spy_scan_processes, write_array_record

import quern
from quern import ScanError, WorkerError
from quern.pipeline.core.errors import FingerprintError
from quern.pipeline.definition import scan

MODULE = """
THR = 0
FIXED = 7
SCALE = {"b": 0.1, "a": [1.5, 2.25]}


def keep(rec):
    return int(rec["x"]) >= THR


def shift(rec):
    return {"x": rec["x"] + THR}


def add_fixed(rec):
    return {"x": rec["x"] + FIXED + int(SCALE["a"][0] * 2)}


def tag(rec):
    return {**rec, "tag": tag.value}


tag.value = 1
"""


@pytest.fixture
def mycfg(tmp_path):
    """An importable module (in ``tmp_path``, on ``sys.path``), as a user's config module:
    fresh processes import it again, by name."""
    name = f"mycfg_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(tmp_path))


def _survivor_files(folder):
    return sorted(p for p in folder.rglob("*.survivors")) if folder.exists() else []


# --------------------------------------------------------------------------- scans


def test_a_scan_process_refuses_a_global_changed_at_run_time(mycfg, tmp_path, monkeypatch):
    monkeypatch.setattr(scan, "PROCESS_MIN", 1000)
    src = {"x": np.arange(3000)}
    mycfg.THR = 1500
    cache = tmp_path / "cache"
    with pytest.raises(
        ScanError, match=rf"filter\[0\] keep: global `{mycfg.__name__}\.THR` is 0 here and 1500 in the parent"
    ):
        quern.Pipeline.from_source(src).filter(mycfg.keep, cache_dir=cache, num_workers=2)
    assert _survivor_files(cache) == []  # nothing cached
    with pytest.raises(ScanError, match=r"pass it as an argument .* or set it at import"):
        quern.Pipeline.from_source(src).filter(mycfg.keep, cache_dir=cache, num_workers=2)
    here = quern.Pipeline.from_source(src).filter(mycfg.keep, cache_dir=cache, num_workers=1)  # in this process
    np.testing.assert_array_equal(here.survivors, np.arange(1500, 3000))


def test_a_global_set_at_import_scans_in_processes(mycfg, tmp_path, monkeypatch):
    spawned = spy_scan_processes(monkeypatch)
    pipe = quern.Pipeline.from_source({"x": np.arange(3000)}).map(mycfg.add_fixed)
    kept = pipe.filter(lambda rec: int(rec["x"]) % 3 == 0, cache_dir=tmp_path, num_workers=2)
    assert spawned == [2]
    ids = np.arange(3000)
    np.testing.assert_array_equal(kept.survivors, ids[(ids + 10) % 3 == 0])


def test_a_length_scan_process_refuses_a_global_changed_at_run_time(mycfg, tmp_path, monkeypatch):
    monkeypatch.setattr(scan, "PROCESS_MIN", 100)
    pipe = quern.Pipeline.from_source({"x": np.arange(300)}).map(mycfg.tag)
    pipe = pipe.map(lambda rec: np.ones(int(rec["x"]) % 5 + rec["tag"]))
    mycfg.tag.value = 2  # a function attribute set at run time
    what = (
        rf"length scan process .*map\[0\] tag: attribute `{mycfg.__name__}\.tag\.value` is 1 here and 2 in the parent"
    )
    with pytest.raises(ScanError, match=what):
        pipe.length_index(cache_dir=tmp_path, num_workers=2)
    assert not list(tmp_path.rglob("*.lengths"))


# --------------------------------------------------------------------------- workers


def test_workers_refuse_a_global_changed_at_run_time(mycfg):
    pipe = quern.Pipeline.from_source({"x": np.arange(64)}).map(mycfg.shift).batch(8)
    mycfg.THR = 100
    with pipe.iterator(num_workers=0) as it:
        np.testing.assert_array_equal(next(it)["x"], np.arange(8) + 100)
    with pipe.iterator(num_workers=2) as it:
        with pytest.raises(
            WorkerError, match=rf"map\[0\] shift: global `{mycfg.__name__}\.THR` is 0 here and 100 in the parent"
        ):
            next(it)


def test_workers_run_a_global_set_at_import(mycfg):
    pipe = (
        quern.Pipeline.from_source({"x": np.arange(64)}, seed=1).shuffle().map(mycfg.add_fixed).map(mycfg.tag).batch(8)
    )
    with pipe.iterator(num_workers=2) as it:
        for s in range(8):
            got, want = next(it), pipe.batch_at(s)
            np.testing.assert_array_equal(got["x"], want["x"])
            np.testing.assert_array_equal(got["tag"], want["tag"])
        assert it.stats()["computed_in_parent"] == 0


def test_a_global_changed_after_filter_does_not_stop_workers(mycfg, tmp_path):
    """The survivors travel with the pipeline: the predicate runs nowhere else, and its
    description is the one it had when filter() ran (no false refusal)."""
    mycfg.THR = 40
    pipe = quern.Pipeline.from_source({"x": np.arange(64)}).filter(mycfg.keep, cache_dir=tmp_path).batch(8)
    mycfg.THR = 0
    with pipe.iterator(num_workers=2) as it:
        got = np.concatenate([next(it)["x"] for _ in range(3)])
    np.testing.assert_array_equal(np.sort(got), np.arange(40, 64))


# --------------------------------------------------------------------------- no false refusal from pickling

SCRIPT = """
import functools, sys
import numpy as np
import quern
from quern.pipeline.definition import scan
from array_record.python import array_record_module

scan.PROCESS_MIN = 200
THR = 0
TABLE = {"z": 0.30000000000000004, "a": float("nan"), "m": [1e-300, -0.0], "k": {3, 1, 2}}


class Scale:
    def __init__(self, k):
        self.k = k
        self.table = dict(reversed(list(TABLE.items())))

    def __call__(self, rec):
        return {**rec, "y": rec["y"] * self.k + TABLE["z"]}


def clip(rec, lo=0.5, *, hi=2.5):
    return {**rec, "y": np.clip(rec["y"], lo, hi)}


def decode(rec):
    return {"x": np.frombuffer(rec, dtype=np.int32).astype(np.int64), "y": np.float64(len(rec))}


def check(pipe, steps):
    with pipe.iterator(num_workers=2) as it:
        for s in range(steps):
            got, want = next(it), pipe.batch_at(s)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        assert it.stats()["computed_in_parent"] == 0


THR = 3  # changed at run time: this script's functions travel by value, so the workers see it
offset = 0.25
arrays = {"x": np.arange(2000), "y": np.linspace(0, 1, 2000)}
pipe = (
    quern.Pipeline.from_source(arrays, seed=4).shuffle()
    .filter(lambda rec: int(rec["x"]) % THR == 0, num_workers=2)  # scanned in processes
    .map(Scale(1.5)).map(lambda rec: {**rec, "y": rec["y"] + offset}).map(functools.partial(clip, lo=0.25))
    .batch(10).map_batch(lambda b: {**b, "s": b["y"].sum(axis=0, keepdims=True) * TABLE["m"][0]})
)
check(pipe, 20)

path = sys.argv[1]
w = array_record_module.ArrayRecordWriter(path, "group_size:1")
for i in range(300):
    w.write(np.arange(i % 7 + 1, dtype=np.int32).tobytes())
w.close()
records = quern.Pipeline.from_source(quern.sources.ArrayRecordSource([path]), seed=2).shuffle().map(decode)
check(records.map(quern.transforms.pad(8, key="x")).map(clip).batch(6), 10)
lengths = records.length_index(key="x", num_workers=2)
check(records.pack(16, key="x", lengths=lengths).batch(4), 10)
padded = records.map(quern.transforms.pad(8, key="x"))
check(quern.mix({"a": padded, "b": padded.map(clip)}, [0.25, 0.75], seed=1).batch(4), 10)
print("ok")
"""


def test_no_false_refusal_for_code_of_the_main_script_and_sources(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "r.array_record")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


# --------------------------------------------------------------------------- the function for other tasks

CHILD = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
import importlib
from quern.pipeline.identity import samedef
from quern.pipeline.core.errors import FingerprintError
mod = importlib.import_module(sys.argv[2])
expected = pickle.loads(sys.stdin.buffer.read())
try:
    samedef.check(expected, mod.shift, where="a Ray task")
except FingerprintError as e:
    print(e)
else:
    print("same")
"""


def test_check_of_a_callable_in_a_fresh_process(mycfg, tmp_path):
    from quern.pipeline.identity import samedef

    def run(expected):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(tmp_path), mycfg.__name__],
            input=pickle.dumps(expected),
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode().strip()

    assert run(samedef.definition(mycfg.shift, "map shift")) == "same"
    mycfg.THR = 150000
    said = run(samedef.definition(mycfg.shift, "map shift"))
    assert f"global `{mycfg.__name__}.THR` is 0 here and 150000 in the parent" in said, said
    assert said.startswith("a Ray task loaded another definition")


def test_check_names_the_difference_in_this_process(mycfg):
    """The same comparison without a fresh process: a definition taken before a change."""
    from quern.pipeline.identity import samedef

    pipe = quern.Pipeline.from_source({"x": np.arange(10)}).map(mycfg.add_fixed).batch(2)
    before = samedef.definition(pipe)
    samedef.check(before, pipe, where="here")  # the same: nothing raised
    mycfg.SCALE["a"][0] = 2.5
    with pytest.raises(
        FingerprintError,
        match=rf"map\[0\] add_fixed: global `{mycfg.__name__}\.SCALE`\[.a.\]\[0\] is 2.5 here and 1.5 in the parent",
    ):
        samedef.check(before, pipe, where="here")
    assert before["source"] == samedef.IDENTITY  # the data are not read again


def test_array_record_source_identity_is_not_read_by_the_check(tmp_path):
    from quern.pipeline.identity import samedef

    path = tmp_path / "r.array_record"
    write_array_record(path, [np.arange(i % 3 + 1, dtype=np.int32).tobytes() for i in range(50)])
    pipe = quern.Pipeline.from_source(quern.sources.ArrayRecordSource([str(path)])).batch(5)
    loaded = pickle.loads(pickle.dumps(pipe))
    os.remove(path)  # the identity samples the file: the check must not need it
    samedef.check_sent(loaded, "here")
