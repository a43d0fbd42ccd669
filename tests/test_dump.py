"""pipeline/dump.py: a pipeline written back as a config dict, whose ``load_config`` gives the same
fingerprint and batches; what has no config form is named by its key path. (The config forms of
mixtures, packings and buckets: test_config_plan.py, test_config_pack.py, test_config_bucket.py.)"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import yaml
from helpers import assert_same_pipeline, write_shards

import quern
from quern.pipeline.order.components import quantize
from quern.pipeline.streams.config_form import source_config, transform_config, weights_config


def shift(batch, by=1):
    return {**batch, "tokens": np.roll(batch["tokens"], -by, axis=1)}


class Shift:
    def __call__(self, batch):
        return shift(batch)


@pytest.fixture
def shards(tmp_path, monkeypatch):
    monkeypatch.setenv("QUERN_ALLOW", "test_dump")  # load_config may import this module's shift
    write_shards(tmp_path)
    return str(tmp_path / "toks-*.array_record")


def _pipe(paths):
    return (
        quern.Pipeline.from_source(quern.sources.ArrayRecordSource(paths, name="toks"), seed=7, num_epochs=3)
        .shuffle("block", block_size=50, window=4)
        .map(quern.transforms.decode(np.uint8))
        .map(quern.transforms.pad(12))
        .batch(8, drop_remainder=False)
        .map_batch(functools.partial(shift, by=3))
    )


def test_a_pipeline_of_files_round_trips_through_its_config(shards):
    pipe = _pipe(shards)
    cfg = pipe.to_config()
    assert yaml.safe_load(yaml.safe_dump(cfg)) == cfg  # plain data
    assert cfg["source"]["type"] == "array_record" and cfg["source"]["name"] == "toks"
    assert cfg["batch"] == {"size": 8, "drop_remainder": False}
    assert cfg["batch_transforms"] == [{"fn": "test_dump:shift", "kind": "map_batch", "kwargs": {"by": 3}}]
    assert_same_pipeline(pipe, quern.load_config(cfg), (0, 7, pipe.num_steps - 1))


def test_registered_transforms_are_written_by_name_and_fields():
    got = transform_config(quern.transforms.pad(16, key="ids"), "map", "transforms.1")
    assert got["name"] == "pad" and got["kind"] == "map"
    assert got["kwargs"]["length"] == 16 and got["kwargs"]["key"] == "ids"
    assert transform_config(quern.transforms.decode(np.int32), "map", "t")["kwargs"]["dtype"] == "<i4"


@pytest.mark.parametrize(
    "fn", [lambda b: b, functools.partial(shift, 2), Shift()], ids=["lambda", "positional-partial", "instance"]
)
def test_a_transform_without_a_config_form_is_named_by_its_key_path(fn):
    with pytest.raises(ValueError, match=r"^batch_transforms\.2: .* is not a registered transform or an importable"):
        transform_config(fn, "map_batch", "batch_transforms.2")


def test_an_in_memory_source_has_no_config_form():
    src = quern.Pipeline.from_source({"x": np.arange(4)}).source
    with pytest.raises(ValueError, match=r"^mix\.components\.0\.source 'arrays' \(ArraySource\) has no config form"):
        source_config(src, "mix.components.0.source")


@pytest.mark.parametrize(
    "weights,want", [([7, 3], [0.7, 0.3]), ([0.25, 0.75], [0.25, 0.75]), ([1, 1, 1], [0.3, 0.3, 0.3]), ([1, 0], [1, 0])]
)
def test_weights_are_written_as_the_shortest_decimals_that_quantize_back(weights, want):
    names = tuple("abc"[: len(weights)])
    got = weights_config(names, quantize(weights))
    assert got == dict(zip(names, want)) and quantize(list(got.values())) == quantize(weights)
