"""``quern prepare`` on Ray (``--ray``, ``--ray-address``), on real local Ray clusters: the same bytes as a local run.

The cluster of ``--ray-address`` is a head node started here (``ray start --head --block`` on 127.0.0.1, with its
own ports, temporary folder and authentication token), shared by the tests of this module and stopped at its end
by signalling that one process: never with ``ray stop``, which stops every Ray process of the machine, other
users' too. ``--ray`` without an address starts a cluster of its own inside ``prepare``: run in a subprocess, so
this process holds no Ray state. When a cluster is stopped, no process of it may be left (they are found by their
temporary folder, which is in the command line of every Ray process). The map modules are files of the current
directory, as a user's would be: prepare ships them to the Ray workers by value.

The default run holds one test against one head node, not marked slow so that ``make test-fast`` runs it too: the
``--ray-address`` smoke test, a map's error naming its file and a map whose global changed at run time (one test: a
module fixture starts its head in every test worker that runs a test of the module). The ``--ray`` local cluster
and ``--skip-errors`` tests are ``optin`` (``pytest -m optin``).
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import run_prepare, tree
from raycluster import assert_none_left as _assert_none_left
from raycluster import env as _env
from raycluster import free_ports as _free_ports
from raycluster import short_tmpdir as _short_tmpdir

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'quern[ray]'): quern prepare --ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 180  # seconds, for every command run here
TOK = """\
import numpy as np


def encode(b):
    return np.frombuffer(b, np.uint8).astype(np.int32)
"""
BAD = """\
import numpy as np


def encode(b):
    if b.startswith(b"BAD"):
        raise ValueError("this record is bad")
    return np.frombuffer(b, np.uint8).astype(np.int32)
"""
BAD_FILE = "b/f0013.txt"  # the one record the map of BAD raises on


# --------------------------------------------------------------------------- helpers


def _make_input(root, n: int, seed: int, bad: str | None = None) -> str:
    """``root/docs``: ``n`` text files of varied sizes (10 B to 20 KB) in two folders; ``bad`` (a relative path)
    starts with ``BAD``."""
    rng = random.Random(seed)
    docs = os.path.join(root, "docs")
    for i in range(n):
        rel = f"{'ab'[i % 2]}/f{i:04d}.txt"
        size = rng.choice([rng.randrange(10, 200), rng.randrange(200, 4000), rng.randrange(4000, 20000)])
        data = bytes(rng.randrange(97, 123) for _ in range(size))
        if rel == bad:
            data = b"BAD" + data
        os.makedirs(os.path.dirname(os.path.join(docs, rel)), exist_ok=True)
        with open(os.path.join(docs, rel), "wb") as f:
            f.write(data)
    return docs


def _assert_same_tree(a, b) -> dict[str, bytes]:
    ta, tb = tree(a), tree(b)
    assert sorted(ta) == sorted(tb), f"{a} and {b} hold other files"
    differ = [name for name in ta if ta[name] != tb[name]]
    assert not differ, f"these files of {a} and {b} differ: {differ}"
    return ta


def _prepare(cwd, env: dict[str, str], *args) -> subprocess.CompletedProcess:
    """``python -m quern prepare ARGS`` in ``cwd`` (where the map modules are)."""
    return run_prepare(*args, cwd=cwd, env=env, timeout=TIMEOUT)


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, f"exit status {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out


def _manifest(folder) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def _error_line(stderr: str) -> str:
    """The one ``quern: ...`` message of a failed command (Ray's own log lines left out)."""
    lines = [line for line in stderr.splitlines() if line.startswith("quern: ")]
    assert len(lines) == 1, stderr
    return lines[0]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head node on 127.0.0.1 (2 CPUs, no dashboard), its address and the environment to reach it; stopped at
    the end of the module by SIGTERM to ``ray start --block`` (which stops the processes it started), then anything
    of it still running is killed by pid."""
    tmpdir = _short_tmpdir()
    env = _env(tmpdir)
    port, client, dash, agent_http, agent_grpc, metrics, runtime_env, node, objects = _free_ports(9)
    try:  # the Ray client server (default port 10001) runs only with ray[client]: its port is given only then
        from ray._private.utils import get_ray_client_dependency_error

        with_client = get_ray_client_dependency_error() is None
    except ImportError:
        with_client = False
    script = os.path.join(os.path.dirname(sys.executable), "ray")
    ray_cmd = (
        [script] if os.path.exists(script) else [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
    )
    command = [
        *ray_cmd,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=2",
        "--object-store-memory=100000000",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={tmpdir}",
        f"--dashboard-port={dash}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--node-manager-port={node}",
        f"--object-manager-port={objects}",
        *([f"--ray-client-server-port={client}"] if with_client else []),
    ]
    log_path = os.path.join(tmpdir, "head.log")
    log = open(log_path, "wb")
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def read_log() -> str:
        with open(log_path, errors="replace") as f:
            return f.read()

    try:
        deadline = time.monotonic() + TIMEOUT
        while "Ray runtime started" not in read_log():
            if head.poll() is not None:
                pytest.fail(f"ray start exited with status {head.returncode}:\n{read_log()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start in {TIMEOUT} s:\n{read_log()[-4000:]}")
            time.sleep(0.2)
        yield {"address": f"127.0.0.1:{port}", "env": env, "tmpdir": tmpdir}
    finally:
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait(timeout=30)
        log.close()
        try:
            _assert_none_left(tmpdir)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``docs/`` (200 files of 10 B to 20 KB), ``tok.py`` (bytes to int32 token ids) and the local prepare of them
    (``--workers 0``, 64 KB shards) in ``local/``."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _make_input(root, 200, seed=0)
    (root / "tok.py").write_text(TOK)
    env = _env(None)  # no Ray here
    _ok(
        _prepare(
            root, env, docs, "--output", root / "local", "--map", "tok:encode", "--shard-size", "64KB", "--workers", 0
        )
    )
    return root


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory):
    """``docs/`` (40 files, ``b/f0013.txt`` starting with ``BAD``) and ``bad.py`` (a map raising on it)."""
    root = tmp_path_factory.mktemp("bad")
    _make_input(root, 40, seed=1, bad=BAD_FILE)
    (root / "bad.py").write_text(BAD)
    return root


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.optin
def test_ray_local_cluster_same_bytes_as_local(corpus, tmp_path):
    """``prepare(..., ray=True)`` without an address starts a new local cluster, writes the same bytes as the local
    runs (``--workers 0`` and ``--workers 2``), shuts that cluster down and leaves no Ray process."""
    _ok(
        _prepare(
            corpus,
            _env(None),
            corpus / "docs",
            "--output",
            tmp_path / "workers2",
            "--map",
            "tok:encode",
            "--shard-size",
            "64KB",
            "--workers",
            2,
        )
    )
    _assert_same_tree(tmp_path / "workers2", corpus / "local")
    script = textwrap.dedent(
        """\
        import json, sys
        import ray
        from quern.prepare import prepare

        m = prepare(sys.argv[1], sys.argv[2], map="tok:encode", shard_size="64KB", ray=True, num_workers=2, progress=False)
        assert not ray.is_initialized(), "prepare left Ray initialised"
        print(json.dumps(m["records"]))
        """
    )
    tmpdir = _short_tmpdir()
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, str(corpus / "docs"), str(tmp_path / "ray")],
            cwd=corpus,
            env=_env(tmpdir),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        _ok(out)
        assert os.listdir(tmpdir), "the local cluster did not use RAY_TMPDIR: the check of its processes is void"
        _assert_none_left(tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {"count": 200, "type": "array", "dtype": "int32"}
    _assert_same_tree(tmp_path / "ray", corpus / "local")


def _same_bytes_as_local(corpus, ray_head, tmp_path) -> None:
    """The smoke test: ``--ray-address`` of a running cluster writes every shard as a Ray task; the folder is
    byte-identical to the local run's (shards, metadata, manifest; nothing else left)."""
    drivers = os.path.join(ray_head["tmpdir"], "session_latest", "logs", "python-core-driver-*")
    before = set(glob.glob(drivers))
    out = _ok(
        _prepare(
            corpus,
            ray_head["env"],
            corpus / "docs",
            "--output",
            tmp_path / "ray",
            "--map",
            "tok:encode",
            "--shard-size",
            "64KB",
            "--ray-address",
            ray_head["address"],
        )
    )
    assert "prepared 200 records" in out.stdout
    assert set(glob.glob(drivers)) - before, "prepare did not connect to the cluster (no new driver log there)"
    tree = _assert_same_tree(tmp_path / "ray", corpus / "local")
    shards = [name for name in tree if name.endswith(".array_record")]
    assert len(shards) > 1
    assert not any(name.startswith(".quern-prepare") for name in tree)
    m = _manifest(tmp_path / "ray")
    assert m["records"] == {"count": 200, "type": "array", "dtype": "int32"}
    assert len(m["shards"]) == len(shards) and sum(s["records"] for s in m["shards"]) == 200
    assert m["skipped"]["count"] == 0


def _map_error_names_the_file(bad_corpus, ray_head, tmp_path) -> None:
    """A map raising on one record under Ray: exit status 1 and the one message a local run gives (``quern: prepare:
    FILE: the map raised ...``), without the Ray task's traceback; no manifest."""
    args = [bad_corpus / "docs", "--map", "bad:encode", "--shard-size", "16KB"]
    local = _prepare(bad_corpus, ray_head["env"], *args, "--output", tmp_path / "local", "--workers", 0)
    on_ray = _prepare(
        bad_corpus, ray_head["env"], *args, "--output", tmp_path / "ray", "--ray-address", ray_head["address"]
    )
    assert local.returncode == 1, local.stderr
    expected = f"quern: prepare: {os.path.join('docs', BAD_FILE)}: the map raised ValueError: this record is bad"
    assert _error_line(local.stderr) == expected
    assert on_ray.returncode == 1, on_ray.stderr
    assert os.path.join("docs", BAD_FILE) in on_ray.stderr and "this record is bad" in on_ray.stderr, on_ray.stderr
    assert _error_line(on_ray.stderr) == expected, f"not the local run's one message; stderr:\n{on_ray.stderr}"
    assert not os.path.exists(tmp_path / "ray" / "manifest.json")


@pytest.mark.slow
@pytest.mark.optin
def test_ray_skip_errors_same_bytes_as_local(bad_corpus, ray_head, tmp_path):
    """With ``--skip-errors`` under Ray the record is skipped, counted and named in the manifest, and the folder is
    byte-identical to the local run's."""
    args = [bad_corpus / "docs", "--map", "bad:encode", "--shard-size", "16KB", "--skip-errors"]
    _ok(
        _prepare(bad_corpus, ray_head["env"], *args, "--output", tmp_path / "ray", "--ray-address", ray_head["address"])
    )
    _ok(_prepare(bad_corpus, ray_head["env"], *args, "--output", tmp_path / "local", "--workers", 0))
    _assert_same_tree(tmp_path / "ray", tmp_path / "local")
    m = _manifest(tmp_path / "ray")
    assert m["skipped"]["count"] == 1 and len(m["skipped"]["first"]) == 1
    assert m["skipped"]["first"][0]["where"] == f"docs/{BAD_FILE}"
    assert "this record is bad" in m["skipped"]["first"][0]["error"]
    assert m["records"]["count"] == 39 and len(m["shards"]) > 1


def _refuses_a_map_whose_global_changed_at_run_time(ray_head, tmp_path) -> None:
    """A Ray task imports an installed map's module again (a fresh process) and would see its global's import-time
    value: it refuses, naming the global, and prepare fails with that message instead of writing other records."""
    import sysconfig
    import uuid

    name = f"quern_test_raymap_{uuid.uuid4().hex[:12]}"
    module = os.path.join(sysconfig.get_paths()["purelib"], f"{name}.py")  # installed: imported by name there
    with open(module, "w") as f:
        f.write("THR = 0\n\n\ndef cut(rec):\n    return rec[:THR] if THR else rec\n")
    docs = _make_input(tmp_path, 20, seed=2)
    script = f"""
import {name} as mod
from quern.prepare import PrepareError, prepare
mod.THR = 50  # after import: the driver's definition has 50, a Ray worker's fresh import 0
try:
    prepare({docs!r}, {str(tmp_path / "out")!r}, map=mod.cut, shard_size="16KB", ray=True,
            ray_address={ray_head["address"]!r}, progress=False)
    print("NO ERROR")
except PrepareError as e:
    print("ERROR", e)
"""
    try:
        out = subprocess.run(
            [sys.executable, "-c", script], env=ray_head["env"], capture_output=True, text=True, timeout=TIMEOUT
        )
    finally:
        os.remove(module)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith(("ERROR", "NO ERROR"))]
    assert line and line[0].startswith("ERROR"), out.stdout + out.stderr[-4000:]
    assert f"global `{name}.THR` is 0 here and 50 in the parent" in line[0]
    assert "Ray task" in line[0]
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_ray_address_same_bytes_a_map_error_and_a_changed_global(corpus, bad_corpus, ray_head, tmp_path):
    """Three checks against one running head, as one test (the module's head fixture would start a head for each
    test worker that ran one of them): the same bytes as a local run, a map's error naming the file, a map whose
    global changed at run time refused. Each runs; each that fails is named."""
    failed = []
    for check, args in (
        (_same_bytes_as_local, (corpus, ray_head, tmp_path / "same")),
        (_map_error_names_the_file, (bad_corpus, ray_head, tmp_path / "error")),
        (_refuses_a_map_whose_global_changed_at_run_time, (ray_head, tmp_path / "global")),
    ):
        args[-1].mkdir()
        try:
            check(*args)
        except Exception as e:  # noqa: BLE001 - every check runs, and each that fails is named
            failed.append(f"{check.__name__}: {check.__doc__}\n{type(e).__name__}: {e}")
    assert not failed, "\n\n".join(failed)
