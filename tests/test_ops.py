"""pipeline/ops.py: the transform stages of a definition (``OpKind``, ``Op``) and the name a stage
goes by in labels, metrics and messages (``stage_name``; more callables: test_exposure.py)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import quern
from quern.pipeline.core.ops import BATCH_KINDS, DEVICE_KINDS, RECORD_KINDS, Op, OpKind, stage_name


def double(record):
    return {"x": record["x"] * 2}


class Tokenizer:
    def encode(self, record):
        return record

    def __call__(self, record):
        return record


def test_the_kinds_are_the_names_configs_use_and_split_by_level():
    assert [k.value for k in OpKind] == [
        "map",
        "random_map",
        "map_batch",
        "random_map_batch",
        "filter",
        "flat_map",
        "map_device",
        "random_map_device",
    ]
    levels = (set(RECORD_KINDS), set(BATCH_KINDS), set(DEVICE_KINDS))
    assert set.union(*levels) == set(OpKind) and sum(map(len, levels)) == len(OpKind)  # each kind at one level
    assert OpKind("filter") is OpKind.FILTER and OpKind.MAP == "map"


def test_an_op_takes_its_kind_by_value_and_is_frozen():
    op = Op("random_map", double)
    assert op.kind is OpKind.RANDOM_MAP and op.name == "double" and op.label(2) == "random_map[2] double"
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.fn = len
    with pytest.raises(ValueError):
        Op("mapp", double)


@pytest.mark.parametrize(
    "fn,name",
    [
        (double, "double"),
        (Tokenizer().encode, "Tokenizer.encode"),
        (Tokenizer(), "Tokenizer"),
        (functools.partial(double, 3), "partial(double)"),
        (functools.wraps(double)(lambda r: r), "double"),
        (lambda r: r, "<lambda>"),
        (np.sqrt, "sqrt"),
        (quern.transforms.decode(np.uint8), "decode"),
    ],
    ids=["function", "method", "instance", "partial", "wrapper", "lambda", "ufunc", "builtin-transform"],
)
def test_a_stage_is_named_by_what_it_is(fn, name):
    assert stage_name(fn) == name


def test_a_stage_name_never_holds_arguments_or_addresses():
    secret = "token-1234"
    name = stage_name(functools.partial(double, secret))
    assert secret not in name and "0x" not in stage_name(object())


def test_the_pipelines_stages_carry_their_labels():
    pipe = quern.Pipeline.from_source({"x": np.arange(8)}).map(double).filter(lambda r: True).batch(4)
    assert [op.kind for op in pipe.record_ops] == [OpKind.MAP, OpKind.FILTER]
    assert pipe.record_ops[0].label(0) == "map[0] double" and pipe.record_ops[1].name.endswith("<lambda>")
