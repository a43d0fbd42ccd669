"""pipeline/tree.py: walking batches (nested dicts, tuples, namedtuples and lists of arrays)."""

from collections import OrderedDict, namedtuple

import numpy as np

from quern.pipeline.core.tree import leaves, map_leaves, to_plain

Pair = namedtuple("Pair", "a b")


def test_map_leaves_keeps_the_structure_and_the_order():
    tree = {"b": Pair(1, [2, (3,)]), "a": 4}
    seen = []
    out = map_leaves(lambda x: seen.append(x) or x * 10, tree)
    assert out == {"b": Pair(10, [20, (30,)]), "a": 40} and seen == [1, 2, 3, 4]
    assert type(out["b"]) is Pair and type(out["b"].b) is list and type(out["b"].b[1]) is tuple
    assert list(out) == ["b", "a"]


def test_any_mapping_becomes_a_dict_and_anything_else_is_a_leaf():
    out = map_leaves(str, OrderedDict(x=np.arange(2), y={1, 2}, z=None))
    assert type(out) is dict and out == {"x": "[0 1]", "y": "{1, 2}", "z": "None"}
    assert map_leaves(lambda a: a + 1, np.arange(3)).tolist() == [1, 2, 3]  # an array is one leaf


def test_leaves_have_key_paths():
    tree = {"tokens": np.arange(3), "pair": Pair(1, [2, 3])}
    got = leaves(tree)
    assert [path for path, _ in got] == [
        "batch['tokens']",
        "batch['pair'][0]",
        "batch['pair'][1][0]",
        "batch['pair'][1][1]",
    ]
    assert got[0][1] is tree["tokens"] and [v for _, v in got[1:]] == [1, 2, 3]
    assert leaves(5, "row") == [("row", 5)]


def test_to_plain_gives_json_able_data():
    out = to_plain({"x": np.arange(2, dtype=np.int32), "y": (np.float32(0.5), Pair(np.bool_(True), "s"))})
    assert out == {"x": [0, 1], "y": [0.5, [True, "s"]]}
    assert type(out["x"][0]) is int and type(out["y"][0]) is float and type(out["y"][1][0]) is bool
