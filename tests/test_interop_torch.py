"""quern.interop.torch: a rank's batches as tensors, the StatefulDataLoader protocol through torch.save,
the same global batches on any world size, and the loader inside torch's own DataLoader."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_batches_equal

import quern

# torch is imported by the tests that run here, not at collection: every test process collects this module


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


def loader(*args, **kwargs):
    from quern.interop.torch import loader

    return loader(*args, **kwargs)


def to_torch(*args, **kwargs):
    from quern.interop.torch import to_torch

    return to_torch(*args, **kwargs)


def _pipe(num_epochs=None, batch=8):
    data = {"x": np.arange(160, dtype=np.int64), "y": np.arange(320, dtype=np.float32).reshape(160, 2)}
    return quern.Pipeline.from_source(data, seed=3, num_epochs=num_epochs).shuffle().batch(batch)


def _numpy(tree):
    return {k: v.numpy() for k, v in tree.items()}


def test_batches_are_tensors_of_the_ranks_rows(torch):
    pipe = _pipe()
    it = iter(loader(pipe, rank=1, world_size=2))
    for s in range(3):
        b = next(it)
        assert isinstance(b["x"], torch.Tensor) and b["x"].dtype == torch.int64 and b["y"].dtype == torch.float32
        assert_batches_equal(_numpy(b), pipe.batch_at(s, 1, 2), f"step {s}")


def test_leaves_share_memory_and_bfloat16_and_strings(torch):
    arr = np.arange(6, dtype=np.float32)
    t = to_torch({"a": arr})["a"]
    arr[0] = 42
    assert float(t[0]) == 42  # no copy
    bf = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    got = to_torch(bf)
    assert got.dtype == torch.bfloat16 and got.float().tolist() == [1.5, -2.0, 3.25]
    f8 = np.array([0.5, -2.0], dtype=ml_dtypes.float8_e4m3fn)
    assert to_torch(f8).dtype == torch.float8_e4m3fn and to_torch(f8).float().tolist() == [0.5, -2.0]
    with pytest.raises(TypeError, match="int4 .* torch cannot hold"):
        to_torch(np.array([1, 2], dtype=ml_dtypes.int4))
    with pytest.raises(TypeError, match=r"step 4: leaf batch\['s'\] is <U3 .* torch cannot hold"):
        to_torch({"s": np.array(["abc"])}, where="step 4")


def test_state_dict_round_trips_through_torch_save_on_any_world_size(torch):
    pipe = _pipe()
    whole = loader(pipe, world_size=1)
    it = iter(whole)
    for _ in range(4):
        next(it)
    buf = io.BytesIO()
    torch.save(whole.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert saved["step"] == 4
    for world in (1, 2, 4):
        parts = []
        for rank in range(world):
            resumed = loader(pipe, rank=rank, world_size=world)
            resumed.load_state_dict(saved)
            parts.append(_numpy(next(iter(resumed))))
        merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        assert_batches_equal(merged, pipe.batch_at(4), f"world size {world}")  # the same global batch


def test_a_state_of_another_pipeline_or_of_torch_is_refused():
    resumed = loader(_pipe())
    with pytest.raises(ValueError, match="fingerprint|first difference|another"):
        resumed.load_state_dict(loader(_pipe(batch=16)).state_dict())
    dl_state = {"_iterator_finished": False, "_num_yielded": 3, "_sampler_iter_state": None}
    with pytest.raises(ValueError, match="not a quern state"):
        resumed.load_state_dict(dl_state)


def test_bad_arguments_are_named(torch):
    pipe = _pipe()
    with pytest.raises(ValueError, match="rank 2 is not one of world_size=2"):
        loader(pipe, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size=3 does not divide the global batch of 8"):
        loader(pipe, rank=0, world_size=3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' needs CUDA"):
            loader(pipe, device="cuda")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            loader(pipe, pin_memory=True)
    with pytest.raises(ValueError, match="batch"):
        loader(quern.Pipeline.from_source({"x": np.arange(8)}, seed=0))
    with pytest.raises(ValueError, match=r"device stages \(map_device\[0\] \S+\) that run only on JAX"):
        loader(pipe.map_device(lambda b: b))  # the host batch would silently lack them


@pytest.mark.parametrize("torch_workers", [0, 2])
def test_inside_torchs_own_dataloader_each_step_once_and_in_order(torch_workers, torch):
    pipe = _pipe(num_epochs=1)
    dl = torch.utils.data.DataLoader(loader(pipe, start_step=3), batch_size=None, num_workers=torch_workers)
    got = [_numpy(b) for b in dl]
    assert len(got) == pipe.num_steps - 3
    for s, b in enumerate(got, start=3):
        assert_batches_equal(b, pipe.batch_at(s), f"step {s}")


def test_quern_workers_feed_the_loader():
    pipe = _pipe()
    it = iter(loader(pipe, num_workers=2, start_step=5))
    for s in range(5, 9):
        assert_batches_equal(_numpy(next(it)), pipe.batch_at(s), f"step {s}")
