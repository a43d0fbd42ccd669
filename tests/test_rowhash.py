"""The row hash's C loop gives xxhash's own digests, and batch digests do not depend on which path made them.

``quern.pipeline.integrity.rowhash`` hashes all rows of a leaf in one call to a C library built with the
wheel (``.build/hatch_build.py``), or row by row in Python without it. Every expected value here comes
from the ``xxhash`` package or ``binascii`` directly, or from a process where the library is off
(``QUERN_NATIVE=0``). ``Digesting`` / ``StepFields`` (a chunk's ledger fields made together) are
checked against ``ledger_digests`` / ``step_fields`` of each batch alone.
"""

from __future__ import annotations

import binascii
import ctypes
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest
import xxhash

import quern
from quern.pipeline.integrity import batch_digest, digesting, ledger, rowhash

HAVE_CC = bool(shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"))


def per_row(rows) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(r) for r in rows)


def test_the_installed_wheel_uses_the_c_row_hash():
    if not HAVE_CC:
        pytest.skip("no C compiler here: the wheel is built without the row hash (the Python path is tested)")
    assert rowhash.is_native(), rowhash.native_why()
    assert rowhash.LIBRARY.is_file()


@pytest.mark.parametrize("width", [0, 1, 3, 15, 16, 17, 64, 128, 129, 240, 241, 1000, 2048, 4096, 70_000])
def test_rows_digests_equal_xxhash_of_each_row(width):
    rng = np.random.default_rng(width)
    mat = rng.integers(0, 256, (7, width), dtype=np.uint8)
    assert rowhash.rows_digests(mat) == per_row(mat)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(24, dtype=np.int32).reshape(4, 6),
        np.arange(60, dtype=np.float64).reshape(3, 4, 5),  # rows of 2-d
        np.zeros((0, 9), np.int64),  # no row
        np.arange(40, dtype=np.int16).reshape(8, 5)[::2],  # strided rows
        np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),  # not C order: its rows in C order
    ],
)
def test_rows_digests_of_shapes_and_layouts(arr):
    assert rowhash.rows_digests(arr) == per_row(np.ascontiguousarray(arr))


def test_spans_and_json_hex_equal_their_references():
    spans = [b"", b"x", bytes(range(256)) * 9, b"", "é".encode()]
    assert rowhash.spans_digests(spans) == per_row(spans)
    assert rowhash.spans_digests([]) == b""
    raw = per_row(spans)
    want = ", ".join(f'"{binascii.hexlify(raw[i : i + 16]).decode()}"' for i in range(0, len(raw), 16))
    assert rowhash.json_hex(raw) == want
    assert rowhash.json_hex(b"") == ""
    out = np.full(len(want), 0xFF, np.uint8)
    rowhash.json_hex_into(raw, out)
    assert out.tobytes().decode() == want
    rowhash.json_hex_into(b"", np.empty(0, np.uint8))
    with pytest.raises(ValueError, match=f"need a C-contiguous uint8 array of {len(want)} bytes"):
        rowhash.json_hex_into(raw, np.empty(len(want) + 2, np.uint8))  # the size is checked: nothing written past it


def _batches():
    rng = np.random.default_rng(3)
    tokens = [
        {"tokens": rng.integers(0, 50_000, (8, 64), dtype=np.int32), "length": rng.integers(0, 64, 8, dtype=np.int32)}
        for _ in range(3)
    ]
    records = np.full((5, 4, 24), 0xAB, np.uint8).view(
        np.dtype([("n", "u1"), ("x", ">f8"), ("t", "i2", (3,))], align=True)
    )
    records = records.reshape(5, 4)
    records["n"], records["x"], records["t"] = 7, rng.random((5, 4)), rng.integers(0, 99, (5, 4, 3))
    return [
        *tokens,  # a run of one layout
        {"x": np.arange(5)},  # small leaves only
        {"a": np.arange(12.0).reshape(4, 3), "b": np.arange(4, dtype=np.uint8), "c": np.arange(4, dtype=np.int64)},
        {"img": rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8), "seg": rng.integers(0, 9, (2, 8, 8))},
        {"text": np.array([b"ab", b"", b"c" * 300], dtype=object), "n": np.arange(3)},  # an object leaf
        tokens[0],  # the first layout again
        {  # other libraries' dtypes (ml_dtypes), a large leaf and a small one
            "f8": rng.integers(0, 256, (4, 40), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
            "bf": rng.random((4, 3)).astype(ml_dtypes.bfloat16),
        },
        {"rec": records, "n": np.arange(5)},  # a structured leaf with padding: its fields packed
        {"rec": records[:, :1], "i4": rng.integers(0, 9, (5, 2)).astype(ml_dtypes.int4)},  # small leaves only
    ]


SCRIPT = """
import json, pickle, sys
from quern.pipeline.integrity import batch_digest, digesting, rowhash
assert not rowhash.is_native() and "QUERN_NATIVE=0" in rowhash.native_why(), rowhash.native_why()
with open(sys.argv[1], "rb") as f:
    batches = pickle.load(f)
out = [[batch_digest.digests_of(b).rows, batch_digest.digests_of(b).leaves, batch_digest.ledger_digests(b)] for b in batches]
d = digesting.Digesting()
for b in batches:
    d.add(b)
json.dump([out, d.finish()], sys.stdout)
"""


def test_batch_digests_are_the_same_without_the_c_library(tmp_path):
    batches = _batches()
    here = [
        [batch_digest.digests_of(b).rows, batch_digest.digests_of(b).leaves, list(batch_digest.ledger_digests(b))]
        for b in batches
    ]
    path = tmp_path / "batches.pkl"
    path.write_bytes(pickle.dumps(batches))
    env = {**os.environ, "QUERN_NATIVE": "0"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    there, together = json.loads(run.stdout)
    assert there == here
    assert [tuple(x) for x in together] == [tuple(x[2]) for x in here]  # Digesting's hex text, in Python


def test_a_chunks_digests_made_together_equal_each_batchs():
    batches = _batches()
    d = digesting.Digesting()
    for b in batches:
        d.add(b)
    assert d.finish() == [batch_digest.ledger_digests(b) for b in batches]
    assert d.finish() == []  # finished: nothing kept
    for b in batches[:3]:
        d.add(b)
    views = d.finish_views()  # the row digests' items (no brackets), in a buffer the next call writes again
    want = [batch_digest.ledger_digests(b) for b in batches[:3]]
    assert [(n, f"[{bytes(v).decode()}]", leaf) for n, v, leaf in views] == want


def test_made_of_gives_each_batchs_ledger_values_in_a_buffer_of_its_own():
    batches = _batches()
    bad = {"x": np.arange(4), "s": np.int64(3)}  # a leaf without a row axis: None, raised where it is yielded
    made = digesting.made_of([batches[0], bad, *batches[1:]])
    assert made[1] is None and all(m is not None for i, m in enumerate(made) if i != 1)
    again = digesting.made_of(batches[::-1])  # another chunk's values...
    d = digesting.Digesting()
    for b in batches:  # ...and another Digesting's write buffers of their own: the first ones' text stays
        d.add(b)
    d.finish_views()
    want = [batch_digest.ledger_digests(b) for b in batches]
    assert [(m.rows, f"[{bytes(m.items).decode()}]", m.leaves) for m in made if m is not None] == want
    assert [(m.rows, f"[{bytes(m.items).decode()}]", m.leaves) for m in again if m is not None] == want[::-1]
    assert digesting.made_of([]) == []


def test_step_fields_made_together_equal_each_steps():
    pipe = quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(40, dtype=np.int64)), seed=0).batch(8)
    fields = ledger.StepFields(pipe, 1, 2)
    for step in range(3):
        fields.add(pipe.batch_at(step, process_index=1, process_count=2), step)
    got = fields.finish()
    assert got == [
        ledger.step_fields(pipe, pipe.batch_at(s, process_index=1, process_count=2), s, 1, 2) for s in range(3)
    ]
    assert json.loads("{" + got[2] + "}")["rows"] == [4, 8]  # host 1 of 2: rows 4..8 of the global batch


def test_a_batch_without_a_row_axis_is_refused_when_added():
    fields = ledger.StepFields(
        quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(8)), seed=0).batch(4), 0, 1
    )
    with pytest.raises(quern.StepError, match=r"step 5 \(host 0 of 1\).*leaf batch\['s'\]"):
        fields.add({"x": np.arange(4), "s": np.int64(3)}, 5)


def _random_batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A batch of 1-5 numeric leaves of random dtypes and row shapes: large, small and empty rows mixed."""
    n = int(rng.integers(0, 9))
    dtypes = [np.uint8, np.int16, np.int32, np.float32, np.int64, np.float64, ml_dtypes.bfloat16]
    shapes = [(), (1,), (2,), (3,), (5,), (0,), (4, 3), (17,), (2, 40), (300,)]
    out = {}
    for i in range(int(rng.integers(1, 6))):
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        shape = (n, *shapes[int(rng.integers(len(shapes)))])
        out[f"leaf{rng.integers(100)}_{i}"] = (rng.random(shape) * 100).astype(dtype)
    return out


def test_the_c_digests_equal_the_python_digests_on_random_layouts():
    """``Digesting`` digests a numeric batch in one C call: its values are the Python path's, layout by layout."""
    if not HAVE_CC:
        pytest.skip("no C compiler here: the wheel is built without the row hash (the Python path is tested)")
    assert digesting.native()
    rng = np.random.default_rng(11)
    batches = [_random_batch(rng) for _ in range(300)]
    d = digesting.Digesting()
    for b in batches:
        d.add(b)
    assert d.finish() == [batch_digest.ledger_digests(b) for b in batches]


def test_an_arrays_address_is_its_first_byte_whether_writable_read_only_empty_or_strided():
    """``rowhash.address`` reads a writable array's buffer through ctypes, and falls back for the others."""
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    read_only = np.frombuffer(base.tobytes(), np.int32).reshape(4, 6)
    assert not read_only.flags.writeable
    others = [base[:, ::2], base[:, 3:], base[::-1], np.asfortranarray(base), np.empty((0, 5), np.int64)]
    others += [read_only, read_only[2:], np.arange(3).astype("datetime64[s]")]  # not a buffer ctypes may view
    others.append(np.broadcast_arrays(np.arange(3), np.zeros((1, 3)))[0])  # numpy warns when its flags are read
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for a in [base, base[1:], *others]:
            assert rowhash.address(a) == a.__array_interface__["data"][0]

    class NoInterface(np.ndarray):  # an array whose interface cannot be read: the ctypes view is used
        @property
        def __array_interface__(self):
            raise AssertionError("the array interface was read")

    assert rowhash.address(base[1:].view(NoInterface)) == base[1:].__array_interface__["data"][0]
    writable, row = np.zeros(3, np.uint8), base[2]
    ctypes.memmove(rowhash.address(writable), rowhash.address(row), 3)  # the bytes at the address are the array's
    assert writable.tolist() == list(row.tobytes()[:3])
    if not HAVE_CC:
        pytest.skip("no C compiler here: the wheel is built without the row hash (the Python path is tested)")
    batch = {"tokens": read_only, "length": np.frombuffer(bytes(range(4)), np.uint8)}  # leaves no one may write
    d = digesting.Digesting()
    d.add(batch)
    d.add({k: v.copy() for k, v in batch.items()})
    assert d.finish() == [batch_digest.ledger_digests(batch)] * 2


def test_a_c_library_that_digests_unlike_python_is_not_used(monkeypatch):
    """A C digest that differs from the Python path's on the check's batches is refused, with a warning."""
    if not HAVE_CC:
        pytest.skip("no C compiler here: the wheel is built without the row hash (the Python path is tested)")
    real = rowhash.batch_digests_into

    def wrong(layout, arrays, n, rows, leaves):  # the row digests right, the last leaf digest's first byte not
        done = real(layout, arrays, n, rows, leaves)
        ctypes_byte = (len(arrays) - 1) * 16
        np.frombuffer((ctypes.c_ubyte * (16 * len(arrays))).from_address(leaves), np.uint8)[ctypes_byte] ^= 1
        return done

    monkeypatch.setattr(rowhash, "batch_digests_into", wrong)
    digesting.native.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="unlike quern's Python path"):
            assert not digesting.native()
        batches = _batches()
        d = digesting.Digesting()
        for b in batches:
            d.add(b)
        assert d.finish() == [batch_digest.ledger_digests(b) for b in batches]  # the Python path's
    finally:
        digesting.native.cache_clear()
