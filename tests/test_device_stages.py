"""map_device and random_map_device: batch stages run under jax.jit on the global arrays (quern.sharding).

Single-process checks; tests/multihost/test_global_batches.py runs them on 2 real JAX processes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_batches_equal, importable, write_config, write_module

import quern
from quern.sharding import global_batch_at, global_iterator

MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


def noise(batch, keys):
    return {**batch, "noise": jax.vmap(lambda key: jax.random.uniform(key, (3,)))(keys)}


def scaled(batch):
    return {**batch, "x": batch["x"].astype(jax.numpy.float32) * 0.5}


def _pipe(batch: int = 8, seed: int = 3):
    data = {"x": np.arange(200, dtype=np.int32)}
    return (
        quern.Pipeline.from_source(data, seed=seed).shuffle().batch(batch).map_device(scaled).random_map_device(noise)
    )


def _host(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def test_the_iterator_and_global_batch_at_agree_and_resume():
    pipe = _pipe()
    with global_iterator(pipe, MESH) as it:
        got = [_host(next(it)) for _ in range(5)]
    for s in range(5):
        assert_batches_equal(got[s], _host(global_batch_at(pipe, s, MESH)), f"step {s}")
    with global_iterator(pipe, MESH, start_step=3) as it:
        assert_batches_equal(_host(next(it)), got[3], "resumed at 3")
    assert np.array_equal(got[2]["x"], pipe.batch_at(2)["x"] * 0.5)  # the host's batch, then the device stage


def test_a_rows_key_depends_on_its_position_not_on_the_batch_size():
    small, big = _pipe(batch=8), _pipe(batch=16)
    rows = np.concatenate([_host(global_batch_at(small, s, MESH))["noise"] for s in (2, 3)])
    assert np.array_equal(rows, _host(global_batch_at(big, 1, MESH))["noise"])
    assert len({tuple(r) for r in rows.tolist()}) == 16  # one key per row
    other_seed = _host(global_batch_at(_pipe(batch=16, seed=4), 1, MESH))["noise"]
    assert not np.array_equal(other_seed, rows)


def test_host_batches_stop_before_the_device_stages():
    pipe = _pipe()
    host = pipe.batch_at(0)
    assert set(host) == {"x"} and host["x"].dtype == np.int32
    with pipe.iterator() as it:
        assert_batches_equal(next(it), host)


def test_device_stages_are_in_the_fingerprint_and_after_the_host_stages():
    base = quern.Pipeline.from_source({"x": np.arange(40)}, seed=0).batch(4)
    assert base.map_device(scaled).fingerprint() != base.fingerprint()
    assert base.map_device(scaled).fingerprint() != base.random_map_device(noise).fingerprint()
    with pytest.raises(ValueError, match=r"map_batch\(\) after a device stage"):
        base.map_device(scaled).map_batch(lambda b: b)
    with pytest.raises(ValueError, match="batch"):
        quern.Pipeline.from_source({"x": np.arange(40)}, seed=0).map_device(scaled)
    with pytest.raises(TypeError, match="needs a callable"):
        base.map_device(3)


def test_a_failing_device_stage_names_the_step_and_the_stage():
    def broken(batch):
        return {**batch, "y": batch["x"] @ batch["x"]}  # a shape error while traced

    pipe = quern.Pipeline.from_source({"x": np.ones((40, 3))}, seed=0).batch(4).map_device(broken)
    with pytest.raises(quern.StepError, match=r"step 2, the device stages \(map_device\[0\] \S*broken\): TypeError"):
        global_batch_at(pipe, 2, MESH)


def test_the_config_form(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    module = write_module(
        tmp_path,
        "import jax\n\n"
        "def noise(batch, keys):\n"
        "    return {**batch, 'noise': jax.vmap(lambda key: jax.random.uniform(key, (3,)))(keys)}\n",
        "devstages",
    )
    pq.write_table(pa.table({"x": np.arange(200, dtype=np.int32)}), tmp_path / "x.parquet")
    with importable(tmp_path, module) as mod:
        src = quern.sources.ParquetSource(str(tmp_path / "x.parquet"))
        pipe = quern.Pipeline.from_source(src, seed=3).shuffle().batch(8).random_map_device(mod.noise)
        cfg = pipe.to_config()
        assert cfg["batch_transforms"] == [{"fn": f"{module}:noise", "kind": "random_map_device", "kwargs": {}}]
        loaded = quern.load_config(write_config(tmp_path, cfg), allow=[module])
        assert loaded.fingerprint() == pipe.fingerprint()
        assert_batches_equal(_host(global_batch_at(loaded, 4, MESH)), _host(global_batch_at(pipe, 4, MESH)))


# --------------------------------------------------------------------------- image stages on the device


def _images(n: int = 16, h: int = 48, w: int = 64):
    y, x = np.mgrid[0:h, 0:w]
    one = np.stack([(x * 3) % 256, (y * 5) % 256, (x + y) % 256], axis=2).astype(np.uint8)
    return {"image": np.stack([np.roll(one, i, axis=1) for i in range(n)]), "label": np.arange(n)}


def test_device_crop_boxes_follow_torchvisions_bounds():
    from quern.transforms.image.device import crop_boxes

    boxes_of = jax.jit(lambda keys: crop_boxes(keys, 48, 64, (0.08, 1.0), (3 / 4, 4 / 3)))  # as in a device stage
    boxes = np.asarray(boxes_of(jax.random.split(jax.random.key(1), 600)))
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 48).all() and (left + w <= 64).all()
    area = h * w / (48 * 64)
    assert area.min() >= 0.07 and area.max() <= 1.0 and 0.3 < np.median(area) < 0.7
    assert len(np.unique(boxes, axis=0)) > 500  # a key per row: different boxes
    # nothing fits: the largest centred box of the clamped aspect
    fallback = np.asarray(
        jax.jit(lambda k: crop_boxes(k, 10, 100, (1.0, 1.0), (1.0, 1.0)))(jax.random.split(jax.random.key(2), 4))
    )
    assert fallback.tolist() == [[0.0, 45.0, 10.0, 10.0]] * 4


def test_device_crop_and_flip_in_a_pipeline():
    from quern.transforms.image import device

    base = quern.Pipeline.from_source(_images(), seed=5).batch(8)
    whole = base.random_map_device(
        device.random_resized_crop((24, 32), scale=(1, 1), ratio=(4 / 3, 4 / 3), key="image")
    )
    got = _host(global_batch_at(whole, 1, MESH))["image"]
    want = jax.image.resize(base.batch_at(1)["image"].astype(np.float32), (8, 24, 32, 3), "linear", antialias=True)
    assert got.shape == (8, 24, 32, 3) and np.allclose(got, np.asarray(want), atol=1e-3)  # the whole image, resized
    flipped = _host(global_batch_at(base.random_map_device(device.random_flip(1.0, key="image")), 0, MESH))
    assert np.array_equal(flipped["image"], base.batch_at(0)["image"][:, :, ::-1])
    kept = _host(global_batch_at(base.random_map_device(device.random_flip(0.0, key="image")), 0, MESH))
    assert np.array_equal(kept["image"], base.batch_at(0)["image"])
    half = _host(global_batch_at(base.random_map_device(device.random_flip(key="image")), 0, MESH))["image"]
    mirrored = [np.array_equal(r, o[:, ::-1]) for r, o in zip(half, base.batch_at(0)["image"])]
    assert 0 < sum(mirrored) < 8


def test_device_image_stages_have_a_config_form():
    from quern.pipeline.core.registry import REGISTRY
    from quern.pipeline.streams.config_form import transform_config
    from quern.transforms.image import device

    for stage in (device.random_resized_crop((20, 30), scale=(0.5, 1), key="x"), device.random_flip(0.3)):
        entry = transform_config(stage, "random_map_device", "t")
        assert entry["name"].startswith("image.device_")
        assert REGISTRY[entry["name"]](**entry["kwargs"]) == stage
    with pytest.raises(ValueError, match="size must be positive"):
        device.random_resized_crop(0)
