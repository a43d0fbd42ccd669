"""``pipe.iterator(service=quern.RayService(address))`` on real Ray clusters of this machine: nodes that die.

Every cluster is ``ray start --block`` processes on 127.0.0.1 (:mod:`raycluster`: their own ports, temporary folders
and token), stopped by signalling their process groups, never with ``ray stop``; afterwards no process of them may
be left. The Ray driver of each test is a subprocess (``DRIVER``, run with a timeout), so this process holds no Ray
state; it prints ``RESULT`` JSON lines of what it saw, which the test asserts on. The test and the driver meet
through files: the driver writes ``sync/ready`` when it wants a node stopped, the test stops it and writes
``sync/killed``.

- Two nodes, the second killed (every process of it SIGKILLed) while the iterator runs: its actor is replaced on
  the head, its units computed again, and every batch is still ``pipe.batch_at(step)``.
- The head stopped: ``next()`` raises :class:`quern.ServiceError` naming the address within 30 s, and the driver
  is disconnected from Ray rather than ended by it later (the ``optin`` variant waits 75 s to see that). The driver
  runs on a node of its own (a trainer's machine is a Ray node of the cluster): a driver whose raylet is the
  head's is ended by Ray itself the moment the head stops ("the connection to the plasma store is failed"),
  before quern can say anything.

The default run takes about 45 s; the two ``optin`` ones (``pytest -m optin``) about 3 minutes more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'quern[ray]'): quern.RayService")
pytest.importorskip("psutil")

from helpers import parquet_config, parquet_folder, quern_cmd  # noqa: E402
from raycluster import RayNode, free_ports  # noqa: E402  (after the skip: it needs psutil)

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 180  # seconds a driver may run
TESTS = os.path.dirname(os.path.abspath(__file__))
FAST_DEATH = {  # the head declares a silent node dead in about 2 s (defaults: 30 s)
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

DRIVER = r"""
import json, os, sys, time

import numpy as np
import ray

import quern

sys.path.insert(0, os.environ["QUERN_TESTS"])
from helpers import batches_equal

mode, address, sync = sys.argv[1], sys.argv[2], sys.argv[3]
steps, pause_at = int(sys.argv[4]), int(sys.argv[5])


def work(rec):  # some 30 us of numpy per record: about 2 ms a batch
    x = rec["x"]
    v = np.sin(np.arange(256, dtype=np.float64) * float(x[0] % 97))
    return {"x": x, "y": np.float64(np.sort(v)[::7].sum())}


def signal_and_wait():
    # ask the test to stop a node; return once it has (the time it said so)
    open(os.path.join(sync, "ready"), "w").close()
    killed = os.path.join(sync, "killed")
    deadline = time.monotonic() + 120
    while not os.path.exists(killed):
        if time.monotonic() > deadline:
            raise SystemExit("the test did not stop the node in 120 s")
        time.sleep(0.05)
    return time.monotonic()


source = quern.sources.ArraySource({"x": np.arange(20000 * 4, dtype=np.int64).reshape(-1, 4)})
pipe = quern.Pipeline.from_source(source, seed=0).shuffle().map(work).batch(64)
out = {"wrong": []}
if os.environ.get("DRIVER_NODE_TMPDIR"):  # the driver on that node (Ray would pick the head), as a trainer's own
    ray.init(
        address=address,
        _temp_dir=os.environ["DRIVER_NODE_TMPDIR"],
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
svc = quern.RayService(
    address, num_actors=int(os.environ.get("NUM_ACTORS", "2")), gone_after=float(os.environ.get("GONE_AFTER", "10"))
)
try:
    with pipe.iterator(service=svc, read_ahead=2) as it:
        hellos = [ray.get(a.hello.remote(), timeout=60) for a in svc.actors]
        out["actor_nodes"] = [h.node for h in hellos]
        out["actor_pids"] = [ray.get(a.pid_of.remote(), timeout=60) for a in svc.actors]
        out["driver_node"] = ray.get_runtime_context().get_node_id()
        if mode == "node-dies":
            for step in range(steps):
                if step == pause_at:
                    signal_and_wait()
                if not batches_equal(next(it), pipe.batch_at(step)):
                    out["wrong"].append(step)
            out["steps"] = steps
            out["live_before_wait"] = len(svc.actors)
            svc.wait_ready(60)  # the replacement's hello, if the feed has not looked at it yet
            out["stats"] = it.stats()["service"]
            out["after_nodes"] = [ray.get(a.hello.remote(), timeout=60).node for a in svc.actors]
        else:  # head-dies
            for step in range(pause_at):
                if not batches_equal(next(it), pipe.batch_at(step)):
                    out["wrong"].append(step)
            killed_at = signal_and_wait()
            after = 0
            try:
                for step in range(pause_at, pause_at + 100000):
                    if not batches_equal(next(it), pipe.batch_at(step)):
                        out["wrong"].append(step)
                    after += 1
                out["error"] = None
            except quern.ServiceError as e:
                out["error"] = str(e)
            except Exception as e:
                out["error"] = None
                out["other_error"] = f"{type(e).__name__}: {e}"
            out["elapsed"] = time.monotonic() - killed_at
            out["steps_after_kill"] = after
            out["ray_initialized"] = ray.is_initialized()
finally:
    svc.close()
out["ray_initialized_after_close"] = ray.is_initialized()
print("RESULT " + json.dumps(out), flush=True)
if mode == "head-dies" and float(os.environ.get("LINGER", "0")):
    time.sleep(float(os.environ["LINGER"]))  # Ray, were it still connected, would end this process by now
    print("RESULT " + json.dumps({"alive": True}), flush=True)
"""


def _driver(tmp_path, address: str, via: RayNode, mode: str, steps: int, pause_at: int, **env: str):
    """Start ``DRIVER`` against the cluster at ``address``, with the environment of node ``via`` (its output in
    ``tmp_path/driver.out``, ``.err``)."""
    sync = tmp_path / "sync"
    sync.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    with open(tmp_path / "driver.out", "w") as out, open(tmp_path / "driver.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, str(script), mode, address, str(sync), str(steps), str(pause_at)],
            cwd=tmp_path,
            env={**via.env, "QUERN_TESTS": TESTS, **env},
            stdout=out,
            stderr=err,
        )


def _wait_ready(tmp_path, driver: subprocess.Popen, timeout: float = TIMEOUT) -> None:
    """Wait until the driver writes ``sync/ready``."""
    deadline = time.monotonic() + timeout
    while not (tmp_path / "sync" / "ready").exists():
        if driver.poll() is not None:
            pytest.fail(
                f"the driver exited with status {driver.returncode} before asking for the kill\n{_out(tmp_path)}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"the driver did not ask for the kill in {timeout:g} s\n{_out(tmp_path)}")
        time.sleep(0.05)


def _out(tmp_path) -> str:
    return (
        f"stdout:\n{(tmp_path / 'driver.out').read_text()[-4000:]}\n"
        f"stderr:\n{(tmp_path / 'driver.err').read_text()[-6000:]}"
    )


def _finish(tmp_path, driver: subprocess.Popen, timeout: float = TIMEOUT) -> list[dict]:
    """Wait for the driver to exit with status 0; its ``RESULT`` lines."""
    try:
        driver.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.wait(timeout=30)
        pytest.fail(f"the driver did not end in {timeout:g} s\n{_out(tmp_path)}")
    assert driver.returncode == 0, f"the driver exited with status {driver.returncode}\n{_out(tmp_path)}"
    lines = [line for line in (tmp_path / "driver.out").read_text().splitlines() if line.startswith("RESULT ")]
    assert lines, _out(tmp_path)
    return [json.loads(line[len("RESULT ") :]) for line in lines]


def _end(driver: subprocess.Popen | None) -> None:
    if driver is not None and driver.poll() is None:
        driver.kill()
        driver.wait(timeout=30)


# --------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_a_node_dying_changes_no_batch(tmp_path):
    """Two actors on two nodes; the second node dies (every process of it SIGKILLed) at step 40 of 200: its actor is
    replaced on the head (which has a CPU free for it), its units are computed again, and every batch, before and
    after, is ``pipe.batch_at(step)``. No process of either node is left."""
    driver = None
    with RayNode(num_cpus=2, extra_env=FAST_DEATH) as head, RayNode(head.address, num_cpus=1) as second:
        try:
            driver = _driver(tmp_path, head.address, head, "node-dies", steps=200, pause_at=40)
            _wait_ready(tmp_path, driver)
            second.kill()
            (tmp_path / "sync" / "killed").touch()
            (out,) = _finish(tmp_path, driver)
        finally:
            _end(driver)
        second.stop()  # nothing of the killed node may be left
    nodes = out["actor_nodes"]
    assert len(nodes) == 2 and len(set(nodes)) == 2, f"the two actors were not on two nodes: {out}"
    assert out["driver_node"] in nodes, out
    assert out["wrong"] == [], f"steps whose batch is not batch_at: {out['wrong']}"
    stats = out["stats"]
    assert stats["recomputations"] + stats["actors_replaced"] >= 1, stats
    assert stats["actors_replaced"] >= 1, stats
    assert stats["num_actors"] == 2 and stats["actors"] == 2, stats
    assert out["after_nodes"] == [out["driver_node"]] * 2, f"the replacement is not on the head: {out}"
    assert sum(stats["delivered_by_actor"]) == 200, stats
    assert not out["ray_initialized_after_close"], "close() did not shut down the Ray it initialised"


def _head_dies(tmp_path, linger: float, actor_on_head: bool = True) -> list[dict]:
    """A head and the trainer's node (the driver's raylet: Ray ends a driver whose raylet dies, so the driver must
    not be on the head's); the one actor on the head (``actor_on_head``) or on the trainer's node. The head is stopped
    (SIGTERM to its ``ray start --block``) at step 10; the driver's ``RESULT`` lines."""
    driver = None
    cpus = (1, 0) if actor_on_head else (0, 1)
    with RayNode(num_cpus=cpus[0]) as head, RayNode(head.address, num_cpus=cpus[1]) as trainer:
        try:
            driver = _driver(
                tmp_path,
                head.address,
                trainer,
                "head-dies",
                steps=0,
                pause_at=10,
                NUM_ACTORS="1",
                LINGER=str(linger),
                GONE_AFTER="3",  # RayService(gone_after=3): the head's refusals it waits through (default 10 s)
                DRIVER_NODE_TMPDIR=trainer.tmpdir,
            )
            _wait_ready(tmp_path, driver)
            head.terminate()
            (tmp_path / "sync" / "killed").touch()
            results = _finish(tmp_path, driver, timeout=TIMEOUT + linger)
        finally:
            _end(driver)
        # its head gone, the trainer's node cannot stop gracefully (its raylet waits to unregister, and its agents
        # outlive it by a minute or more): it is killed, and then none of its processes may be left
        trainer.kill()
    out = results[0]
    assert (out["actor_nodes"][0] != out["driver_node"]) == actor_on_head, out
    assert out["wrong"] == [], f"steps whose batch is not batch_at: {out['wrong']}"
    assert out.get("other_error") is None, out
    assert out["error"] is not None, f"next() went on after the head stopped: {out}"
    assert f"the Ray cluster at {head.address} is gone" in out["error"], out
    assert "has refused connections for 3 s" in out["error"], out
    assert "disconnected from Ray" in out["error"], out
    assert out["elapsed"] < 30, out
    assert not out["ray_initialized"], "the service did not disconnect this process from Ray"
    return results


@pytest.mark.slow
def test_the_head_dying_raises_service_error(tmp_path):
    """The head stopped while an iterator runs: after the batches already computed, ``next()`` raises
    :class:`quern.ServiceError` naming the cluster's address within 30 s, Ray is shut down in the driver, and the
    driver exits normally. No process of either node is left."""
    _head_dies(tmp_path, linger=0)


@pytest.mark.slow
@pytest.mark.optin
def test_the_head_dying_leaves_the_driver_alive(tmp_path):
    """As above, and then the driver lives on: 75 s later (past Ray's 60 s for the GCS to come back, after which a
    still-connected Ray would end the process) it is alive and exits normally."""
    results = _head_dies(tmp_path, linger=75)
    assert results[-1] == {"alive": True}, results


@pytest.mark.slow
@pytest.mark.optin
def test_the_head_dying_is_seen_while_an_actor_still_answers(tmp_path):
    """The head stopped while the one actor is on the trainer's node, which outlives the head: the actor still
    answers, yet ``next()`` must raise :class:`quern.ServiceError` in time (before Ray ends the process)."""
    _head_dies(tmp_path, linger=0, actor_on_head=False)


@pytest.mark.slow
def test_quern_run_ray_address(tmp_path):
    """``quern run --ray-address HOST:PORT --actors 1`` uses a running cluster, reports the service and leaves the
    cluster's own processes to it (only the actor ends); an unreachable address exits 1 naming it."""
    cfg = parquet_config(parquet_folder(tmp_path), [], name="c.yaml", shuffle="global", seed=3)
    with RayNode(num_cpus=1) as head:
        out = quern_cmd(
            "run", cfg, "--ray-address", head.address, "--actors", "1", "--steps", "6", env=head.env, pythonpath=None
        )
        assert out.stdout.startswith("6 steps, 24 records in "), out.stdout
        assert f"service: 1 actor on {head.address}" in out.stdout, out.stdout
        assert head.proc.poll() is None  # the cluster runs on
    port = free_ports(1)[0]
    bad = quern_cmd("run", cfg, "--ray-address", f"127.0.0.1:{port}", check=False, pythonpath=None)
    assert bad.returncode == 1 and f"cannot reach the Ray cluster at 127.0.0.1:{port}" in bad.stderr, bad.stderr
