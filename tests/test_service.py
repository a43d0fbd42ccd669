"""``pipe.iterator(service=quern.RayService(...))`` on a real local Ray cluster: the same bytes as ``batch_at``.

Each test runs a driver script in a subprocess (with a timeout), so this process holds no Ray state; the script
starts its own local cluster (``RayService(None, num_cpus=N)``, on 127.0.0.1), checks every batch against
``pipe.batch_at`` itself and prints its figures as JSON on its last line, which the test asserts on. Four
scenarios (too many actors, dead actors, a failing step, a straggler) share one driver and one cluster of 2 CPUs, which it starts
with ``ray.init`` so that each service joins it (a cluster costs seconds of CPU); one test checks each scenario's
part. A cluster that ``RayService`` starts itself, and shuts down at ``close()``, is the first and the bad-input
tests'. A cluster
started by ``RayService`` is shut down by ``close()``; the test then checks no process of it is left (Ray's
processes carry the cluster's temporary folder in their command line). The two-node and cluster-gone cases are
in ``test_service_cluster.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
from helpers import parquet_config, parquet_folder, quern_cmd

pytest.importorskip("ray", reason="Ray is not installed (pip install 'quern[ray]'): quern.RayService")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 240

PRELUDE = """
import json, os, sys, time
import numpy as np
import quern

TMP = sys.argv[1]


def scaled(r):
    return {"x": r["x"] * 3 + 1, "y": np.full(5, r["x"][0] % 7, dtype=np.float32)}


def pipeline(n=6000, batch=32):
    src = quern.sources.ArraySource({"x": np.arange(n * 2, dtype=np.int64).reshape(n, 2)})
    return quern.Pipeline.from_source(src, seed=11).shuffle().map(scaled).batch(batch)


def same(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def done(**figures):
    print(json.dumps(figures))
"""


def _driver(body: str, tmp_path) -> dict:
    """Run PRELUDE + ``body`` in a fresh Python with its own Ray temp folder; the JSON of its last line."""
    script = tmp_path / "driver.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    ray_tmp = tempfile.mkdtemp(prefix="qs", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp)  # the installed quern
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    try:
        out = subprocess.run(
            [sys.executable, str(script), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=env,
            cwd=tmp_path,
        )
        assert out.returncode == 0, (
            f"driver exited {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr[-6000:]}"
        )
        _assert_none_left(ray_tmp)
    finally:
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_none_left(ray_tmp: str) -> None:
    """No process whose command line names the cluster's temp folder (Ray's own) is still running."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(ray_tmp in part for part in (p.info["cmdline"] or [])):
                left.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=20)
    assert not alive, f"Ray processes left running: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.mark.slow
def test_same_bytes_as_batch_at_with_one_and_two_actors_and_two_hosts(tmp_path):
    """1 and 2 actors give batch_at's bytes; two hosts share a service; resuming with another host count works."""
    got = _driver(
        """
        pipe = pipeline()
        one = quern.RayService(num_actors=1, num_cpus=3)  # starts the local cluster (close() stops it)
        two = quern.RayService(num_actors=2)  # the same cluster, two more actors
        assert one.address.startswith("the local cluster at "), one.address
        steps = 40
        for svc in (one, two):
            with pipe.iterator(service=svc) as it:
                for s in range(steps):
                    assert same(next(it), pipe.batch_at(s)), (svc, s)
                stats = it.stats()["service"]
            assert stats["actors"] == svc.num_actors and stats["units"] >= 1, stats
        assert stats["delivered_by_actor"][0] > 0 and stats["delivered_by_actor"][1] > 0, stats
        # two trainer hosts share `two`: their slices side by side are the global batch
        h0 = pipe.iterator(service=two, process_index=0, process_count=2)
        h1 = pipe.iterator(service=two, process_index=1, process_count=2)
        with h0, h1:
            for s in range(20):
                a, b = next(h0), next(h1)
                assert same(a, pipe.batch_at(s, 0, 2)) and same(b, pipe.batch_at(s, 1, 2))
                glued = {k: np.concatenate([a[k], b[k]]) for k in a}
                assert same(glued, pipe.batch_at(s)), s
            state = h0.state()
        # elastic resume: one host from the two hosts' state, through the same service
        with pipe.resume(state, service=two) as it:
            for s in range(20, 30):
                assert same(next(it), pipe.batch_at(s)), s
        # a ledger through the service holds the digests local workers give
        with pipe.iterator(service=two, ledger=os.path.join(TMP, "svc.jsonl")) as it:
            for _ in range(8):
                next(it)
        with pipe.iterator(ledger=os.path.join(TMP, "local.jsonl")) as it:
            for _ in range(8):
                next(it)
        rows = [[json.loads(l)["row_digests"] for l in open(os.path.join(TMP, f))] for f in ("svc.jsonl", "local.jsonl")]
        assert rows[0] == rows[1] and len(rows[0]) == 8
        with pipe.iterator(service=two) as it:  # Ray's arrays are read-only views of its object store...
            lent = next(it)["x"].flags.writeable
        with pipe.iterator(service=two, copy_batches=True) as it:  # ...copy_batches=True copies them
            copied = next(it)["x"].flags.writeable
        actors = len(two.actors)
        two.close()
        one.close()
        import ray
        done(actors=actors, ray_left=ray.is_initialized(), lent=lent, copied=copied)
        """,
        tmp_path,
    )
    assert got == {"actors": 2, "ray_left": False, "lent": False, "copied": True}


SCENARIOS = """
import signal, traceback
import ray

# one local cluster for the four scenarios (each service joins it, and its close() leaves it running); 2 CPUs
# as each scenario had on its own: its 2 actors fill it, so a dead actor's replacement waits for its CPU
ray.init(
    address="local", _node_ip_address="127.0.0.1", num_cpus=2, object_store_memory=512 << 20,
    include_dashboard=False, log_to_driver=False, configure_logging=False,
)
results = {}


def scenario(fn):
    try:
        results[fn.__name__] = fn()
    except BaseException as e:  # the others still run; the test names this one and shows its error
        results[fn.__name__] = {"error": "".join(traceback.format_exception(e))[-4000:]}
    return fn


@scenario
def too_many_actors():  # more actors than the cluster joined has CPUs: refused, naming it; the cluster runs on
    try:
        quern.RayService(num_actors=5)
    except quern.ServiceError as e:
        return dict(message=str(e), ray_left=ray.is_initialized())
    return dict(message=None)


@scenario
def dead_actors():
    pipe = pipeline()
    svc = quern.RayService(num_actors=2, hedge_after=None)
    try:  # closed whatever happens: the next scenario's actors need the CPUs
        with pipe.iterator(service=svc) as it:
            for s in range(400):  # a dead actor is found when a unit sent to it is waited for
                if s == 20:
                    ray.kill(svc.actors[0], no_restart=True)
                if s == 70:
                    svc.wait_ready()  # the replacement of the first has loaded the pipeline
                    os.kill(ray.get(svc.actors[1].pid_of.remote()), signal.SIGKILL)
                assert same(next(it), pipe.batch_at(s)), s
                if s > 70 and it.stats()["service"]["actors_replaced"] >= 2:
                    break
            svc.wait_ready()
            return it.stats()["service"]
    finally:
        svc.close()


@scenario
def failing_step():
    def picky(r):
        if r["x"][0] == 2 * 777:
            raise ValueError("record 777 is bad")
        return r

    pipe = quern.Pipeline.from_source(
        quern.sources.ArraySource({"x": np.arange(4000, dtype=np.int64).reshape(2000, 2)}), seed=1
    ).shuffle().map(picky).batch(20)
    local = None
    with pipe.iterator() as it:
        for s in range(100):
            try:
                next(it)
            except quern.StepError as e:
                local = (s, str(e).splitlines()[0])
                break
    assert local is not None
    svc = quern.RayService(num_actors=2)
    try:
        with pipe.iterator(service=svc) as it:
            for s in range(local[0]):
                assert same(next(it), pipe.batch_at(s))
            try:
                next(it)
            except quern.StepError as e:
                remote = str(e).splitlines()[0]
                cause = type(e.__cause__).__name__
            try:
                next(it)  # asked again: computed again, and it fails again
            except quern.StepError as e:
                again = str(e).splitlines()[0]
    finally:
        svc.close()
    return dict(local=local[1], remote=remote, again=again, cause=cause)


@scenario
def straggler():
    def sluggish(b):
        if os.path.exists(os.path.join(TMP, f"slow-{os.getpid()}")):
            time.sleep(1.5)
        return b

    pipe = pipeline().map_batch(sluggish)
    svc = quern.RayService(num_actors=2, hedge_after=2.0, hedge_min_s=0.3)
    try:
        with pipe.iterator(service=svc, read_ahead=2) as it:
            for s in range(10):
                assert same(next(it), pipe.batch_at(s)), s
            slow = ray.get(svc.actors[0].pid_of.remote())
            open(os.path.join(TMP, f"slow-{slow}"), "w").close()
            t1 = time.monotonic()
            for s in range(10, 90):
                assert same(next(it), pipe.batch_at(s)), s
            seconds = time.monotonic() - t1
            stats = it.stats()["service"]
    finally:
        svc.close()
    return dict(seconds=seconds, **stats)


ray.shutdown()
done(**results)
"""


def _too_many_actors(got: dict) -> None:
    """RayService(num_actors=5) on the 2-CPU cluster this process joined: a ServiceError naming the cluster."""
    message = got["message"]
    assert message is not None and "has 2 CPUs: num_actors=5 x num_cpus_per_actor=1 needs 5" in message, got
    assert message.startswith("the local cluster at ") and "ask for fewer actors, or add nodes" in message, got
    assert got["ray_left"] is True, got  # a cluster the service did not start is left as it was


def _dead_actors(got: dict) -> None:
    """ray.kill of one actor and SIGKILL of another's process: every batch still equals batch_at."""
    assert got["actors_replaced"] >= 2, got
    assert got["recomputations"] >= 1, got
    assert got["actors"] == 2, got


def _failing_step(got: dict) -> None:
    """A map that raises on one record: the service's StepError names the step, host and stage as the local one's."""
    assert got["remote"] == got["local"] == got["again"], got
    assert "host 0 of 1" in got["remote"] and "picky" in got["remote"], got
    assert got["cause"] == "ValueError"


def _straggler(got: dict) -> None:
    """An actor that sleeps on its units: they are also asked of the other actor; the first answer is used."""
    assert got["hedges"] >= 1, got
    # 40 units of 2 steps, half of them first sent to the sleeping actor: without hedging about 20 x 1.5 s
    assert got["seconds"] < 20, got


@pytest.mark.slow
def test_too_many_actors_dead_actors_a_failing_step_and_a_straggler_on_one_cluster(tmp_path):
    """Four scenarios on one cluster (one test: a fixture would run once per test worker); each is checked."""
    got = _driver(SCENARIOS, tmp_path)
    failed = []
    checks = [("too_many_actors", _too_many_actors), ("dead_actors", _dead_actors)]
    checks += [("failing_step", _failing_step), ("straggler", _straggler)]
    for name, check in checks:
        try:
            assert "error" not in got[name], got[name].get("error")
            check(got[name])
        except Exception as e:  # noqa: BLE001 - every scenario is checked, and each that fails is named
            failed.append(f"{name}: {check.__doc__}\n{type(e).__name__}: {e}")
    assert not failed, "\n\n".join(failed)


@pytest.mark.slow
def test_bad_input_is_a_clear_error_and_nothing_is_left(tmp_path):
    """An unreachable address, too few CPUs, an unpicklable stage, service= with workers, a closed service."""
    got = _driver(
        """
        import socket, threading
        import ray
        errors = {}
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        t0 = time.monotonic()
        try:
            quern.RayService(f"127.0.0.1:{port}")
        except quern.ServiceError as e:
            errors["unreachable"] = str(e)
        errors["unreachable_s"] = time.monotonic() - t0
        try:
            quern.RayService(num_actors=5, num_cpus=2)
        except quern.ServiceError as e:
            errors["cpus"] = str(e)
        errors["ray_after_cpus"] = ray.is_initialized()
        pipe = pipeline()
        svc = quern.RayService(num_cpus=2)  # num_actors: the cluster's CPUs over num_cpus_per_actor
        errors["default_actors"] = svc.num_actors
        lock = threading.Lock()
        bad = pipe.map_batch(lambda b: (lock, b)[1])
        try:
            bad.iterator(service=svc)
        except TypeError as e:
            errors["pickle"] = str(e)
        try:
            pipe.iterator(service=svc, num_workers=2)
        except ValueError as e:
            errors["workers"] = str(e)
        class Here:  # a source whose identity differs in every process: the actors compute another definition
            def __len__(self):
                return 100

            def __getitem__(self, i):
                return {"x": np.array([i])}

            def identity(self):
                return {"type": "Here", "pid": os.getpid()}

        other = quern.RayService(num_actors=1)
        try:
            quern.Pipeline.from_source(Here(), seed=0).batch(10).iterator(service=other)
        except quern.ServiceError as e:
            errors["fingerprint"] = str(e)
        other.close()
        it = pipe.iterator(service=svc)
        next(it)
        svc.close()
        try:
            next(it)
        except quern.ServiceError as e:
            errors["closed"] = str(e)
        it.close()
        errors["ray_after_close"] = ray.is_initialized()
        done(**errors)
        """,
        tmp_path,
    )
    assert "cannot reach the Ray cluster at 127.0.0.1:" in got["unreachable"], got
    assert got["unreachable_s"] < 10, got
    assert "has 2 CPUs" in got["cpus"] and "num_actors=5" in got["cpus"], got
    assert got["cpus"].startswith("the new local cluster has 2 CPUs"), got  # refused before a cluster started
    assert got["ray_after_cpus"] is False
    assert got["default_actors"] == 2, got
    assert "stage map_batch[0]" in got["pickle"] and "cannot be pickled" in got["pickle"], got
    assert "num_workers=2" in got["workers"], got
    assert "closed" in got["closed"], got
    assert "actor 0 (pid " in got["fingerprint"] and "fingerprint" in got["fingerprint"], got
    assert "in the actor" in got["fingerprint"] and "in the trainer" in got["fingerprint"], got
    assert got["ray_after_close"] is False


@pytest.mark.slow
def test_quern_run_ray(tmp_path):
    """``quern run --ray --actors 2`` runs the steps on a new local cluster and reports the service; bad flags exit 2."""
    cfg = parquet_config(parquet_folder(tmp_path), [], name="c.yaml", shuffle="global", seed=3)
    ray_tmp = tempfile.mkdtemp(prefix="qr", dir="/tmp")
    env = {"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
    try:
        out = quern_cmd("run", cfg, "--ray", "--actors", "2", "--steps", "8", env=env, pythonpath=None)
        assert out.stdout.startswith("8 steps, 32 records in "), out.stdout
        assert "service: 2 actors on the local cluster at " in out.stdout, out.stdout
        _assert_none_left(ray_tmp)
        bad = quern_cmd("run", cfg, "--actors", "2", check=False, env=env, pythonpath=None)
        assert bad.returncode == 2 and "--actors applies to --ray" in bad.stderr, bad.stderr
        both = quern_cmd("run", cfg, "--ray", "--workers", "2", check=False, env=env, pythonpath=None)
        assert both.returncode == 2 and "--workers does not apply" in both.stderr, both.stderr
    finally:
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_actors": 0},
        {"num_actors": True},
        {"num_cpus_per_actor": 0},
        {"hedge_after": 0.5},
        {"hedge_min_s": -1},
        {"gone_after": 0.5},
        {"gone_after": 46},
        {"gone_after": True},
        {"gone_after": "3"},
    ],
    ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_bad_arguments_are_value_errors_naming_them_before_ray_is_touched(kwargs):
    """Each bad argument is a ValueError naming it, raised before Ray is initialised in this process."""
    import quern

    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        quern.RayService(**kwargs)
    assert not sys.modules["ray"].is_initialized()
