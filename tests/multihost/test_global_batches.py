"""Real multi-process JAX on 127.0.0.1: global batches equal ``batch_at``, and a run
stopped on 2 hosts resumes on 1 host (with 2 quern worker processes) or on 4 hosts
with bit-identical global batches.

Each host is a subprocess (``run_host.py``) with ``jax.distributed.initialize``
and forced CPU devices; every run has a timeout, so a host whose peer never
arrives fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import free_port

import quern

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipelines import make_pipeline  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(
    processes: int, devices: int, start: int, steps: int, workers: int = 0, timeout: float = 180, mode: str = "host"
) -> dict:
    """Run ``processes`` hosts with ``devices`` CPU devices (and ``workers`` quern worker
    processes) each; process 0's JSON output."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "run_host.py"),
                str(i),
                str(processes),
                str(port),
                str(devices),
                str(start),
                str(steps),
                str(workers),
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "host done", out[-3000:]  # every host finished its steps
    return json.loads(outs[0][0].strip().splitlines()[-2])


def _expected(start: int, steps: int) -> list[dict]:
    pipe = make_pipeline()
    return [{k: np.asarray(v).tolist() for k, v in pipe.batch_at(s).items()} for s in range(start, start + steps)]


def test_global_batch_equals_batch_at():
    got = _run(processes=2, devices=2, start=5, steps=4)
    assert got["batches"] == _expected(5, 4)
    assert got["state"]["step"] == 9


@pytest.mark.slow
def test_stop_on_two_hosts_resume_on_one_or_four():
    whole = _run(processes=2, devices=2, start=0, steps=8)["batches"]
    assert whole == _expected(0, 8)  # the uninterrupted run is right, so the resumed ones are compared to truth
    stopped = _run(processes=2, devices=2, start=0, steps=3)
    k = stopped["state"]["step"]
    assert k == 3 and stopped["batches"] == whole[:3]
    for processes, devices, workers in [(1, 2, 2), (4, 1, 0)]:
        resumed = _run(processes=processes, devices=devices, start=k, steps=5, workers=workers)["batches"]
        assert resumed == whole[k:], (processes, devices, workers)


@pytest.mark.slow
def test_device_stages_give_the_same_global_batches_on_any_host_count():
    """map_device and random_map_device run under jit on the global arrays: the batches of 2 hosts x 2 devices
    equal global_batch_at's in this process (1 host, 1 device), and the rows before the device stages are
    batch_at's."""
    import jax
    from pipelines import make_device_pipeline

    two = _run(processes=2, devices=2, start=4, steps=3, mode="device")["batches"]
    pipe = make_device_pipeline()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    for i, s in enumerate(range(4, 7)):
        here = quern.sharding.global_batch_at(pipe, s, mesh)
        assert {k: np.asarray(v).tolist() for k, v in here.items()} == two[i]
        host = pipe.batch_at(s)  # the host's batch: before the device stages
        assert two[i]["x"] == (host["x"] * 2).tolist() and "device_noise" not in host
        noise = np.asarray(two[i]["device_noise"])
        assert noise.shape == (16, 2) and len({tuple(r) for r in noise.tolist()}) == 16  # a key per row
