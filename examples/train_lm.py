"""A small byte-level language model trained with JAX, fed by quern's global iterator.

The data is the quickstart's: the Python standard library's ``.py`` files as
byte records in ArrayRecord shards (built on first use). Each step takes a
global batch of ``jax.Array`` from ``quern.sharding.global_iterator`` (sharded
over all devices of all processes, ``device_prefetch`` batches in flight), runs
one jitted Adam step of a one-block transformer, and logs the loss, the step
time and the time spent waiting for data. Every ``--ckpt-every`` steps the
model, the optimizer state and the iterator state are saved together with
orbax; on start the latest checkpoint is restored, so a killed run resumes and
produces exactly the losses of an uninterrupted one.

Run:  python examples/train_lm.py [--steps 60] [--ckpt-dir DIR] [--ckpt-every 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart  # noqa: E402  (the dataset and pipeline of the quickstart)

import quern  # noqa: E402
from quern.sharding.checkpoint import QuernRestore, QuernSave  # noqa: E402

CONTEXT = 128  # tokens per training row (the first CONTEXT + 1 bytes of each record)


def init_params(key: jax.Array, width: int = 128) -> dict:
    k = jax.random.split(key, 6)
    scale = width**-0.5
    return {
        "embed": jax.random.normal(k[0], (256, width)) * 0.02,
        "pos": jax.random.normal(k[1], (CONTEXT, width)) * 0.02,
        "qkv": jax.random.normal(k[2], (width, 3 * width)) * scale,
        "out": jax.random.normal(k[3], (width, width)) * scale,
        "up": jax.random.normal(k[4], (width, 4 * width)) * scale,
        "down": jax.random.normal(k[5], (4 * width, width)) * (4 * width) ** -0.5,
    }


def forward(params: dict, tokens: jax.Array) -> jax.Array:
    """Logits (batch, CONTEXT, 256) of the next byte at each position."""
    x = params["embed"][tokens] + params["pos"]
    q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
    att = (q @ k.swapaxes(-1, -2)) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((CONTEXT, CONTEXT), bool))
    att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
    x = x + (att @ v) @ params["out"]
    x = x + jax.nn.gelu(x @ params["up"]) @ params["down"]
    return x @ params["embed"].T


def loss_fn(params: dict, batch: dict) -> jax.Array:
    tokens = batch["tokens"][:, : CONTEXT + 1].astype(jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = jnp.arange(CONTEXT)[None, :] < (batch["length"][:, None] - 1)
    logp = jax.nn.log_softmax(forward(params, inputs))
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1)


@jax.jit
def train_step(params: dict, opt: dict, batch: dict, lr: float = 3e-3):
    """One Adam step; returns (params, opt, loss)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    t = opt["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], grads)
    params = jax.tree_util.tree_map(
        lambda p, m, v: p - lr * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8), params, m, v
    )
    return params, {"m": m, "v": v, "t": t}, loss


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(here, "data"), help="dataset folder (built on first use)")
    ap.add_argument("--ckpt-dir", default=os.path.join(here, "data", "train_lm_ckpt"))
    ap.add_argument("--steps", type=int, default=60, help="train until this step")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="global batch size")
    ap.add_argument("--workers", type=int, default=0, help="quern worker processes per host")
    args = ap.parse_args(argv)

    ar_paths, _ = quickstart.build_dataset(args.data)
    pipe = quickstart.make_pipeline(ar_paths, args.batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))  # batch axis over every device
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.device_put(init_params(jax.random.key(0)), replicated)
    opt = jax.device_put(
        {
            "m": jax.tree_util.tree_map(jnp.zeros_like, params),
            "v": jax.tree_util.tree_map(jnp.zeros_like, params),
            "t": jnp.zeros((), jnp.int32),
        },
        replicated,
    )

    mngr = ocp.CheckpointManager(os.path.abspath(args.ckpt_dir))
    start = 0
    if mngr.latest_step() is not None:
        restored = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore({"params": params, "opt": opt}), data=QuernRestore(pipe)
            ),
        )
        params, opt = restored.model["params"], restored.model["opt"]
        start = restored.data["step"]
        print(f"resumed from checkpoint at step {start}", flush=True)

    waits, steps = [], []
    with quern.sharding.global_iterator(pipe, mesh, start_step=start, num_workers=args.workers) as it:
        t_prev = time.perf_counter()
        while it.step < args.steps:
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            params, opt, loss = train_step(params, opt, batch)
            loss = float(loss)  # waits for the step
            t2 = time.perf_counter()
            step = it.step - 1
            waits.append(t1 - t0)
            steps.append(t2 - t_prev)
            t_prev = t2
            print(
                f"step {step} loss {loss!r} step_ms {1e3 * (t2 - t0):.1f} data_wait_ms {1e3 * (t1 - t0):.2f}",
                flush=True,
            )
            if it.step % args.ckpt_every == 0:
                mngr.save(
                    it.step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardSave({"params": params, "opt": opt}), data=QuernSave(it)
                    ),
                )
                mngr.wait_until_finished()
                print(f"checkpoint saved at step {it.step}", flush=True)
    mngr.close()
    if len(steps) > 2:  # the first steps include compilation
        wait, total = sum(waits[2:]), sum(steps[2:])
        print(
            f"data wait: {1e3 * wait / len(steps[2:]):.2f} ms per step = {100 * wait / total:.1f}% of step time "
            f"({1e3 * total / len(steps[2:]):.1f} ms per step, steps {start + 2}..{it.step - 1})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
