"""``quern prepare`` under faults: killed and restarted, rerun on a finished or damaged
folder, an output folder it must not touch, and bad input (unreadable files, invalid
JSON lines, a map that raises or returns what cannot be stored, empty input, bad sizes).

The kill is real: ``python -m quern prepare`` is run as a subprocess with a map that
sleeps per record and SIGKILLed once two shards are committed (their sidecars exist),
before the manifest. The other runs are in this process (``quern.pipeline.cli.main``)
unless the test is about a separate process."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import STAGING, prepare_cli, prepared_records, run_prepare, sidecars, tree, write_array_record, write_files

import quern.prepare.run as run_mod
from quern import SourceError
from quern.pipeline.sources import ArrayRecordSource
from quern.prepare import prepare

pytestmark = pytest.mark.timeout(120)

SLOW_MAP = """\
import pathlib
import time


def f(x):
    wait = pathlib.Path("faults_slow.sleep")  # seconds per record (a file: a map may not read the environment)
    time.sleep(float(wait.read_text()) if wait.exists() else 0.0)
    return x
"""
# the kill test's command (the input and the map are relative to the folder it runs in)
ARGS = ["IN", "--map", "faults_slow:f", "--shard-size", "8KB", "--workers", "0"]


# --------------------------------------------------------------------------- helpers


def quern_prepare(*args, cwd, sleep=0.0, timeout=60) -> subprocess.CompletedProcess:
    """``python -m quern prepare ARGS`` in ``cwd`` (the map sleeps ``sleep`` s per record)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wait = Path(cwd) / "faults_slow.sleep"
    wait.write_text(str(sleep))
    try:
        return run_prepare(*args, cwd=cwd, env=env, timeout=timeout)
    finally:
        wait.unlink()


def stats(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: relative path -> (inode, mtime_ns)."""
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def flip_byte(path: Path, offset: int = 100) -> None:
    """Damage ``path`` in place, its size unchanged."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_clean_and_equal(out: Path, ref: Path) -> None:
    """``out`` is a finished prepare, byte-identical to the uninterrupted ``ref``, with no leftover."""
    assert not (out / STAGING).exists(), sorted(p.name for p in (out / STAGING).rglob("*"))
    assert [p for p in out.rglob("*") if p.name.endswith(".tmp")] == []
    got, want = tree(out), tree(ref)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


# --------------------------------------------------------------------------- killed and restarted


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """``base/IN`` (40 files of 1500 bytes, 8 shards of 8KB), ``base/faults_slow.py``, ``base/REF`` (an
    uninterrupted run) and ``base/KILLED``: the output folder of the same run SIGKILLed once two
    shards were committed, as it was right after the kill (copied before any rerun touches it)."""
    base = tmp_path_factory.mktemp("killed")
    rng = random.Random(0)
    write_files(base, {f"IN/f{i:02d}.bin": rng.randbytes(1500) for i in range(40)})
    (base / "faults_slow.py").write_text(SLOW_MAP)
    ref = quern_prepare(*ARGS, "--output", base / "REF", cwd=base)
    assert ref.returncode == 0, ref.stderr
    assert len(json.loads((base / "REF" / "manifest.json").read_text())["shards"]) == 8

    out = base / "OUT"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    (base / "faults_slow.sleep").write_text(
        "0.05"
    )  # 6 records a shard: 0.3 s a shard, ~2.5 s for the 8 (and the sample)
    with open(base / "killed.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "quern", "prepare", *ARGS, "--output", str(out)],
            cwd=base,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                if len(sidecars(out)) >= 2 and not (out / "manifest.json").exists():
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.005)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    (base / "faults_slow.sleep").unlink()
    assert rc == -signal.SIGKILL, f"the run ended by itself (exit {rc}) before it could be killed: too fast"
    shutil.copytree(out, base / "KILLED", symlinks=True)
    yield base
    sys.modules.pop("faults_slow", None)  # imported by the tests that run the map in this process


def test_killed_prepare_leaves_only_complete_files_under_final_names(killed):
    out, ref = killed / "KILLED", killed / "REF"
    assert not (out / "manifest.json").exists()
    assert not (out / "metadata").exists()
    plan = json.loads((out / STAGING / "plan.json").read_text())
    names = [f"shard-{i:05d}-of-{len(plan['shards']):05d}.array_record" for i in range(len(plan["shards"]))]
    done = sidecars(out)
    assert 2 <= len(done) < len(names)
    finals = sorted(p.name for p in out.iterdir() if p.is_file())
    assert set(finals) <= set(names), finals  # nothing else under a final name (no manifest, no temporary)
    # a final-named shard without a sidecar: only the one renamed just before the kill
    assert len(set(finals) - set(done)) <= 1, (finals, done)
    assert set(done) <= set(finals)
    for name in finals:  # every final-named shard is complete: the uninterrupted run's bytes
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    for name in done:
        side = json.loads((out / STAGING / "done" / f"{name}.json").read_text())
        assert side["file"] == name
        assert side["sha256"] == json.loads((ref / "manifest.json").read_text())["shards"][names.index(name)]["sha256"]
    # a reader refuses the folder, saying the prepare did not finish
    with pytest.raises(SourceError, match="prepare did not finish"):
        ArrayRecordSource(out)
    with pytest.raises(SourceError, match=r"no manifest\.json"):
        ArrayRecordSource(out)


@pytest.mark.parametrize("damage", ["none", "corrupt", "no_sidecar", "bad_sidecar"])
def test_killed_prepare_run_again_completes_byte_identical(killed, tmp_path, damage):
    """The rerun keeps the finished shards (not rewritten: same inode and mtime), removes the
    leftovers, rewrites a damaged or uncommitted shard, and ends byte-identical to ``REF``."""
    out = tmp_path / "OUT"
    shutil.copytree(killed / "KILLED", out, symlinks=True)
    done = sidecars(out)
    # leftovers a kill can leave: a temporary shard, a temporary manifest or metadata file
    (out / STAGING / "tmp").mkdir(exist_ok=True)
    (out / STAGING / "tmp" / "shard-00007-of-00008.array_record.999999.tmp").write_bytes(b"partial")
    (out / "manifest.json.999999.tmp").write_bytes(b'{"format": "quern-prep')
    redo: set[str] = set()
    if damage == "corrupt":
        flip_byte(out / done[0])
        redo.add(done[0])
    elif damage == "no_sidecar":  # renamed, not committed: must be written again
        (out / STAGING / "done" / f"{done[-1]}.json").unlink()
        redo.add(done[-1])
    elif damage == "bad_sidecar":
        (out / STAGING / "done" / f"{done[-1]}.json").write_text('{"file": ')
        redo.add(done[-1])
    before = {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in done}
    time.sleep(0.01)  # a rewrite would get another mtime

    again = quern_prepare(*ARGS, "--output", out, cwd=killed)
    assert again.returncode == 0, again.stderr
    assert "prepared 40 records in 8 shards" in again.stdout
    for n in done:
        st = os.stat(out / n)
        if n in redo:
            assert (st.st_ino, st.st_mtime_ns) != before[n], f"{n} was kept though {damage}"
        else:
            assert (st.st_ino, st.st_mtime_ns) == before[n], f"{n} was rewritten"
    assert_clean_and_equal(out, killed / "REF")
    assert prepared_records(out) == prepared_records(killed / "REF")


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no ``except Exception`` catches it)."""


@pytest.mark.parametrize("stage", ["metadata", "manifest", "cleanup"])
def test_prepare_killed_after_its_shards_run_again_completes(killed, tmp_path, monkeypatch, capsys, stage):
    """A kill while the metadata file or the manifest is written (its temporary half
    written), or after the manifest but before ``.quern-prepare`` is removed: the
    rerun ends with the uninterrupted run's files and nothing else."""
    monkeypatch.chdir(killed)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "OUT"
    real_write, real_rmtree = run_mod._atomic_write, shutil.rmtree

    def dying_write(path, data):
        if path.endswith({"metadata": ".npy", "manifest": "manifest.json"}.get(stage, "\0")):
            with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
                f.write(data[: len(data) // 2])
            raise _Killed(path)
        real_write(path, data)

    def dying_rmtree(path, *a, **kw):
        if stage == "cleanup" and os.fspath(path).endswith(STAGING) and (out / "manifest.json").exists():
            raise _Killed(path)
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(run_mod, "_atomic_write", dying_write)
    monkeypatch.setattr(run_mod.shutil, "rmtree", dying_rmtree)
    with pytest.raises(_Killed):
        prepare("IN", out, map="faults_slow:f", shard_size="8KB", num_workers=0)
    monkeypatch.undo()
    assert (out / "manifest.json").exists() == (stage == "cleanup")

    again = quern_prepare(*ARGS, "--output", out, cwd=killed)  # another process: another pid in temporary names
    assert again.returncode == 0, again.stderr
    assert_clean_and_equal(out, killed / "REF")


# --------------------------------------------------------------------------- rerun on a finished folder


def test_rerun_on_finished_folder_verifies_and_touches_nothing(killed, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(killed)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "OUT"
    shutil.copytree(killed / "REF", out)
    before = stats(out)
    rc, stdout, err = prepare_cli(capsys, *ARGS, "--output", out)
    assert rc == 0, err
    assert "is complete" in stdout and "every checksum verified" in stdout
    assert stats(out) == before
    assert tree(out) == tree(killed / "REF")

    shard = "shard-00003-of-00008.array_record"
    flip_byte(out / shard)
    rc, stdout, err = prepare_cli(capsys, *ARGS, "--output", out)
    assert rc == 1
    assert shard in err and "checksum" in err
    flip_byte(out / shard)  # repaired: fine again

    flip_byte(out / "metadata" / "length.npy", offset=-1)
    rc, stdout, err = prepare_cli(capsys, *ARGS, "--output", out)
    assert rc == 1
    assert "metadata/length.npy" in err and "checksum" in err


def test_reader_refuses_an_incomplete_folder_naming_what_is_missing(killed, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match="not a folder written by quern prepare"):
        ArrayRecordSource(empty)

    out = tmp_path / "OUT"
    shutil.copytree(killed / "REF", out)
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "skipped"}))
    with pytest.raises(SourceError, match=r"incomplete: it lacks \['skipped'\]"):
        ArrayRecordSource(out)
    (out / "manifest.json").write_text(json.dumps(m))
    assert len(ArrayRecordSource(out)) == 40

    (out / "metadata" / "length.npy").unlink()
    with pytest.raises(SourceError, match=r"metadata/length\.npy.*missing"):
        ArrayRecordSource(out)
    shard = out / "shard-00005-of-00008.array_record"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(SourceError, match=r"shard-00005-of-00008\.array_record' has 1000 bytes"):
        ArrayRecordSource(out)
    shard.unlink()
    with pytest.raises(SourceError, match=r"shard 'shard-00005-of-00008\.array_record'.*missing"):
        ArrayRecordSource(out)


# --------------------------------------------------------------------------- an output folder it must not touch


@pytest.mark.parametrize("other", [["--shard-size", "16KB"], ["--skip-errors"], ["input"]], ids=lambda o: o[0])
def test_output_holding_another_prepares_manifest_is_refused(killed, tmp_path, monkeypatch, capsys, other):
    monkeypatch.chdir(killed)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "OUT"
    shutil.copytree(killed / "REF", out)
    before = stats(out)
    args = [*ARGS, "--output", out]
    if other == ["input"]:  # another input: the same files less one
        (tmp_path / "IN").mkdir()
        for p in sorted((killed / "IN").iterdir())[1:]:
            shutil.copy(p, tmp_path / "IN" / p.name)
        args[0] = tmp_path / "IN"
    else:
        args += other
    rc, stdout, err = prepare_cli(capsys, *args)
    assert rc == 2, err
    assert "holds the manifest of another prepare" in err and str(out) in err
    assert stats(out) == before
    assert tree(out) == tree(killed / "REF")


def test_non_empty_folder_that_is_not_a_prepare_is_refused(workdir, capsys):
    write_files(workdir, {"IN/a.txt": b"alpha", "IN/b.txt": b"beta"})
    out = write_files(workdir / "OUT", {"notes.txt": b"mine", "sub/data.bin": b"\x00\x01"})
    before = stats(out)
    rc, stdout, err = prepare_cli(capsys, "IN", "--output", out, "--workers", "0")
    assert rc == 2, err
    assert "not empty" in err and "holds no quern prepare" in err and str(out) in err
    assert stats(out) == before
    assert tree(out) == {"notes.txt": b"mine", "sub/data.bin": b"\x00\x01"}


# --------------------------------------------------------------------------- bad input


def _jsonl_lines(n: int, bad: int, pad: int = 0) -> list[bytes]:
    lines = [json.dumps({"text": f"line {i + 1} " + "x" * pad}).encode() for i in range(n)]
    lines[bad - 1] = b'{"text": "line %d, never closed' % bad
    return lines


@pytest.mark.parametrize(
    ("n", "bad", "pad", "size"),
    [(10, 7, 0, "1MB"), (400, 7, 60, "16KB"), (400, 333, 60, "16KB")],  # 16KB: items of 4KB, the line in a later one
    ids=["one-item", "first-of-many-items", "late-item"],
)
def test_invalid_json_line_is_named_by_file_and_line(workdir, capsys, n, bad, pad, size):
    lines = _jsonl_lines(n, bad, pad)
    (workdir / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    rc, stdout, err = prepare_cli(capsys, "data.jsonl", "--output", "OUT", "--workers", "0", "--shard-size", size)
    assert rc == 1
    assert f"data.jsonl line {bad}:" in err and "invalid JSON" in err, err
    assert not (workdir / "OUT" / "manifest.json").exists()

    rc, stdout, err = prepare_cli(
        capsys, "data.jsonl", "--output", "SKIP", "--workers", "0", "--shard-size", size, "--skip-errors"
    )
    assert rc == 0, err
    assert "skipped 1" in stdout
    m = json.loads((workdir / "SKIP" / "manifest.json").read_text())
    assert m["skipped"]["count"] == 1
    assert m["skipped"]["first"][0]["where"] == f"data.jsonl line {bad}"
    assert "invalid JSON" in m["skipped"]["first"][0]["error"]
    assert m["records"]["count"] == n - 1
    assert prepared_records(workdir / "SKIP") == lines[: bad - 1] + lines[bad:]


BOOM_MAP = """\
def f(x):
    if b"BOOM" in x:
        raise RuntimeError("cannot map this one")
    return x
"""


def test_map_that_raises_names_the_file_and_the_exception(workdir, capsys):
    write_files(workdir, {"IN/a.txt": b"alpha", "IN/sub/b.txt": b"say BOOM", "IN/c.txt": b"gamma"})
    (workdir / "faults_boom.py").write_text(BOOM_MAP)
    rc, stdout, err = prepare_cli(capsys, "IN", "--output", "OUT", "--map", "faults_boom:f", "--workers", "0")
    assert rc == 1
    assert "IN/sub/b.txt" in err and "the map raised RuntimeError: cannot map this one" in err, err
    assert not (workdir / "OUT" / "manifest.json").exists()

    rc, stdout, err = prepare_cli(
        capsys, "IN", "--output", "SKIP", "--map", "faults_boom:f", "--workers", "0", "--skip-errors"
    )
    assert rc == 0, err
    m = json.loads((workdir / "SKIP" / "manifest.json").read_text())
    assert m["skipped"]["count"] == 1
    assert m["skipped"]["first"][0]["where"] == "IN/sub/b.txt"
    assert "RuntimeError: cannot map this one" in m["skipped"]["first"][0]["error"]
    assert prepared_records(workdir / "SKIP") == [b"alpha", b"gamma"]


@pytest.mark.parametrize(
    ("returned", "says"),
    [
        ("(x, x)", "got tuple"),
        ("7", "got int"),
        ("None", "got NoneType"),
        ("[x, 7]", "got int"),  # a list is one record per element: each must be storable
        ("{'text': x}", "under 'record'"),
    ],
    ids=["tuple", "int", "none", "list-holding-an-int", "dict-without-record"],
)
def test_map_returning_an_unsupported_type_names_the_record(workdir, capsys, returned, says):
    write_files(workdir, {"IN/a.txt": b"alpha", "IN/b.txt": b"beta"})
    name = f"faults_bad_{abs(hash(returned))}"
    (workdir / f"{name}.py").write_text(f"def f(x):\n    return {returned}\n")
    rc, stdout, err = prepare_cli(capsys, "IN", "--output", "OUT", "--map", f"{name}:f", "--workers", "0")
    assert rc == 1
    assert "IN/a.txt" in err and says in err, err
    if says != "under 'record'":
        assert "the map returned" in err, err


def test_map_returning_arrays_of_two_dtypes_names_both_records(workdir, capsys):
    write_files(workdir, {"IN/a.txt": b"alpha", "IN/b.txt": b"beta"})
    (workdir / "faults_dtype.py").write_text(
        "import numpy as np\n\n\ndef f(x):\n    return np.frombuffer(x, np.uint8).astype(np.int32 if x == b'beta' else np.int64)\n"
    )
    rc, stdout, err = prepare_cli(capsys, "IN", "--output", "OUT", "--map", "faults_dtype:f", "--workers", "0")
    assert rc == 1
    assert "IN/b.txt" in err and "IN/a.txt" in err and "int32" in err and "int64" in err, err


def test_empty_input_is_refused(workdir, capsys):
    (workdir / "EMPTY").mkdir()
    rc, stdout, err = prepare_cli(capsys, "EMPTY", "--output", "OUT")
    assert rc == 1
    assert "no input record" in err and "EMPTY" in err, err

    write_files(workdir, {"IN/a.txt": b"alpha"})
    rc, stdout, err = prepare_cli(capsys, "IN", "--output", "OUT", "--include", "*.py")
    assert rc == 1
    assert "no input record" in err and "*.py" in err, err

    (workdir / "empty.jsonl").write_bytes(b"")
    rc, stdout, err = prepare_cli(capsys, "empty.jsonl", "--output", "OUT")
    assert rc == 1
    assert "no input record" in err and "empty.jsonl" in err, err


@pytest.mark.parametrize("case", ["blank-lines", "map-returning-empty-lists"])
def test_input_holding_no_record_is_refused(workdir, capsys, case):
    """Items to read, but no record made of them and none skipped: a JSON-lines file of blank
    lines, or a map returning ``[]`` (no record for its input) for every record."""
    if case == "blank-lines":
        (workdir / "in.jsonl").write_bytes(b"\n  \n\n")
        extra = []
    else:
        (workdir / "in.jsonl").write_bytes(b'{"a": 1}\n{"a": 2}\n')
        (workdir / "faults_empty.py").write_text("def f(x):\n    return []\n")
        extra = ["--map", "faults_empty:f"]
    rc, stdout, err = prepare_cli(capsys, "in.jsonl", "--output", "OUT", "--workers", "0", *extra)
    assert "no record was prepared" in err, err
    assert rc == 1
    assert not (workdir / "OUT" / "manifest.json").exists()


def test_missing_input_is_named(workdir, capsys):
    rc, stdout, err = prepare_cli(capsys, "nowhere", "--output", "OUT")
    assert rc in (1, 2)
    assert "'nowhere'" in err and "does not exist" in err, err
    rc, stdout, err = prepare_cli(capsys, "nowhere-*.jsonl", "--output", "OUT")
    assert rc in (1, 2)
    assert "nowhere-*.jsonl" in err, err
    assert not (workdir / "OUT").exists()


def test_unreadable_inputs_are_named(workdir, capsys):
    rng = random.Random(1)
    (workdir / "noise.parquet").write_bytes(rng.randbytes(5000))
    rc, stdout, err = prepare_cli(capsys, "noise.parquet", "--output", "OUT")
    assert rc == 1
    assert "'noise.parquet' is not a readable Parquet file" in err, err

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": [f"row {i} " * 50 for i in range(200)]}), workdir / "mid.parquet", compression="zstd"
    )
    data = bytearray((workdir / "mid.parquet").read_bytes())
    for i in range(200, 1200):  # the data page; the footer stays readable
        data[i] ^= 0x5A
    (workdir / "mid.parquet").write_bytes(bytes(data))
    rc, stdout, err = prepare_cli(capsys, "mid.parquet", "--output", "OUT", "--workers", "0")
    assert rc == 1
    assert "mid.parquet row group 0: cannot read it" in err, err

    for size in (5000, 70000):  # too short for ArrayRecord; long enough, but noise
        (workdir / "noise.array_record").write_bytes(rng.randbytes(size))
        rc, stdout, err = prepare_cli(capsys, "noise.array_record", "--output", "OUT")
        assert rc == 1
        assert "'noise.array_record' is not a readable ArrayRecord file" in err, err

    write_array_record(workdir / "mid.array_record", [b"record %d " % i * 150 for i in range(6)])
    data = bytearray((workdir / "mid.array_record").read_bytes())
    for i in range(100, 300):  # the first record's chunk; the footer stays readable
        data[i] ^= 0x5A
    (workdir / "mid.array_record").write_bytes(bytes(data))
    rc, stdout, err = prepare_cli(capsys, "mid.array_record", "--output", "OUT", "--workers", "0")
    assert rc == 1
    assert "mid.array_record records 0-6: cannot read it" in err, err
    assert not (workdir / "OUT" / "manifest.json").exists()


VANISH_MAP = """\
import os


def f(x):
    if os.path.exists("IN/z.txt"):
        os.remove("IN/z.txt")
    return x
"""


@pytest.mark.parametrize("skip", [False, True])
def test_file_vanishing_after_listing_is_named(workdir, capsys, skip):
    """The map (first called while the plan is made, after the files are listed) deletes
    ``IN/z.txt``: reading it fails, named, or skipped and counted."""
    write_files(workdir, {"IN/a.txt": b"alpha", "IN/b.txt": b"beta", "IN/z.txt": b"zeta"})
    (workdir / "faults_vanish.py").write_text(VANISH_MAP)
    rc, stdout, err = prepare_cli(
        capsys,
        "IN",
        "--output",
        "OUT",
        "--map",
        "faults_vanish:f",
        "--workers",
        "0",
        *(["--skip-errors"] if skip else []),
    )
    assert not (workdir / "IN" / "z.txt").exists()
    if not skip:
        assert rc == 1
        assert "IN/z.txt: cannot read it: FileNotFoundError" in err, err
        return
    assert rc == 0, err
    m = json.loads((workdir / "OUT" / "manifest.json").read_text())
    assert m["skipped"]["count"] == 1 and m["skipped"]["first"][0]["where"] == "IN/z.txt"
    assert prepared_records(workdir / "OUT") == [b"alpha", b"beta"]


def test_every_record_skipped_is_an_error_not_an_empty_dataset(workdir, capsys):
    (workdir / "bad.jsonl").write_bytes(b"{oops\nnot json\n[1,\n")
    rc, stdout, err = prepare_cli(capsys, "bad.jsonl", "--output", "OUT", "--workers", "0", "--skip-errors")
    assert rc == 1
    assert "no record was prepared" in err and "3 skipped" in err and "bad.jsonl line 1" in err, err
    assert not (workdir / "OUT" / "manifest.json").exists()
    with pytest.raises(SourceError):
        ArrayRecordSource(workdir / "OUT")


@pytest.mark.parametrize("value", ["12XB", "0", "MB", "1.5.5MB", "KB12"])
def test_bad_shard_size_is_a_usage_error_naming_it(workdir, capsys, value):
    write_files(workdir, {"IN/a.txt": b"alpha"})
    rc, stdout, err = prepare_cli(capsys, "IN", "--output", "OUT", "--shard-size", value)
    assert rc == 2
    assert repr(value) in err, err
    assert not (workdir / "OUT").exists()


def _unfinished_other_job(out):
    (out / ".quern-prepare").mkdir(parents=True)
    (out / ".quern-prepare" / "plan.json").write_text(
        json.dumps({"job": "another", "shards": [[0, 1], [1, 2], [2, 3]]})
    )
    (out / "shard-00002-of-00003.array_record").write_bytes(b"of the other job")


def test_an_unfinished_prepare_of_another_job_is_replaced(tmp_path):
    from quern.prepare import prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"{i}.txt").write_bytes(b"x" * (i + 1))
    out = tmp_path / "out"
    _unfinished_other_job(out)
    m = prepare(docs, out, num_workers=0, progress=False)
    assert not (out / "shard-00002-of-00003.array_record").exists() and not (out / ".quern-prepare").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [s["file"] for s in m["shards"]] + ["manifest.json", "metadata"]
    )


def test_an_unfinished_prepare_of_another_job_beside_other_files_is_refused_untouched(tmp_path):
    from quern.prepare import prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_bytes(b"a")
    out = tmp_path / "out"
    _unfinished_other_job(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        prepare(docs, out, num_workers=0, progress=False)
    assert (out / "shard-00002-of-00003.array_record").read_bytes() == b"of the other job"
    assert (out / "notes.txt").read_text() == "mine" and (out / ".quern-prepare" / "plan.json").exists()


def test_a_worker_process_that_dies_is_a_clear_error_and_a_rerun_completes(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"{i:02d}.txt").write_bytes(b"record %d " % i * 200)
    (tmp_path / "dies.py").write_text(
        "import multiprocessing, os\n\ndef f(b):  # dies in a worker (the parent maps a sample first)\n"
        "    if b.startswith(b'record 17 ') and os.path.exists('DIE') and multiprocessing.parent_process():\n"
        "        os._exit(3)\n    return b\n"
    )
    (tmp_path / "DIE").write_text("")  # the map dies while this file exists (it may not read the environment)
    out = tmp_path / "out"
    args = (docs, "--output", out, "--map", "dies:f", "--workers", "2", "--shard-size", "8KB")
    died = run_prepare(*args, cwd=tmp_path, timeout=120)
    assert died.returncode == 1, died.stderr
    assert "a worker process died" in died.stderr and "run the same prepare again" in died.stderr
    assert not (out / "manifest.json").exists()
    (tmp_path / "DIE").unlink()
    again = run_prepare(*args, cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr
    src = ArrayRecordSource(str(out))
    assert [bytes(r) for r in src.read_many(np.arange(len(src)))] == [b"record %d " % i * 200 for i in range(30)]
