"""Real Ray nodes on 127.0.0.1 for tests: a head and nodes joined to it, each ``ray start --block`` of its own.

Each node has its own ports and temporary folder (short: Ray's socket paths are limited) and the token of this
test run (``RAY_AUTH_MODE=token``; ``~/.ray`` is not used). A node is stopped by signalling its ``ray start``
process group, never with ``ray stop`` (which stops every Ray process of the machine, other users' too), and
:func:`assert_none_left` then checks that no process of it is left: they are found by its temporary folder,
which is in the command line of ``ray start``, GCS and raylet and in the environment of its workers (as
``RAY_TMPDIR``), and by the session of ``ray start``, which its agents (renamed ``ray::DashboardAgent``...,
without ``RAY_TMPDIR``) are in.

The model is ``tests/test_prepare_ray.py`` (its ``ray_head`` fixture); this module is what tests of more than one
node share. A test process using it holds no Ray state (it imports Ray only to see whether ``ray[client]`` is
installed).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

__all__ = ["TOKEN", "RayNode", "assert_none_left", "env", "free_ports", "ray_processes", "short_tmpdir"]

TOKEN = secrets.token_hex(32)  # the clusters' token (Ray versions with token authentication)
START_TIMEOUT = 180.0  # seconds a node may take to start


def env(tmpdir: str | None, **extra: str) -> dict[str, str]:
    """The environment of the Ray processes and drivers run here: usage stats off, token authentication with
    :data:`TOKEN`, no drain wait on SIGTERM, Ray's files under ``tmpdir``, no ``RAY_`` variable inherited;
    ``extra`` added (e.g. ``RAY_health_check_period_ms="500"``)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=TOKEN,
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
    )
    if tmpdir is not None:
        out["RAY_TMPDIR"] = tmpdir
    out.update(extra)
    return out


def short_tmpdir() -> str:
    return tempfile.mkdtemp(prefix="qr", dir="/tmp" if os.path.isdir("/tmp") else None)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports of 127.0.0.1 free now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_processes(tmpdir: str, session: int | None = None) -> list[psutil.Process]:
    """The live processes of the Ray node(s) whose files are in ``tmpdir``: those whose command line names it
    (``ray start``, GCS, raylet), whose environment has it as ``RAY_TMPDIR`` (the workers, which rename themselves
    ``ray::...``), or that are in the session ``session`` (that of ``ray start``: the raylet's agents rename
    themselves ``ray::DashboardAgent``... and have no ``RAY_TMPDIR``, and may outlive their raylet)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            ours = any(tmpdir in a for a in p.info["cmdline"] or ())
            if not ours and session is not None:
                try:  # (a session id reused by then would hold no Ray process)
                    ours = os.getsid(p.pid) == session and "ray" in " ".join(p.info["cmdline"] or ()).lower()
                except OSError:
                    ours = False
            if not ours:
                try:
                    ours = p.environ().get("RAY_TMPDIR") == tmpdir
                except psutil.AccessDenied:  # another user's process: not ours
                    ours = False
            if ours and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def assert_none_left(tmpdir: str, grace: float = 15.0, session: int | None = None) -> None:
    """Wait up to ``grace`` seconds for the processes of the node(s) in ``tmpdir`` (and session ``session``) to end;
    kill (by pid) and name those still there."""
    deadline = time.monotonic() + grace
    left = ray_processes(tmpdir, session)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ray_processes(tmpdir, session)
    names = []
    for p in left:
        try:
            names.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    assert not names, "Ray processes left behind:\n" + "\n".join(names)


def _ray_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "ray")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def _with_client() -> bool:
    """The Ray client server (default port 10001) runs only with ``ray[client]``: its port is given only then."""
    try:
        from ray._private.utils import get_ray_client_dependency_error
    except ImportError:
        return False
    return get_ray_client_dependency_error() is None


class RayNode:
    """One Ray node on 127.0.0.1, ``ray start --block`` in a process group of its own, with its own temporary
    folder and ports.

    Args:
        head: address of the head to join (``HOST:PORT``); ``None``: this node is a head.
        num_cpus: the node's CPUs.
        object_store_memory: bytes of its object store.
        extra_env: variables added to the node's environment (:func:`env`).

    Use as a context manager: :meth:`stop` (and the check that none of its processes is left) at the end.
    """

    def __init__(
        self,
        head: str | None = None,
        *,
        num_cpus: int = 1,
        object_store_memory: int = 100_000_000,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.tmpdir = short_tmpdir()
        self.env = env(self.tmpdir, **(extra_env or {}))
        self.is_head = head is None
        port, client, dash, agent_http, agent_grpc, metrics, runtime_env, node, objects = free_ports(9)
        command = [
            *_ray_command(),
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--object-store-memory={object_store_memory}",
            "--disable-usage-stats",
            f"--temp-dir={self.tmpdir}",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--node-manager-port={node}",
            f"--object-manager-port={objects}",
        ]
        if self.is_head:
            command += [
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--dashboard-port={dash}",
                *([f"--ray-client-server-port={client}"] if _with_client() else []),
            ]
            self.address = f"127.0.0.1:{port}"
        else:
            command.append(f"--address={head}")
            self.address = head
        self.log_path = os.path.join(self.tmpdir, "ray-start.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while "Ray runtime started" not in self.log():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with status {self.proc.returncode}:\n{self.log()[-4000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray node did not start in {START_TIMEOUT:g} s:\n{self.log()[-4000:]}")
                time.sleep(0.2)
        except BaseException:
            self.stop(check=False)
            raise

    def log(self) -> str:
        """What ``ray start`` printed so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL to every process of the node at once: its ``ray start`` process group, the rest of its session
        (agents) and its workers (which the raylet starts in sessions of their own: found by their ``RAY_TMPDIR``;
        SIGKILL to the group alone leaves an actor answering for a while). The node dies as a machine that loses
        power: nobody is told, and no actor of it computes anything more."""
        procs = ray_processes(self.tmpdir, self.proc.pid)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 60.0) -> None:
        """SIGTERM to ``ray start --block``, which stops the processes it started; SIGKILL after ``timeout`` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def stop(self, check: bool = True, grace: float = 15.0) -> None:
        """Terminate the node (if it still runs), then check none of its processes is left (``check``: raise if
        one was; they are killed by pid either way), and remove its folder. Idempotent."""
        try:
            self.terminate()
            self._log.close()
            if check:
                assert_none_left(self.tmpdir, grace, self.proc.pid)
            else:
                try:
                    assert_none_left(self.tmpdir, grace, self.proc.pid)
                except AssertionError:
                    pass
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> RayNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
