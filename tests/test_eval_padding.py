"""Tests of batch(drop_remainder=False, pad_remainder=True) (pipeline/execute/padding.py): the last
partial batch of a finite stream padded to whole batches, with a boolean ``valid`` leaf."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers import assert_host_slices_make_the_batch, assert_iterator_gives_batch_at, parquet_folder

import quern
from quern.pipeline.core.errors import StepError


def _pipe(n=10, batch=4, pad=-1, **kw):
    src = {"x": np.arange(n, dtype=np.int64), "y": np.arange(2 * n, dtype=np.float32).reshape(n, 2)}
    return quern.Pipeline.from_source(src, num_epochs=1, **kw).batch(
        batch, drop_remainder=False, pad_remainder=True, pad_value=pad
    )


def test_the_last_batch_is_padded_and_every_batch_says_which_rows_are_real():
    pipe = _pipe()
    assert pipe.num_steps == 3
    full = pipe.batch_at(0)
    assert full["valid"].tolist() == [True] * 4 and full["x"].tolist() == [0, 1, 2, 3]
    last = pipe.batch_at(2)
    assert last["x"].tolist() == [8, 9, -1, -1] and last["valid"].tolist() == [True, True, False, False]
    assert last["y"].dtype == np.float32 and last["y"][2:].tolist() == [[-1.0, -1.0]] * 2
    unpadded = quern.Pipeline.from_source(
        {"x": np.arange(10, dtype=np.int64), "y": np.arange(20, dtype=np.float32).reshape(10, 2)}, num_epochs=1
    ).batch(4, drop_remainder=False)
    assert unpadded.batch_at(2)["x"].tolist() == [8, 9] and "valid" not in unpadded.batch_at(2)
    assert unpadded.fingerprint() != pipe.fingerprint()


@pytest.mark.parametrize("n,hosts", [(10, 2), (9, 4), (13, 2)])
def test_every_host_gets_its_share_of_every_step_and_they_make_the_global_batch(n, hosts):
    pipe = _pipe(n=n, batch=8)
    for s in range(pipe.num_steps):
        assert all(len(pipe.batch_at(s, h, hosts)["x"]) == 8 // hosts for h in range(hosts))
    assert_host_slices_make_the_batch(pipe, range(pipe.num_steps), hosts)
    real = np.concatenate([pipe.batch_at(s)["x"][pipe.batch_at(s)["valid"]] for s in range(pipe.num_steps)])
    assert real.tolist() == list(range(n))  # each record once, nothing dropped


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_iterator_gives_batch_at_with_workers_and_on_resume(num_workers):
    pipe = _pipe(n=21, batch=4, seed=2)
    assert_iterator_gives_batch_at(pipe, num_workers=num_workers)
    assert_iterator_gives_batch_at(pipe, start_step=4, num_workers=num_workers)


def test_global_iterator_takes_a_padded_pipeline():
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    plain = quern.Pipeline.from_source({"x": np.arange(10)}, num_epochs=1).batch(4, drop_remainder=False)
    with pytest.raises(ValueError, match=r"pad_remainder=True\) to pad the last batch"):
        quern.sharding.global_iterator(plain, mesh)
    with quern.sharding.global_iterator(_pipe(), mesh) as it:
        got = [np.asarray(b["x"]).tolist() for b in it]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1]]


def test_bad_settings_and_batches_are_clear_errors():
    base = quern.Pipeline.from_source({"x": np.arange(10)}, num_epochs=1)
    with pytest.raises(ValueError, match="which drop_remainder=True drops: pass drop_remainder=False"):
        base.batch(4, pad_remainder=True)
    with pytest.raises(ValueError, match="pad_value=...\\) must be a number, got 'x'"):
        base.batch(4, drop_remainder=False, pad_remainder=True, pad_value="x")
    arrays = quern.Pipeline.from_source(list(np.arange(10)), num_epochs=1).batch(
        4, drop_remainder=False, pad_remainder=True
    )
    with pytest.raises(StepError, match=r"step 0 .*adds a boolean leaf 'valid' to every batch, and this batch is a "):
        arrays.batch_at(0)
    clash = quern.Pipeline.from_source({"valid": np.arange(10)}, num_epochs=1).batch(
        4, drop_remainder=False, pad_remainder=True
    )
    with pytest.raises(StepError, match="has a 'valid' leaf already"):
        clash.batch_at(0)


def test_the_config_form_loads_back(tmp_path):
    folder = parquet_folder(tmp_path)
    cfg = {
        "source": {"type": "parquet", "paths": "d.parquet"},
        "num_epochs": 1,
        "batch": {"size": 16, "drop_remainder": False, "pad_remainder": True, "pad_value": 7},
    }
    path = folder / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    pipe = quern.load_config(path)
    assert pipe.num_steps == 3 and pipe.batch_at(2)["x"].tolist() == [32, 33, 34, 35, 36, 37, 38, 39] + [7] * 8
    assert pipe.to_config()["batch"] == cfg["batch"]
