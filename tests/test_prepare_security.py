"""``quern prepare`` against inputs that change under it, links, special files, a full
disk, a kill -9 and a map that forks (issue 21, points 6 and 11).

Every input is written here with its own library; the runs that must be another process
(a kill, a fork, a rewrite while workers read) are ``python -m quern prepare`` subprocesses
with timeouts, the others ``quern.pipeline.cli.main`` or ``prepare`` in this process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prepare_cli, prepared_records, run_prepare, sidecars, write_files

import quern
from quern.prepare import PrepareError, prepare

pytestmark = pytest.mark.timeout(180)


def _age(*paths: Path, seconds: float = 60.0) -> None:
    """Set the modification time of ``paths`` ``seconds`` back: a rewrite gets another one, whatever
    the file system clock's tick."""
    t = time.time_ns() - int(seconds * 1e9)
    for p in paths:
        os.utime(p, ns=(t, t))


def _digits(i: int, width: int, salt: int = 0) -> str:
    """A number of ``width`` digits 1-9 (no 0: any piece of it is a valid JSON number too)."""
    out, n = [], i * 7919 + salt
    for _ in range(width):
        out.append("123456789"[n % 9])
        n //= 9
    return "".join(out)


# --------------------------------------------------------------------------- inputs changed during the run

REWRITE_MAP = """\
import os
import shutil

TRIGGER = {trigger}


def f(x):
    if x == TRIGGER and not os.path.exists("rewritten"):  # once, while the shards are written
        open("rewritten", "w").close()
        shutil.copyfile("new.jsonl", "data.jsonl")  # in place: the same inode, another content
    return str(x)
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("rewrite", ["same-size", "longer-lines"])
def test_jsonl_rewritten_during_the_run_fails_naming_it(tmp_path, workers, rewrite):
    """A JSON-lines file of 20,000 numbers (420 KB, 7 shards), rewritten in place by the map
    when it meets line 5,000 (never in the plan's sample: the first 8 lines of an item). The
    records after it would be of the new file: other numbers with the same line lengths, or
    pieces of longer lines (pieces of a number are numbers: valid JSON). The run fails
    naming the file and publishes nothing; run again, it starts over (the finished shards
    hold the old file) and gives the new file's records."""
    n = 20_000
    old = [_digits(i, 20) for i in range(n)]
    new = [_digits(i, 20, salt=1) for i in range(n)] if rewrite == "same-size" else [_digits(i, 29) for i in range(n)]
    (tmp_path / "data.jsonl").write_text("".join(f"{v}\n" for v in old))
    (tmp_path / "new.jsonl").write_text("".join(f"{v}\n" for v in new))
    _age(tmp_path / "data.jsonl")
    (tmp_path / "rewrites.py").write_text(REWRITE_MAP.format(trigger=int(old[5000])))
    args = ("data.jsonl", "--output", "OUT", "--map", "rewrites:f", "--shard-size", "64KB", "--workers", workers)

    run = run_prepare(*args, cwd=tmp_path, timeout=120)
    assert (tmp_path / "rewritten").exists(), run.stderr  # the map did rewrite it, during the run
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "'data.jsonl'" in run.stderr and "changed during the run" in run.stderr, run.stderr
    assert not (tmp_path / "OUT" / "manifest.json").exists()

    again = run_prepare(*args, cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr
    if rewrite == "same-size":  # the same items: the same job, but of another file
        assert "inputs changed since" in again.stderr, again.stderr
    assert prepared_records(tmp_path / "OUT") == [v.encode() for v in new]


REWRITE_LAST_MAP = """\
import os

LAST = b"zeta"


def f(x):
    if x == LAST:  # the last record: every file was read when it comes the second time
        if os.path.exists("sampled"):
            {rewrite}
        open("sampled", "w").close()
    return x
"""


@pytest.mark.parametrize(
    "rewrite",
    [
        'open("IN/a.txt", "wb").write(b"ALPHA")',  # in place, the same size: only the time differs
        'open("new.txt", "wb").write(b"alpha"); os.replace("new.txt", "IN/a.txt")',  # another file, same bytes
        'open("IN/a.txt", "ab").write(b"!")',
    ],
    ids=["same-size", "replaced", "appended"],
)
def test_a_file_changed_after_it_was_read_fails_the_run(workdir, rewrite):
    """The map changes ``IN/a.txt`` after it was read (when it maps ``IN/z.txt``, the last
    record): no read sees the change, the check of every input at the end does."""
    write_files(workdir, {"IN/a.txt": b"alpha", "IN/b.txt": b"beta", "IN/z.txt": b"zeta"})
    _age(*(workdir / "IN").iterdir())
    (workdir / "changes_last.py").write_text(REWRITE_LAST_MAP.format(rewrite=rewrite))
    with pytest.raises(PrepareError, match=r"'IN/a\.txt'.*changed during the run"):
        prepare("IN", workdir / "OUT", map="changes_last:f", num_workers=0, progress=False)
    assert not (workdir / "OUT" / "manifest.json").exists()


REWRITE_PARQUET_MAP = """\
import os

import pyarrow as pa
import pyarrow.parquet as pq


def f(x):
    if x == "row 0" and os.path.exists("sampled"):  # the second time: writing the shard, not the plan's sample
        pq.write_table(pa.table({"text": [f"other {i}" for i in range(200)]}), "data.parquet", row_group_size=100)
    open("sampled", "w").close()
    return x
"""


def test_parquet_file_rewritten_between_its_row_groups_fails_naming_it(workdir):
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(200)]}), workdir / "data.parquet", row_group_size=100)
    _age(workdir / "data.parquet")
    (workdir / "changes_parquet.py").write_text(REWRITE_PARQUET_MAP)
    with pytest.raises(PrepareError, match=r"'data\.parquet'.*changed during the run"):
        prepare(
            "data.parquet", workdir / "OUT", map="changes_parquet:f", columns=["text"], num_workers=0, progress=False
        )
    assert not (workdir / "OUT" / "manifest.json").exists()


# --------------------------------------------------------------------------- links and special files


def test_linked_folders_are_followed_and_loops_are_not(tmp_path):
    """``IN/linked`` links to a folder outside the tree: its files are records, under the
    link's path, in path order. ``IN/real/up`` (to ``IN``) and ``IN/self`` (to ``IN``
    itself) are loops: followed once each would never end; they add no file."""
    write_files(tmp_path, {"IN/real/a.txt": b"alpha", "other/b.txt": b"beta", "other/sub/c.txt": b"gamma"})
    os.symlink("../other", tmp_path / "IN" / "linked")
    os.symlink("..", tmp_path / "IN" / "real" / "up")
    os.symlink(".", tmp_path / "IN" / "self")
    m = prepare(tmp_path / "IN", tmp_path / "OUT", num_workers=0, progress=False)
    assert prepared_records(tmp_path / "OUT") == [
        b"beta",
        b"gamma",
        b"alpha",
    ]  # linked/b.txt, linked/sub/c.txt, real/a.txt
    assert m["input"]["inputs"][0]["files"] == 3


def test_a_fifo_input_is_named_as_not_a_regular_file(workdir, capsys):
    os.mkfifo(workdir / "in.jsonl")
    rc, _, err = prepare_cli(capsys, "in.jsonl", "--output", "OUT")
    assert rc == 1
    assert "'in.jsonl' is not a regular file" in err and "FIFO" in err, err
    assert "does not exist" not in err
    assert not (workdir / "OUT").exists()


@pytest.mark.parametrize("under", ["", "/sub/deeper"])
def test_an_output_that_is_a_file_is_named(workdir, capsys, under):
    write_files(workdir, {"IN/a.txt": b"alpha", "taken.txt": b"mine"})
    rc, _, err = prepare_cli(capsys, "IN", "--output", f"taken.txt{under}", "--workers", "0")
    assert rc == 2
    assert f"'{workdir / 'taken.txt'}'" in err and "is a file, not a folder" in err, err
    assert "NotADirectoryError" not in err
    assert (workdir / "taken.txt").read_bytes() == b"mine"


# --------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize("workers", [0, 2])
def test_a_full_disk_is_said_naming_the_output_and_a_rerun_with_room_completes(workdir, capsys, small_disk, workers):
    rng = random.Random(2)
    files = {f"IN/{i:02d}.bin": rng.randbytes(30_000) for i in range(40)}  # 1.2 MB that zstd cannot shrink
    write_files(workdir, files)
    out = small_disk / "OUT"
    args = ("IN", "--output", out, "--workers", workers, "--shard-size", "128KB")
    rc, _, err = prepare_cli(capsys, *args)
    assert rc == 1, err
    assert f"the disk holding the output folder '{out}' is full" in err and "No space left on device" in err, err
    assert "unexpected error" not in err and "RuntimeError" not in err
    assert not (out / "manifest.json").exists()
    assert [p.name for p in out.rglob("*") if p.name.endswith(".tmp")] == []  # no half-written file is left

    remount = ["mount", "-o", "remount,size=8m", str(small_disk)]
    assert subprocess.run(remount, capture_output=True, timeout=30).returncode == 0
    rc, _, err = prepare_cli(capsys, *args)
    assert rc == 0, err
    assert prepared_records(out) == [files[k] for k in sorted(files)]


# --------------------------------------------------------------------------- processes


SLEEPY_MAP = """\
import time


def f(x):
    time.sleep(0.05)
    return x
"""


def test_kill_9_of_prepare_leaves_no_process_behind(tmp_path):
    """``quern prepare --workers 2`` SIGKILLed while its pool writes shards: its workers and
    the pool's resource tracker end within 10 s (they stayed for minutes)."""
    write_files(tmp_path, {f"IN/{i:03d}.bin": b"%d " % i * 1000 for i in range(200)})
    (tmp_path / "sleepy.py").write_text(SLEEPY_MAP)
    cmd = [sys.executable, "-m", "quern", "prepare", "IN", "--output", "OUT", "--map", "sleepy:f"]
    proc = subprocess.Popen(
        [*cmd, "--workers", "2", "--shard-size", "8KB"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kids: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            kids = psutil.Process(proc.pid).children(recursive=True)
            if len(kids) >= 3 and sidecars(tmp_path / "OUT"):  # two workers and the tracker; a shard written
                break
            time.sleep(0.02)
        assert proc.poll() is None, "prepare ended before it could be killed: too fast"
        assert len(kids) >= 3, [k.cmdline() for k in kids]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(kids, timeout=10)
        assert alive == [], [(p.pid, " ".join(p.cmdline())[-80:]) for p in alive]
    finally:
        for p in kids:
            try:
                p.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not (tmp_path / "OUT" / "manifest.json").exists()


FORKING_MAP = """\
import multiprocessing
import os

forked = []


def f(x):
    if not forked and multiprocessing.parent_process() is not None:  # in a pool worker, once
        forked.append(os.fork())  # the child returns too, into quern prepare
    return x
"""


def test_a_map_that_forks_in_a_worker_neither_hangs_nor_changes_the_output(tmp_path):
    """The child of a fork in the map returns into the worker's loop, where it would take
    tasks and pool messages meant for its parent (the run hung): it is ended, said on
    stderr, and the output is every record once."""
    files = {f"IN/{i:02d}.bin": b"record %d " % i * 300 for i in range(40)}
    write_files(tmp_path, files)
    (tmp_path / "forking.py").write_text(FORKING_MAP)
    cmd = [sys.executable, "-m", "quern", "prepare", "IN", "--output", "OUT", "--map", "forking:f"]
    proc = subprocess.Popen(
        [*cmd, "--workers", "2", "--shard-size", "8KB"], cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:  # a hung run: its processes go too
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert "the map forked" in err, err
    assert prepared_records(tmp_path / "OUT") == [files[k] for k in sorted(files)]


def test_quern_prepare_is_reachable_after_import_quern_alone(tmp_path):
    code = (
        "import sys, quern\n"
        "assert 'quern.prepare' not in sys.modules  # not imported before it is used\n"
        "print(quern.prepare.verify.__module__, quern.prepare.prepare.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["quern.pipeline.sources.prepared", "prepare"]


def test_prepared_records_match_when_nothing_changes(tmp_path):
    """The checks add no failure where nothing changes: a tree, JSON lines and Parquet, with
    links followed, give their records (a control for the tests above)."""
    write_files(tmp_path, {"IN/a.txt": b"alpha", "IN/b.txt": b"beta"})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"t": i}) + "\n" for i in range(1000)))
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(300)]}), tmp_path / "d.parquet", row_group_size=100)
    m = prepare(
        [tmp_path / "IN", tmp_path / "d.jsonl"], tmp_path / "OUT", shard_size="8KB", num_workers=2, progress=False
    )
    assert m["records"]["count"] == 1002
    got = prepared_records(tmp_path / "OUT")
    assert got[:2] == [b"alpha", b"beta"] and got[2:] == [json.dumps({"t": i}).encode() for i in range(1000)]
    prepare(tmp_path / "d.parquet", tmp_path / "P", columns=["text"], num_workers=0, progress=False)
    assert prepared_records(tmp_path / "P") == [f"row {i}".encode() for i in range(300)]


# --------------------------------------------------------------------------- the map in fresh processes


@pytest.fixture
def installed_module(workdir):
    """A module written into this environment's site-packages (as an installed package's would be:
    prepare sends a module of the current folder by value, with its globals, but one installed is
    imported again by name in each worker), removed after the test. Yields a function that writes
    one and imports it."""
    import importlib
    import sysconfig
    import uuid

    written = []

    def make(source: str):
        name = f"quern_test_map_{uuid.uuid4().hex[:12]}"
        path = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
        path.write_text(source)
        written.append(path)
        importlib.invalidate_caches()
        return importlib.import_module(name)

    yield make
    for path in written:
        path.unlink(missing_ok=True)


def test_a_map_global_changed_at_run_time_is_refused_by_the_worker_processes(workdir, installed_module):
    """A pool worker is a fresh interpreter: it imports an installed map's module again and would see
    THR's import-time value, writing other records than the parent's definition says. It refuses,
    naming the global."""
    mod = installed_module("THR = 0\n\n\ndef cut(rec):\n    return rec[:THR] if THR else rec\n")
    name = mod.__name__
    inputs = write_files(workdir / "IN", {f"f{i:03d}.bin": bytes([i]) * 900 for i in range(40)})
    mod.THR = 500  # changed after import: the parent's definition has 500, a fresh import 0
    with pytest.raises(PrepareError, match=rf"global `{name}\.THR` is 0 here and 500 in the parent"):
        prepare(inputs, workdir / "OUT", map=mod.cut, shard_size="4KB", num_workers=2, progress=False)
    assert not (workdir / "OUT" / "manifest.json").exists()
    # the same map in this process: nothing to compare, the records are cut as the parent's THR says
    m = prepare(inputs, workdir / "OUT0", map=mod.cut, shard_size="4KB", num_workers=0, progress=False)
    assert m["records"]["count"] == 40
    src = quern.sources.ArrayRecordSource(str(workdir / "OUT0"))
    assert {len(r) for r in src.read_many(np.arange(40))} == {500}


def test_a_map_global_set_at_import_runs_in_the_worker_processes(workdir, installed_module):
    mod = installed_module("THR = 500\n\n\ndef cut(rec):\n    return rec[:THR]\n")
    inputs = write_files(workdir / "IN", {f"f{i:03d}.bin": bytes([i]) * 900 for i in range(40)})
    a = prepare(inputs, workdir / "A", map=mod.cut, shard_size="4KB", num_workers=2, progress=False)
    b = prepare(inputs, workdir / "B", map=mod.cut, shard_size="4KB", num_workers=0, progress=False)
    assert len(a["shards"]) > 1
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


@pytest.mark.parametrize("field", ["../x", "a/b", "a\\b", "", "..", "x\ny"])
def test_a_field_name_that_is_not_a_plain_file_name_is_refused(workdir, field):
    """A field is the file ``metadata/<field>.npy``: a name with a separator would write elsewhere, and a
    reader refuses such a manifest; prepare refuses it first, naming it, before writing anything."""
    inputs = write_files(workdir / "IN", {"a.bin": b"x" * 10})
    with pytest.raises(ValueError, match="is not a plain file name") as e:
        prepare(inputs, workdir / "OUT", fields=[field], progress=False)
    assert repr(field) in str(e.value)
    assert not (workdir / "OUT").exists()
