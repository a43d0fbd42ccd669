"""A small image classifier (flax + optax) trained on images quern decodes and augments.

The example makes its own data: ``--images`` small pictures of four classes
(stripes across, stripes down, a checkerboard, rings; random sizes, colours and
phases), written as JPEG and PNG files in an ImageNet-style tree
(``train/CLASS/NNNN.jpg``) and prepared once with ``quern prepare
--labels-from-dirs`` (``quern.prepare.prepare(..., labels_from_dirs=True)``):
ArrayRecord shards of the files' bytes, with each image's label read back by
``ArrayRecordSource(folder, fields=["label"])``.

The pipeline decodes each image (``quern.transforms.image.decode``) and augments it:

* on the host (the default): ``random_resized_crop(SIZE)`` and ``random_flip`` as
  ``random_map`` stages, then ``normalize`` on the whole batch;
* on the device (``--augment device``): the host only decodes and resizes to
  ``SIZE + 8`` square, and ``random_map_device`` stages crop, flip and normalize the
  global batch under ``jax.jit`` (:mod:`quern.transforms.image.device`).

Either way a row's crop depends only on (seed, stream position, stage), so a run
stopped after a checkpoint and started again produces exactly the losses of an
uninterrupted one. Each step takes a global batch from
``quern.sharding.global_iterator``; every ``--ckpt-every`` steps the parameters,
the optax state and the iterator state are saved together with orbax, and on
start the latest checkpoint is restored.

Run:  python examples/train_vision.py [--steps 40] [--augment host|device] [--ckpt-dir DIR] [--ckpt-every 10]
"""

from __future__ import annotations

import argparse
import io
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import quern
from quern.sharding.checkpoint import QuernRestore, QuernSave
from quern.transforms import image
from quern.transforms.image import device

SIZE = 32  # the side of the images the model sees
CLASSES = ("across", "down", "checks", "rings")
MEAN, STD = 127.5, 64.0


def picture(kind: str, rng: np.random.Generator) -> np.ndarray:
    """One picture of class ``kind``: a pattern of random period, phase and colours, 40-72 px a side."""
    h, w = (int(v) for v in rng.integers(40, 73, 2))
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    period, phase = rng.uniform(5, 11), rng.uniform(0, 2 * np.pi)
    wave = {
        "across": np.sin(2 * np.pi * y / period + phase),
        "down": np.sin(2 * np.pi * x / period + phase),
        "checks": np.sign(np.sin(2 * np.pi * x / period + phase) * np.sin(2 * np.pi * y / period)),
        "rings": np.sin(2 * np.pi * np.hypot(x - w / 2, y - h / 2) / period + phase),
    }[kind]
    fg, bg = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    pixels = bg + (fg - bg) * (wave[:, :, None] + 1) / 2 + rng.normal(0, 6, (h, w, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def build_dataset(folder: str, images: int) -> str:
    """The prepared folder of ``images`` pictures (made and prepared on first use); its path."""
    from PIL import Image

    prepared = os.path.join(folder, "prepared")
    if os.path.exists(os.path.join(prepared, "manifest.json")):
        return prepared
    rng = np.random.default_rng(2026)
    for i in range(images):
        kind = CLASSES[i % len(CLASSES)]
        os.makedirs(os.path.join(folder, "train", kind), exist_ok=True)
        buf = io.BytesIO()
        fmt = "PNG" if i % 5 == 0 else "JPEG"  # a mix of both formats
        Image.fromarray(picture(kind, rng)).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        with open(os.path.join(folder, "train", kind, f"{i:05d}.{fmt.lower()[:3]}"), "wb") as f:
            f.write(buf.getvalue())
    quern.prepare.prepare(os.path.join(folder, "train"), prepared, labels_from_dirs=True, num_workers=0)
    return prepared


def normalize_device(batch: dict) -> dict:
    """The device's normalisation (after its crop): float32, about zero mean and unit spread."""
    return {**batch, "bytes": (batch["bytes"] - MEAN) / STD}


def make_pipeline(folder: str, batch: int, augment: str = "host") -> quern.Pipeline:
    """Shuffled images with their labels, decoded and augmented (on the host or on the device)."""
    source = quern.sources.ArrayRecordSource(folder, fields=["label"])  # records: {"bytes", "label"}
    pipe = quern.Pipeline.from_source(source, seed=7).shuffle().map(image.decode(key="bytes"))
    if augment == "host":
        return (
            pipe.random_map(image.random_resized_crop(SIZE, scale=(0.35, 1.0), key="bytes"))
            .random_map(image.random_flip(key="bytes"))
            .batch(batch)
            .map_batch(image.normalize(MEAN, STD, key="bytes"))
        )
    return (
        pipe.map(image.resize((SIZE + 8, SIZE + 8), key="bytes"))  # one size: a batch is one array
        .batch(batch)
        .random_map_device(device.random_resized_crop(SIZE, scale=(0.35, 1.0), key="bytes"))
        .random_map_device(device.random_flip(key="bytes"))
        .map_device(normalize_device)
    )


class SmallCNN(nn.Module):
    """Two convolutions, a pooling and a dense layer: logits of the four classes."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for features in (16, 32):
            x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(len(CLASSES))(x.mean(axis=(1, 2)))


MODEL = SmallCNN()
OPTIMIZER = optax.adam(3e-3)


def init_state(key: jax.Array) -> tuple[dict, optax.OptState]:
    """Fresh parameters and optimizer state."""
    params = MODEL.init(key, jnp.zeros((1, SIZE, SIZE, 3), jnp.float32))
    return params, OPTIMIZER.init(params)


@jax.jit
def train_step(params: dict, opt_state: optax.OptState, batch: dict):
    """One Adam step on the cross-entropy; returns (params, opt_state, loss, accuracy)."""

    def loss_fn(p: dict) -> tuple[jax.Array, jax.Array]:
        logits = MODEL.apply(p, batch["bytes"].astype(jnp.float32))
        labels = batch["label"].astype(jnp.int32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, (logits.argmax(-1) == labels).mean()

    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, accuracy


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(here, "data", "vision"), help="dataset folder (made on first use)")
    ap.add_argument("--images", type=int, default=400, help="pictures to make on first use")
    ap.add_argument("--ckpt-dir", default=os.path.join(here, "data", "train_vision_ckpt"))
    ap.add_argument("--steps", type=int, default=40, help="train until this step")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, help="global batch size")
    ap.add_argument("--augment", choices=("host", "device"), default="host", help="where the crop and flip run")
    ap.add_argument("--workers", type=int, default=0, help="quern worker processes per host")
    args = ap.parse_args(argv)

    pipe = make_pipeline(build_dataset(args.data, args.images), args.batch, args.augment)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    init = jax.jit(init_state, out_shardings=replicated)
    mngr = ocp.CheckpointManager(os.path.abspath(args.ckpt_dir))
    start = 0
    if mngr.latest_step() is None:
        params, opt_state = init(jax.random.key(0))
    else:  # restore into the shapes and shardings of a fresh state
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
    with quern.sharding.global_iterator(pipe, mesh, start_step=start, num_workers=args.workers) as it:
        while it.step < args.steps:
            params, opt_state, loss, accuracy = train_step(params, opt_state, next(it))
            print(f"step {it.step - 1} loss {float(loss)!r} accuracy {float(accuracy):.3f}", flush=True)
            if it.step % args.ckpt_every == 0:
                mngr.save(
                    it.step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardSave({"params": params, "opt": opt_state}), data=QuernSave(it)
                    ),
                )
                mngr.wait_until_finished()
                print(f"checkpoint saved at step {it.step}", flush=True)
    mngr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
