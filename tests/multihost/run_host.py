"""One host of a multi-process JAX test:
``run_host.py PROCESS_ID NUM_PROCESSES PORT DEVICES START STEPS [WORKERS [device]]``.

Initialises ``jax.distributed`` on 127.0.0.1 with DEVICES CPU devices in this
process, iterates the test pipeline's global batches from START for STEPS
steps, and prints (process 0 only) one JSON line: the fully replicated global
batches as lists. With ``device``, the pipeline has device stages, and each step's
``global_batch_at`` must equal the iterator's batch.
"""

import json
import os
import sys

pid, n, port, ndev, start, steps = (int(a) for a in sys.argv[1:7])
workers = int(sys.argv[7]) if len(sys.argv) > 7 else 0
device = len(sys.argv) > 8 and sys.argv[8] == "device"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=60)

from quern.sharding import global_batch_at, global_iterator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipelines import make_device_pipeline, make_pipeline  # noqa: E402

pipe = make_device_pipeline() if device else make_pipeline()
mesh = jax.make_mesh((n * ndev,), ("data",))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
gather = jax.jit(lambda tree: tree, out_shardings=replicated)
out = []
with global_iterator(pipe, mesh, start_step=start, num_workers=workers) as it:
    for s in range(start, start + steps):
        batch = gather(next(it))
        out.append({k: np.asarray(v).tolist() for k, v in batch.items()})
        if device:
            alone = gather(global_batch_at(pipe, s, mesh))
            assert {k: np.asarray(v).tolist() for k, v in alone.items()} == out[-1], s
    state = it.state()
if pid == 0:
    print(json.dumps({"batches": out, "state": state}), flush=True)
jax.distributed.shutdown()
print("host done", flush=True)
sys.stderr.flush()
# Skip the interpreter's teardown: gRPC's coordination server sometimes aborts in a static
# destructor at exit ("Check failed: queue.Pop() == nullptr"), after all the work is done.
os._exit(0)
