"""pipeline/digest.py: content digests of plain values (the bytes of a fingerprint): by content and
type, never by ``repr`` or address; the same in every process; refused for what has no content."""

from __future__ import annotations

import enum
import hashlib
import re
import subprocess
import sys

import numpy as np
import pytest

from quern.pipeline.digest import digest, update
from quern.pipeline.errors import FingerprintError


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


def test_update_feeds_the_same_bytes_as_digest():
    h = hashlib.blake2b(digest_size=16)
    update(h, {"k": [1, "two"]})
    assert h.hexdigest() == digest({"k": [1, "two"]})


def test_the_digest_is_the_same_in_a_fresh_interpreter():
    code = "from quern.pipeline.digest import digest; print(digest({'a': {3, 1}, 'b': (1.5, b'x', None)}))"
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
