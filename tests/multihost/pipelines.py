"""The pipeline the multi-host tests share (imported by each host process and by the tests)."""

import numpy as np

import quern


def jitter(batch, keys):
    return {**batch, "noise": quern.transforms.random.uniform(keys, (3,)).astype(np.float32)}


def make_pipeline():
    data = {"x": np.arange(5000, dtype=np.int64), "y": np.arange(10000, dtype=np.float32).reshape(5000, 2)}
    return quern.Pipeline.from_source(data, seed=7).shuffle().batch(16).random_map_batch(jitter)


def double_x(batch):
    return {**batch, "x": batch["x"] * 2}


def device_noise(batch, keys):
    import jax

    return {**batch, "device_noise": jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)}


def make_device_pipeline():
    """The shared pipeline with two device stages: one plain, one random (a typed key per row)."""
    return make_pipeline().map_device(double_x).random_map_device(device_noise)
