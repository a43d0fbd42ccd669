"""A small byte-level language model (flax + optax) trained on packed rows from quern.

The data is the quickstart's: the Python standard library's ``.py`` files as
byte records in ArrayRecord shards (built on first use). The records are
shuffled, decoded to byte tokens and packed into rows of ``CONTEXT + 1``
tokens with ``Pipeline.pack`` (best-fit by default; the length index it plans
from is scanned once and cached under ``--cache-dir``). A packed row holds
several documents: ``segment_ids`` number them 1..k (0 is padding) and
``positions`` count tokens inside each piece.

The model is a small pre-norm transformer in flax linen whose attention is
*segment-aware*: a token attends to the tokens before it in its own document
only (causal AND same segment AND not padding), and the positional embedding is
read at the packed ``positions``. The loss is the next-token loss averaged over
the targets that continue their input's document. The optimizer is optax's
AdamW.

Each step takes a global batch of ``jax.Array`` from
``quern.sharding.global_iterator`` (sharded over all devices of all processes,
``device_prefetch`` batches in flight), runs one jitted step, and logs the
loss; every ``--log-every`` steps it logs the iterator's own figures
(``it.stats()``): the data wait per step, the step period, the bubble rate
(the share of the step the loop waited for data) and the health by the 50% /
80% thresholds, with where the loader spends its time. Every
``--ckpt-every`` steps the parameters, the optax state and the iterator state
are saved together with orbax; on start the latest checkpoint is restored, so a
killed run resumes and produces exactly the losses of an uninterrupted one.

Run:  python examples/train_lm.py [--steps 60] [--ckpt-dir DIR] [--ckpt-every 20] [--pack best_fit|concat]
      [--log-every 10]
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart  # noqa: E402  (the dataset of the quickstart)

import quern  # noqa: E402
from quern.sharding.checkpoint import QuernRestore, QuernSave  # noqa: E402

CONTEXT = 128  # tokens the model reads per row; packed rows hold CONTEXT + 1 (inputs and shifted targets)
MAX_POSITION = quickstart.SEQ_LEN  # records hold at most this many bytes: positions stay below it in both modes


def make_pipeline(folder: str, batch: int, mode: str = "best_fit", cache_dir: str | None = None):
    """Shuffled byte records packed into rows of ``CONTEXT + 1`` tokens, ``batch`` rows per step."""
    source = quern.sources.ArrayRecordSource(folder)  # the quickstart's prepared folder
    return (
        quern.Pipeline.from_source(source, seed=2026)
        .shuffle()
        .map(quern.transforms.decode(np.uint8))  # bytes -> 1-D uint8 tokens (the packed rows keep uint8)
        .pack(CONTEXT + 1, mode=mode, cache_dir=cache_dir)
        .batch(batch)
    )


class Block(nn.Module):
    """Pre-norm transformer block: masked self-attention, then an MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.width)(h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


class ByteLM(nn.Module):
    """Next-byte logits for packed rows: attention stays inside each document."""

    width: int = 128
    heads: int = 4
    layers: int = 1

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        embed = nn.Embed(256, self.width)
        x = embed(tokens) + nn.Embed(MAX_POSITION, self.width)(positions)
        real = segment_ids > 0
        mask = nn.combine_masks(
            nn.make_causal_mask(tokens),  # only earlier tokens
            nn.make_attention_mask(segment_ids, segment_ids, jnp.equal),  # of the same document
            nn.make_attention_mask(real, real, jnp.logical_and),  # and none of the padding
        )
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x, mask)
        return embed.attend(nn.LayerNorm()(x))  # output weights tied to the input embedding


MODEL = ByteLM()
OPTIMIZER = optax.adamw(3e-3, weight_decay=1e-4)


def init_state(key: jax.Array) -> tuple[dict, optax.OptState]:
    """Fresh parameters and optimizer state."""
    dummy = jnp.zeros((1, CONTEXT), jnp.int32)
    params = MODEL.init(key, dummy, dummy + 1, dummy)
    return params, OPTIMIZER.init(params)


def loss_fn(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Mean next-token loss over the targets that continue their input's document; and their count."""
    tokens = batch["tokens"].astype(jnp.int32)
    seg = batch["segment_ids"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = MODEL.apply(params, inputs, seg[:, :-1], batch["positions"][:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weight = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)  # not a document's first token, nor padding
    count = weight.sum()
    return jnp.where(weight, nll, 0.0).sum() / jnp.maximum(count, 1), count


@jax.jit
def train_step(params: dict, opt_state: optax.OptState, batch: dict):
    """One AdamW step; returns (params, opt_state, loss, tokens in the loss)."""
    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, count


def data_line(stats: dict) -> str:
    """One log line from the iterator's figures over its last 100 steps: the data wait
    per step, the step period, the bubble rate, the health, and the loader's
    slowest stage (summed over its threads or workers)."""
    stages = stats["stages"]
    slowest = max(stages, key=stages.get) if stages else "-"
    return (
        f"data: wait {1e3 * stats['data_wait']['mean']:.2f} ms/step, period {1e3 * stats['step_period']['mean']:.1f} "
        f"ms, bubble rate {100 * stats['bubble_rate']:.1f}%, health {stats['health']}; loader's slowest stage "
        f"{slowest!r}"
    )


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(here, "data"), help="dataset folder (built on first use)")
    ap.add_argument("--cache-dir", help="where the length index is cached (default: DATA/quern_cache)")
    ap.add_argument("--ckpt-dir", default=os.path.join(here, "data", "train_lm_ckpt"))
    ap.add_argument("--steps", type=int, default=60, help="train until this step")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="global batch size (packed rows)")
    ap.add_argument("--pack", choices=("best_fit", "concat"), default="best_fit", help="packing mode")
    ap.add_argument("--workers", type=int, default=0, help="quern worker processes per host")
    ap.add_argument("--log-every", type=int, default=10, help="log the data wait and bubble rate every N steps")
    args = ap.parse_args(argv)

    folder, _ = quickstart.build_dataset(args.data)
    cache_dir = args.cache_dir or os.path.join(args.data, "quern_cache")
    pipe = make_pipeline(folder, args.batch, args.pack, cache_dir)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))  # batch axis over every device
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    init = jax.jit(init_state, out_shardings=replicated)

    mngr = ocp.CheckpointManager(os.path.abspath(args.ckpt_dir))
    start = 0
    if mngr.latest_step() is None:
        params, opt_state = init(jax.random.key(0))
    else:  # restore into the shapes and shardings of a fresh state, without computing one
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
            jax.eval_shape(init, jax.random.key(0)),
        )
        restored = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore({"params": target[0], "opt": target[1]}), data=QuernRestore(pipe)
            ),
        )
        params, opt_state = restored.model["params"], restored.model["opt"]
        start = restored.data["step"]
        print(f"resumed from checkpoint at step {start}", flush=True)

    tokens, trained = 0, 0
    with quern.sharding.global_iterator(pipe, mesh, start_step=start, num_workers=args.workers) as it:
        while it.step < args.steps:
            batch = next(it)
            params, opt_state, loss, count = train_step(params, opt_state, batch)
            loss, count = float(loss), int(count)  # waits for the step
            tokens, trained = tokens + count, trained + 1
            print(f"step {it.step - 1} loss {loss!r} tokens {count}", flush=True)
            if it.step % args.log_every == 0:
                print(data_line(it.stats()), flush=True)
            if it.step % args.ckpt_every == 0:
                mngr.save(
                    it.step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardSave({"params": params, "opt": opt_state}), data=QuernSave(it)
                    ),
                )
                mngr.wait_until_finished()
                print(f"checkpoint saved at step {it.step}", flush=True)
        stats = it.stats()
    mngr.close()
    if trained:
        print(
            f"trained on {tokens:,} target tokens in {trained} steps: "
            f"{100 * tokens / (trained * args.batch * CONTEXT):.1f}% of the packed rows' {CONTEXT} targets",
            flush=True,
        )
    if stats["steps"] > 1:  # the first batch (start-up) is only in first_batch_s
        wait = stats["data_wait"]["total"]
        print(
            f"data wait over the run: {1e3 * wait / (stats['steps'] - 1):.2f} ms per step, bubble rate "
            f"{100 * stats['bubble_rate_total']:.1f}% (first batch {stats['first_batch_s']:.2f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
