"""pipeline/registry.py: the transforms configs may name, and which of them are quern's own
(described in the fingerprint by name, VERSION and arguments, not by their code)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import parquet_config, parquet_folder

import quern
from quern.pipeline.core.registry import REGISTRY, builtin_name, register


@dataclasses.dataclass(frozen=True)
class Scale:
    VERSION = 1  # a VERSION does not make a transform quern's own: its module is not quern's
    k: float = 2.0

    def __call__(self, record):
        return {"x": record["x"] * self.k}


def test_the_builtin_transforms_are_registered_and_named_by_their_registration():
    assert {"decode", "pad", "metadata_range"} <= set(REGISTRY)
    assert builtin_name(quern.transforms.pad(8)) == "pad"
    assert builtin_name(quern.transforms.decode(np.uint8)) == "decode"


def test_what_is_not_querns_own_has_no_builtin_name(monkeypatch):
    monkeypatch.setitem(REGISTRY, "test_scale", Scale)
    assert builtin_name(Scale()) is None and builtin_name(len) is None and builtin_name(np.sqrt) is None


def test_a_registered_factory_is_named_by_a_config(monkeypatch, tmp_path):
    monkeypatch.setitem(REGISTRY, "test_scale", None)  # the name is taken off again after the test
    assert register("test_scale")(Scale) is Scale and REGISTRY["test_scale"] is Scale
    path = parquet_config(parquet_folder(tmp_path), [{"name": "test_scale", "kwargs": {"k": 3}}])
    assert quern.load_config(path).batch_at(0)["x"].tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_name_must_be_a_non_empty_string(name):
    with pytest.raises(TypeError, match="register\\(\\) needs a non-empty name"):
        register(name)
