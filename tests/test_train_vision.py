"""examples/train_vision.py: a classifier on images quern decodes and augments (on the host or on the
device) stops after a checkpoint, resumes, and gives exactly the losses of an uninterrupted run."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_vision.py")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def example():
    """The example as a module, loaded once: its jitted step is compiled once for the tests here."""
    spec = importlib.util.spec_from_file_location("quern_example_train_vision", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _losses(text: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)", text, re.MULTILINE)}


@pytest.mark.slow
@pytest.mark.parametrize("augment", ["host", "device"])
def test_a_stopped_run_resumes_with_the_same_losses(tmp_path, capsys, augment, example):
    common = ["--data", str(tmp_path / "data"), "--images", "64", "--batch", "16", "--ckpt-every", "3"]
    common += ["--augment", augment]
    assert example.main([*common, "--ckpt-dir", str(tmp_path / "whole"), "--steps", "6"]) == 0
    whole = _losses(capsys.readouterr().out)
    assert sorted(whole) == list(range(6))
    values = [float(whole[s]) for s in range(6)]
    assert all(math.isfinite(v) for v in values) and len(set(values)) == 6  # real losses that follow the data
    assert example.main([*common, "--ckpt-dir", str(tmp_path / "stopped"), "--steps", "3"]) == 0
    first = capsys.readouterr().out
    assert _losses(first) == {s: whole[s] for s in range(3)} and "checkpoint saved at step 3" in first
    assert example.main([*common, "--ckpt-dir", str(tmp_path / "stopped"), "--steps", "6"]) == 0
    resumed = capsys.readouterr().out
    assert "resumed from checkpoint at step 3" in resumed
    assert _losses(resumed) == {s: whole[s] for s in range(3, 6)}


def test_host_and_device_augmentation_are_two_pipelines(tmp_path, example):
    """Host augmentation gives normalized SIZE x SIZE float rows; device augmentation leaves the host's batch
    uint8 at SIZE + 8 and has its own fingerprint; the labels are the class folders' indices."""
    import numpy as np

    folder = example.build_dataset(str(tmp_path / "data"), 24)
    host, on_device = example.make_pipeline(folder, 8, "host"), example.make_pipeline(folder, 8, "device")
    assert host.fingerprint() != on_device.fingerprint()
    a, b = host.batch_at(0), on_device.batch_at(0)
    assert a["bytes"].shape == (8, example.SIZE, example.SIZE, 3) and a["bytes"].dtype == np.float32
    assert b["bytes"].shape == (8, example.SIZE + 8, example.SIZE + 8, 3) and b["bytes"].dtype == np.uint8
    assert np.array_equal(a["label"], b["label"])  # the same shuffle: the same images, augmented elsewhere
    assert set(a["label"].tolist()) <= set(range(len(example.CLASSES)))
