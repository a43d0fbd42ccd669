"""pipeline/digest.py: content digests of plain values (the bytes of a fingerprint): by content and
type, never by ``repr`` or address; the same in every process; refused for what has no content."""

from __future__ import annotations

import enum
import hashlib
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from quern.pipeline.core.errors import FingerprintError
from quern.pipeline.identity.hashing import digest, update


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


class Declared:
    def __init__(self, version):
        self.version = version

    def fingerprint(self):
        return f"v{self.version}"


class BadlyDeclared:
    def fingerprint(self):
        return 3


VALUES = [
    None,
    True,
    1,
    1.0,
    1j,
    "1",
    b"1",
    ...,
    slice(1, 2),
    range(1, 2),
    (1,),
    [1],
    {1},
    frozenset({2}),
    {"a": 1},
    np.int64(1),
    np.array([1]),
    np.array([1], np.int32),
    np.dtype(np.int64),
    Colour.RED,
    re.compile("1"),
    Declared(1),
]


def test_values_of_other_types_or_contents_have_other_digests():
    digests = [digest(v) for v in VALUES]
    assert all(len(d) == 32 and int(d, 16) >= 0 for d in digests)
    assert len(set(digests)) == len(VALUES)


def test_the_digest_follows_the_content_not_the_object():
    assert digest({"a": [1, 2.0], "b": b"x"}) == digest({"b": b"x", "a": [1, 2.0]})  # dict order does not count
    assert digest({3, 1, 2}) == digest({2, 3, 1}) and digest([1, 2]) != digest([2, 1])  # list order does
    assert digest(np.arange(6).reshape(2, 3)) != digest(np.arange(6).reshape(3, 2))  # the shape counts
    assert digest(np.arange(3)) == digest(np.arange(3).copy()) == digest(np.arange(6)[::2] // 2)
    assert digest(Declared(1)) == digest(Declared(1)) != digest(Declared(2))
    assert digest(Colour.RED) != digest(Colour.BLUE)


def test_record_dtypes_are_told_apart_by_their_fields():
    a = np.zeros(2, dtype=[("x", "<i4"), ("y", "<i4")])
    b = np.zeros(2, dtype=[("x", "<f4"), ("y", "<f4")])
    assert a.dtype.str == b.dtype.str and digest(a) != digest(b)


def test_dtypes_of_other_libraries_are_told_apart_by_name():
    """17 ml_dtypes share dtype.str '<V1': a cast to float8 and one to int4 had one fingerprint."""
    types = [t for t in vars(ml_dtypes).values() if isinstance(t, type) and issubclass(t, np.generic)]
    dtypes = [np.dtype(t) for t in types] + [np.dtype(t) for t in ("u1", "i1", "f2", "V1", "V2")]
    assert sum(d.str == "<V1" for d in dtypes) >= 17
    assert len({digest(d) for d in dtypes}) == len(dtypes)
    raw = np.arange(4, dtype=np.uint8)
    same_bytes = [raw.view(d) for d in dtypes if d.itemsize in (1, 2, 4)]
    assert len({digest(a) for a in same_bytes}) == len(same_bytes)
    assert len({digest(a[0]) for a in same_bytes}) == len(same_bytes)  # the scalars too


def test_record_arrays_are_digested_by_their_values_not_their_padding():
    dtype = np.dtype([("n", "u1"), ("x", "<f8"), ("o", "<i4", (2,))], align=True)  # padding after n and o
    a, b = (np.full(3 * dtype.itemsize, fill, np.uint8).view(dtype) for fill in (0, 0xAB))
    for r in (a, b):
        r["n"], r["x"], r["o"] = [1, 2, 3], 0.5, [[1, 2], [3, 4], [5, 6]]
    assert a.tobytes() != b.tobytes() and digest(a) == digest(b) and digest(a[1]) == digest(b[1])
    packed = a.astype(np.dtype([("n", "u1"), ("x", "<f8"), ("o", "<i4", (2,))]))
    assert digest(packed) != digest(a)  # another layout: a dtype is described with its offsets
    assert digest(packed.dtype) != digest(a.dtype)
    with pytest.raises(FingerprintError, match=r"arg has a structured dtype whose field 'p' holds Python objects"):
        digest(np.zeros(1, [("p", "O")]), where="arg")


def test_variable_width_strings_are_digested_by_their_items():
    """A StringDType array's bytes locate its long strings in its own arena: another history, other bytes."""
    words = ["a string longer than fifteen bytes", "short", "another string long enough to be on the heap"]
    a = np.array(words, np.dtypes.StringDType())
    b = np.array(["x" * 60, "short", "y" * 70], np.dtypes.StringDType())
    b[0], b[2] = words[0], words[2]  # the same strings, elsewhere in the arena
    assert a.tobytes() != b.tobytes() and digest(a) == digest(b)
    assert digest(a) != digest(np.array(words, object)) != digest(np.array(words[:2] + ["x"], np.dtypes.StringDType()))


def test_long_doubles_are_digested_without_their_padding():
    if np.finfo(np.longdouble).nmant != 63:
        pytest.skip("np.longdouble is not x87 extended precision here: no padding bytes")
    x = np.array([1.5, 1 / 3], np.longdouble)
    y = x.copy()
    y.view(np.uint8).reshape(2, -1)[:, 10:] = 0xCD
    assert x.tobytes() != y.tobytes() and digest(x) == digest(y) and digest(x[1]) == digest(y[1])


def test_update_feeds_the_same_bytes_as_digest():
    h = hashlib.blake2b(digest_size=16)
    update(h, {"k": [1, "two"]})
    assert h.hexdigest() == digest({"k": [1, "two"]})


def test_the_digest_is_the_same_in_a_fresh_interpreter():
    code = "from quern.pipeline.identity.hashing import digest; print(digest({'a': {3, 1}, 'b': (1.5, b'x', None)}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == digest({"a": {3, 1}, "b": (1.5, b"x", None)})


def test_a_value_without_content_is_refused_naming_where():
    with pytest.raises(
        FingerprintError, match=r"pad, argument 0\['k'\]\[1\]: cannot describe a .*object by its content"
    ):
        digest({"k": [1, object()]}, where="pad, argument 0")


def test_a_fingerprint_method_must_return_a_string():
    with pytest.raises(FingerprintError, match=r"BadlyDeclared.fingerprint\(\) returned int, not a string"):
        digest(BadlyDeclared())


def test_a_value_nested_too_deep_is_refused():
    deep: list = []
    for _ in range(70):
        deep = [deep]
    with pytest.raises(FingerprintError, match="nested more than 64 levels deep"):
        digest(deep)
