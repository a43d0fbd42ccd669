"""Tests of pipeline/batch_digest.py and the digest methods of pipeline/identity.py (issue 24, point 1).

A row digest is over the row's canonical content (leaf paths, dtypes, row shapes, bytes in C
order, little-endian), so it does not depend on memory layout; the hosts' lists concatenated in
host order are the global batch's; the step digest is a hash of the row digests in row order, so
it depends on neither the host count nor the worker count. The golden values are computed here
by hand with ``xxhash`` (and pinned as literals), not by the code under test.
"""

from __future__ import annotations

import functools
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import xxhash

import quern
from quern.pipeline.integrity.batch_digest import (
    digests_of,
    leaf_row_digests,
    ledger_digests,
    row_digests_of,
    step_digest_of,
)

pytestmark = pytest.mark.timeout(120)


def _batch(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, 1000, (n, 5, 3), dtype=np.int32),
        "score": rng.random(n),
        "pair": (rng.integers(0, 9, (n, 2), dtype=np.uint8), rng.random((n, 4)).astype(np.float16)),
    }


def _mixed(n, seed):
    src = {"x": np.arange(n * 3, dtype=np.int64).reshape(n, 3) + 100 * seed, "y": np.arange(n) * 0.5}
    return quern.Pipeline.from_source(src, seed=seed).shuffle()


PIPES = {
    "plain": lambda: quern.Pipeline.from_source({"x": np.arange(200).reshape(50, 4)}, seed=3).shuffle().batch(8),
    "filtered": lambda: (
        quern.Pipeline.from_source({"x": np.arange(60)}, seed=1).shuffle().filter(lambda r: r["x"] % 3 != 0).batch(4)
    ),
    "mixture": lambda: (
        quern.mix({"a": _mixed(40, 1), "b": _mixed(25, 2)}, weights={"a": 0.6, "b": 0.4}, seed=2)
        .map(lambda r: {**r, "y": r["y"] * 2})
        .batch(8)
    ),
}


# --------------------------------------------------------------------------- layout independence


def test_digests_do_not_depend_on_memory_layout_byte_order_or_key_order():
    b = _batch()
    want = digests_of(b)
    fortran = {"tokens": np.asfortranarray(b["tokens"]), "score": b["score"], "pair": b["pair"]}
    wide = np.zeros((12, 5, 3), dtype=np.int32)
    wide[::2] = b["tokens"]  # a strided view of the same values
    strided = {"pair": b["pair"], "score": b["score"].astype(">f8"), "tokens": wide[::2]}  # keys reordered too
    assert not fortran["tokens"].flags.c_contiguous and not strided["tokens"].flags.c_contiguous
    for same in (fortran, strided, {**b, "pair": list(b["pair"])}):  # a list holds the same leaves as the tuple
        assert digests_of(same) == want
    assert len(set(want.rows)) == len(want.rows)  # distinct rows, distinct digests


def test_digests_change_with_any_value_dtype_shape_or_path():
    b = _batch()
    base = row_digests_of(b)
    changed = {**b, "score": b["score"].copy()}
    changed["score"][4] += 1e-9
    got = row_digests_of(changed)
    assert [i for i in range(6) if got[i] != base[i]] == [4]  # only row 4's digest moves
    assert digests_of(changed).leaves.keys() == digests_of(b).leaves.keys()
    assert [k for k, v in digests_of(changed).leaves.items() if v != digests_of(b).leaves[k]] == ["batch['score']"]
    for other in (
        {**b, "tokens": b["tokens"].astype(np.int64)},  # the same values, another dtype
        {**b, "tokens": b["tokens"].reshape(6, 3, 5)},  # the same bytes, another row shape
        {"tok": b["tokens"], "score": b["score"], "pair": b["pair"]},  # another path
    ):
        assert all(x != y for x, y in zip(row_digests_of(other), base))


def test_per_leaf_row_digests_say_which_leaf_of_a_row_differs():
    b = _batch()
    changed = {**b, "pair": (b["pair"][0], b["pair"][1].copy())}
    changed["pair"][1][2, 0] += 1
    mine, theirs = leaf_row_digests(b), leaf_row_digests(changed)
    assert list(mine) == ["batch['pair'][0]", "batch['pair'][1]", "batch['score']", "batch['tokens']"]
    assert [(p, i) for p in mine for i in range(6) if mine[p][i] != theirs[p][i]] == [("batch['pair'][1]", 2)]


def test_bytes_and_str_rows_are_digested_by_their_bytes_and_type():
    text = quern.collate([{"t": "héllo", "b": b"\x00x", "n": np.int8(i)} for i in range(3)])
    assert text["t"].dtype == object
    d = row_digests_of(text)
    assert len(set(d)) == 3
    as_bytes = {**text, "t": np.array([s.encode() for s in text["t"]], dtype=object)}
    assert row_digests_of(as_bytes) != d  # the same bytes as str and as bytes differ
    with pytest.raises(TypeError, match=r"step 9: leaf batch\['t'\] is an object array holding int"):
        row_digests_of({**text, "t": np.array([1, 2, 3], dtype=object)}, "step 9")


# --------------------------------------------------------------------------- leaves without a row axis


@pytest.mark.parametrize(
    "extra, what",
    [
        (np.float32(1.5), r"is a numpy.float32 scalar, not an array with a row axis"),
        (7, r"is an int, not an array with a row axis"),
        (np.array(3.0), r"is a 0-d array \(dtype float64\), it has no row axis"),
        (np.zeros(5), r"has shape \(5,\), 5 along its first axis, while the batch has 6 rows"),
    ],
)
def test_a_leaf_without_a_row_axis_is_refused_naming_it_and_where(extra, what):
    with pytest.raises(ValueError, match=rf"^step 4 \(host 1 of 2\): leaf batch\['loss_scale'\] {what}"):
        digests_of({**_batch(), "loss_scale": extra}, "step 4 (host 1 of 2)")
    src = {"x": np.arange(20), "y": np.ones(20)}
    pipe = quern.Pipeline.from_source(src, seed=0).batch(4).map_batch(lambda b: {**b, "n": extra})
    with pytest.raises(ValueError, match=r"^step 2 \(host 0 of 1\): leaf batch\['n'\]"):
        pipe.row_digests(2)
    with pytest.raises(ValueError, match=r"do not share a row axis \(batch\['a'\] has 2, batch\['b'\] has 3"):
        row_digests_of({"a": np.zeros(2), "b": np.zeros(3)})


def test_an_empty_batch_has_no_leaf_to_digest():
    with pytest.raises(ValueError, match="has no leaf"):
        row_digests_of({}, "step 0")


# --------------------------------------------------------------------------- golden values, by hand


_M64 = 2**64 - 1


def _splitmix(x: int) -> int:
    """SplitMix64's finaliser, by hand."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _fold(seed: int, data: bytes) -> int:
    """``s = hash64(s) ^ w`` over the 8-byte little-endian words of ``data``, zero-padded."""
    data += bytes(-len(data) % 8)
    for i in range(0, len(data), 8):
        seed = _splitmix(seed) ^ int.from_bytes(data[i : i + 8], "little")
    return seed


def _xor_seed(part: bytes, seed: int) -> str:
    """A row digest: its last part XOR the seed as 8 bytes little-endian, twice."""
    return bytes(x ^ y for x, y in zip(part, seed.to_bytes(8, "little") * 2)).hex()


def _layout_seed(layout) -> int:
    return xxhash.xxh3_64_intdigest(json.dumps(layout, separators=(",", ":")).encode())


def test_golden_row_leaf_and_step_digests_computed_by_hand():
    a = np.array([[1, -2], [3, 4], [5, 600]], dtype=np.int32)  # 8 bytes a row: small
    b = np.array([0.5, -1.0, 2.25])  # 8 bytes: small (16 in all: two words folded into the seed)
    c = np.arange(30, dtype=">i2").reshape(3, 10)  # 20 bytes a row, big-endian: large, as little-endian
    t = np.array(["x", "yz", ""], dtype=object)  # large, the last
    batch = {"t": t, "c": c, "b": b, "a": a}
    L = _layout_seed(
        [["batch['a']", "<i4", [2]], ["batch['b']", "<f8", []], ["batch['c']", "<i2", [10]], ["batch['t']", "|O", []]]
    )

    def text(s: str) -> bytes:
        return b"s" + len(s.encode()).to_bytes(8, "little") + s.encode()

    part_c = [xxhash.xxh3_128_digest(c[i].astype("<i2").tobytes()) for i in range(3)]
    part_t = [xxhash.xxh3_128_digest(text(t[i])) for i in range(3)]
    small = [a[i].astype("<i4").tobytes() + b[i].astype("<f8").tobytes() for i in range(3)]
    rows = [_xor_seed(part_t[i], _fold(_fold(L, small[i]), part_c[i])) for i in range(3)]
    leaf_c = xxhash.xxh3_128_hexdigest(b"".join(part_c), _layout_seed(["batch['c']", "<i2", [3, 10]]))
    leaf_a = xxhash.xxh3_128_hexdigest(a.astype("<i4").tobytes(), _layout_seed(["batch['a']", "<i4", [3, 2]]))
    step = xxhash.xxh3_128_hexdigest(b"".join(bytes.fromhex(r) for r in rows))
    d = digests_of(batch)
    assert d.rows == rows
    assert (d.leaves["batch['c']"], d.leaves["batch['a']"]) == (leaf_c, leaf_a)
    assert step_digest_of(d.rows) == step
    # pinned: a change of the canonical form would change the digests of every ledger written
    assert (rows, step, leaf_c) == (
        ["5532bcf75863a85edc084f20f7ac39ab", "a95fc735802fc08e8c6d32f2a47d9ea8", "a5357e62e40688e1b6b98a4b40c4cf3e"],
        "f488f5329b480b80f33b786537d01d60",
        "d0754a860af64459bf94b718d7e90eb4",
    )


def test_golden_digests_of_a_token_batch_and_of_small_leaves_only():
    tokens = np.arange(24, dtype=np.int32).reshape(3, 8)  # 32 bytes a row: large
    length = np.array([8, 5, 1], dtype=np.int32)  # one word: the seed is hash64(L) ^ length
    L = _layout_seed([["batch['length']", "<i4", []], ["batch['tokens']", "<i4", [8]]])
    parts = [xxhash.xxh3_128_digest(tokens[i].tobytes()) for i in range(3)]
    rows = [_xor_seed(parts[i], _splitmix(L) ^ int(length[i])) for i in range(3)]
    leaves = {
        "batch['length']": xxhash.xxh3_128_hexdigest(length.tobytes(), _layout_seed(["batch['length']", "<i4", [3]])),
        "batch['tokens']": xxhash.xxh3_128_hexdigest(b"".join(parts), _layout_seed(["batch['tokens']", "<i4", [3, 8]])),
    }
    batch = {"tokens": tokens, "length": length}  # a flat dict of C-ordered arrays, as collate makes
    assert digests_of(batch) == (rows, leaves)
    n, row_json, leaf_json = ledger_digests(batch)
    assert (n, json.loads(row_json), json.loads(leaf_json)) == (3, rows, leaves)
    assert leaf_row_digests(batch)["batch['tokens']"] == [
        _xor_seed(parts[i], _layout_seed([["batch['tokens']", "<i4", [8]]])) for i in range(3)
    ]
    # small leaves only: one part, the row's bytes of all leaves; the seed is L
    y = np.array([7, -1, 2**40], dtype=np.int64)
    z = np.array([1, 2, 3], dtype=np.uint8)
    Ly = _layout_seed([["batch['y']", "<i8", []], ["batch['z']", "|u1", []]])
    small = [_xor_seed(xxhash.xxh3_128_digest(y[i].tobytes() + z[i].tobytes()), Ly) for i in range(3)]
    assert row_digests_of({"z": z, "y": y}) == small
    assert (rows, small) == (
        ["a8956d57ec54562e8965ca3b823b8925", "0e74f3b673550589735365a033936195", "b847dc2c17a64eda5aa747fcc2891bd0"],
        ["675e5e202915f68514428b1d6cefafe7", "d661478018b8f7e9b71191539ff42ee7", "afbdc7e16f301e8b84e620ee5afa049a"],
    )


def test_a_flat_dict_batch_digests_as_its_canonical_form_does():
    """The flat dict of C-ordered arrays (taken as it is) and other layouts of it (made canonical) agree."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 30000, (16, 40), dtype=np.int32)
    batch = {"tokens": tokens, "length": rng.integers(1, 40, 16).astype(np.int32), "w": rng.random(16)}

    class Wrapped:  # an array-like that is no ndarray (a jax.Array, say)
        def __init__(self, a):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype

        def __array__(self, dtype=None, copy=None):
            return self.a

    want = digests_of(batch)
    wide = np.zeros((16, 80), dtype=np.int32)
    wide[:, ::2] = tokens
    for other in (
        {"w": batch["w"], "length": batch["length"], "tokens": np.asfortranarray(tokens)},
        {**batch, "tokens": wide[:, ::2], "w": batch["w"].astype(">f8")},
        {**batch, "tokens": Wrapped(tokens)},
        {"tokens": tokens, "nested": {"length": batch["length"]}, "w": batch["w"]},  # another path: differs
    ):
        got = digests_of(other)
        same = "nested" not in other
        assert (got == want) is same
        n, rows, leaves = ledger_digests(other)
        assert (n, json.loads(rows), json.loads(leaves)) == (16, got.rows, got.leaves)
    empty = {"x": np.zeros((0, 3), np.int32), "n": np.zeros(0)}  # no rows: no digest
    n, rows, leaves = ledger_digests(empty)
    assert (n, rows, json.loads(leaves)) == (0, "[]", digests_of(empty).leaves) and digests_of(empty).rows == []


# --------------------------------------------------------------------------- host, worker and step independence


@pytest.mark.parametrize("kind", list(PIPES))
def test_the_hosts_lists_concatenated_are_the_global_list_for_any_host_count(kind):
    pipe = PIPES[kind]()
    for step in (0, 1, 5):
        glob = pipe.row_digests(step)
        assert len(glob) == 8 if kind != "filtered" else len(glob) == 4
        for hosts in (1, 2, 4):
            got = [d for h in range(hosts) for d in pipe.row_digests(step, h, hosts)]
            assert got == glob, (kind, step, hosts)
        assert pipe.step_digest(step) == step_digest_of(glob)
    assert len({pipe.step_digest(s) for s in range(6)}) == 6


def test_digests_of_the_batches_of_two_worker_processes_are_batch_at_s():
    pipe = PIPES["mixture"]()
    with pipe.iterator(3, num_workers=2, process_index=1, process_count=2) as it:
        got = [row_digests_of(next(it)) for _ in range(6)]
    assert got == [pipe.row_digests(s, 1, 2) for s in range(3, 9)]


def test_a_packed_pipelines_digests_split_over_hosts(tmp_path):
    docs = [{"tokens": np.arange(1 + i % 11, dtype=np.int32) + i} for i in range(90)]
    lengths = np.array([len(d["tokens"]) for d in docs])
    pipe = (
        quern.Pipeline.from_source(docs, seed=4)
        .shuffle()
        .pack(16, key="tokens", lengths=lengths, cache_dir=tmp_path)
        .batch(4)
    )
    for step in (0, 3):
        glob = pipe.row_digests(step)
        assert [d for h in range(4) for d in pipe.row_digests(step, h, 4)] == glob
        assert step_digest_of(glob) == pipe.step_digest(step)


def test_fingerprint_at_is_the_fingerprint_without_a_past_and_keeps_the_past_of_an_edit():
    pipe = PIPES["plain"]()
    assert {pipe.fingerprint_at(s) for s in (0, 3, 6)} == {pipe.fingerprint()}
    edited = pipe.skip_steps(3, 5)
    assert edited.fingerprint() != pipe.fingerprint()
    before = [edited.fingerprint_at(s) for s in range(3)]
    after = [edited.fingerprint_at(s) for s in range(3, 6)]
    assert set(before) == {pipe.fingerprint()}  # the steps before the edit: the unedited pipeline's
    assert len(set(after)) == 1 and after[0] != pipe.fingerprint()
    finite = quern.Pipeline.from_source({"x": np.arange(20)}, seed=0, num_epochs=1).batch(4)
    with pytest.raises(IndexError, match="past the end"):
        finite.fingerprint_at(5)


# --------------------------------------------------------------------------- dtypes by name, structures by value (issue 36)


def _ml_dtypes():
    """Every dtype ml_dtypes defines (17 of them share ``dtype.str == '<V1'``)."""
    out = []
    for name in sorted(dir(ml_dtypes)):
        t = getattr(ml_dtypes, name)
        if isinstance(t, type) and issubclass(t, np.generic):
            out.append(np.dtype(t))
    return out


def _same_bytes(dtype, n=6, width=24, seed=0):
    """Rows of ``width`` bytes (one row of the same bytes for every dtype) viewed as ``dtype``."""
    raw = np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)
    return raw.view(dtype)


def test_every_dtype_gives_its_own_digests_for_the_same_bytes():
    """float8_e4m3fn and int4 rows of the same bytes were equal: both '<V1'."""
    dtypes = _ml_dtypes() + [np.dtype(t) for t in ("u1", "i1", "f2", "i2", "u2", "f4", "i4", "u4", "c8", "V1", "V4")]
    assert sum(d.str == "<V1" for d in dtypes) >= 17
    for width in (1, 2, 4, 24):  # 1-4 bytes a row: a small leaf (through the seed); 24: a large one (hashed)
        kinds = [d for d in dtypes if width % d.itemsize == 0]
        digests = {}
        for d in kinds:
            batch = {"x": _same_bytes(d, width=width)}
            rows, leaf = row_digests_of(batch), digests_of(batch).leaves["batch['x']"]
            with_another_leaf = row_digests_of({**batch, "n": np.arange(6)})
            digests[d] = (rows[0], leaf, with_another_leaf[0], json.loads(ledger_digests(batch)[1])[0])
        for k in range(4):
            seen = [v[k] for v in digests.values()]
            assert len(set(seen)) == len(kinds), (width, k, [str(d) for d in kinds])


def _view_as(batch, dtype):
    return {"x": batch["x"].view(dtype)}


def test_two_pipelines_differing_only_in_a_float8_cast_differ():
    src = {"x": np.arange(64 * 8, dtype=np.uint8).reshape(64, 8)}
    pipes = {
        t.name: quern.Pipeline.from_source(src, seed=0).batch(4).map_batch(functools.partial(_view_as, dtype=t))
        for t in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.float8_e5m2))
    }
    assert len({p.fingerprint() for p in pipes.values()}) == 3  # the dtype argument: by name
    assert len({p.step_digest(1) for p in pipes.values()}) == 3  # the same bytes in each step
    assert len({p.row_digests(1)[0] for p in pipes.values()}) == 3


def _record_dtype(order="<", align=False, gap=0):
    """One record type, laid out several ways: byte order, aligned or packed, extra room after ``n``."""
    inner = np.dtype([("a", order + "i2"), ("b", ml_dtypes.bfloat16, (2,))])
    fields = [("n", "u1"), ("x", order + "f8"), ("s", inner), ("t", order + "i4", (2, 3))]
    packed = np.dtype(fields, align=align)
    if not gap:
        return packed
    offsets = [packed.fields[name][1] + (gap if name != "n" else 0) for name, *_ in fields]
    return np.dtype(
        {"names": [f[0] for f in fields], "formats": [packed.fields[f[0]][0] for f in fields], "offsets": offsets},
        align=align,
    )


def _records(dtype, n=5, seed=1, garbage=0):
    """``n`` rows of 3 records of fixed values; the bytes outside the fields (padding) set to ``garbage``."""
    rng = np.random.default_rng(seed)
    out = np.full((n, 3, dtype.itemsize), garbage, np.uint8).view(dtype).reshape(n, 3)
    out["n"] = rng.integers(0, 256, (n, 3))
    out["x"] = rng.random((n, 3))
    out["s"]["a"] = rng.integers(-999, 999, (n, 3))
    out["s"]["b"] = rng.random((n, 3, 2)).astype(ml_dtypes.bfloat16)
    out["t"] = rng.integers(-(2**31), 2**31, (n, 3, 2, 3))
    return out


def test_structured_leaves_are_digested_by_their_fields_values_only():
    want = digests_of({"r": _records(_record_dtype()), "k": np.arange(5)})
    wide_dtype = np.dtype([("n", "u1"), ("junk", "i8"), ("x", "f8"), ("s", _record_dtype()["s"]), ("t", "i4", (2, 3))])
    wide = np.zeros((5, 3), wide_dtype)
    for name in ("n", "x", "s", "t"):
        wide[name] = _records(_record_dtype())[name]
    wide["junk"] = np.arange(15).reshape(5, 3) * 12345  # bytes outside the fields of the view below
    layouts = {
        "aligned, padding 0xAB": _records(_record_dtype(align=True), garbage=0xAB),
        "big-endian": _records(_record_dtype(">"), garbage=7),
        "room after a field": _records(_record_dtype(gap=5), garbage=0xFF),
        "aligned big-endian": _records(_record_dtype(">", align=True, gap=8), garbage=0x5A),
        "a multi-field view": wide[["n", "x", "s", "t"]],
        "Fortran order": np.asfortranarray(_records(_record_dtype(align=True), garbage=1)),
        "a strided view": np.repeat(_records(_record_dtype(), garbage=3), 2, axis=0)[::2],
    }
    for what, r in layouts.items():
        assert r.dtype.itemsize != 0 and np.array_equal(r, _records(_record_dtype())), what
        batch = {"r": r, "k": np.arange(5)}
        assert digests_of(batch) == want, what
        n, rows, leaves = ledger_digests(batch)
        assert (json.loads(rows), json.loads(leaves)) == tuple(want), what
    changed = _records(_record_dtype())
    changed["s"]["b"][3, 1, 0] = 2.5
    got = row_digests_of({"r": changed, "k": np.arange(5)})
    assert [i for i in range(5) if got[i] != want.rows[i]] == [3]


def test_structured_leaves_of_other_fields_differ_and_object_fields_are_refused():
    base = np.zeros((4, 2), [("a", "i4"), ("b", "f4")])
    base["a"], base["b"] = np.arange(8).reshape(4, 2), 0.5
    d = row_digests_of({"r": base})
    for other in (
        base.astype([("b", "i4"), ("a", "f4")]),  # fields renamed (the same bytes by position)
        base[["b", "a"]],  # fields reordered
        base.astype([("a", "i4"), ("b", ml_dtypes.float8_e4m3fn, (4,))]).view([("a", "i4"), ("b", "f4")]),
        base.astype([(("A", "a"), "i4"), ("b", "f4")]),  # a title
        base.view(np.int64),  # the same bytes, not a structure
    ):
        assert all(x != y for x, y in zip(row_digests_of({"r": other}), d)), other.dtype
    bad = np.zeros((2,), [("a", "i4"), ("s", [("o", "O")])])
    with pytest.raises(TypeError, match=r"step 7: leaf batch\['r'\] has a structured dtype whose field 's.o' holds"):
        row_digests_of({"r": bad}, "step 7")


def test_byte_order_strings_and_datetimes_are_digested_by_value_and_dtype():
    same = [
        (np.array([["ab", "c"]] * 3, "<U3"), np.array([["ab", "c"]] * 3, ">U3")),
        (np.arange(6).astype("<M8[ns]").reshape(3, 2), np.arange(6).astype(">M8[ns]").reshape(3, 2)),
        (
            np.arange(6, dtype=ml_dtypes.bfloat16),
            np.arange(6, dtype=ml_dtypes.bfloat16).astype(np.dtype(ml_dtypes.bfloat16).newbyteorder(">")),
        ),
    ]
    for a, b in same:
        assert row_digests_of({"x": a}) == row_digests_of({"x": b}), (a.dtype, b.dtype)
    differ = [
        (np.array(["ab"] * 3, "<U3"), np.array(["ab"] * 3, "<U4")),  # another width: another dtype
        (np.array([b"ab"] * 3, "S4"), np.array(["ab"] * 3, "<U1").view("S4")),
        (np.array(["ab"] * 3, object), np.array(["ab"] * 3, np.dtypes.StringDType())),
        (np.arange(3).astype("<M8[ns]"), np.arange(3).astype("<m8[ns]")),
    ]
    for a, b in differ:
        assert not set(row_digests_of({"x": a})) & set(row_digests_of({"x": b})), (a.dtype, b.dtype)


def test_the_padding_bytes_of_x87_long_doubles_do_not_enter():
    if np.finfo(np.longdouble).nmant != 63:
        pytest.skip("np.longdouble is not x87 extended precision here: no padding bytes")
    x = np.array([[1.5, -2.25], [3.0, 1 / 3]], np.longdouble)
    y = x.copy()
    y.view(np.uint8).reshape(2, 2, -1)[:, :, 10:] = 0xCD  # padding: undefined in NumPy's own arrays
    assert np.array_equal(x, y) and x.tobytes() != y.tobytes()
    assert row_digests_of({"x": x}) == row_digests_of({"x": y})
    assert row_digests_of({"x": x.astype(np.clongdouble)}) == row_digests_of({"x": y.astype(np.clongdouble)})


def test_golden_digests_of_an_ml_dtype_and_a_structured_leaf_computed_by_hand():
    f8 = np.array([[0x38, 0x40], [0, 0x7F], [0xB8, 1]], np.uint8).view(ml_dtypes.float8_e4m3fn)  # 2 bytes a row
    rec = np.zeros(3, np.dtype([("n", "u1"), ("x", ">f4")], align=True))  # 3 padding bytes after n
    rec.view(np.uint8)[:] = 0xEE
    rec["n"], rec["x"] = [1, 2, 3], [0.5, -1.0, 8.0]
    batch = {"f": f8, "r": rec}
    L = _layout_seed(
        [
            ["batch['f']", "ml_dtypes.float8_e4m3fn:<V1", [2]],
            ["batch['r']", '{"fields":[["n",null,"|u1"],["x",null,"<f4"]]}', []],
        ]
    )
    small = [bytes(f8.view(np.uint8)[i]) + struct.pack("<Bf", int(rec["n"][i]), float(rec["x"][i])) for i in range(3)]
    rows = [_xor_seed(xxhash.xxh3_128_digest(small[i]), L) for i in range(3)]  # small leaves only: one part
    assert row_digests_of(batch) == rows
    leaf_r = xxhash.xxh3_128_hexdigest(
        b"".join(s[2:] for s in small),
        _layout_seed(["batch['r']", '{"fields":[["n",null,"|u1"],["x",null,"<f4"]]}', [3]]),
    )
    assert digests_of(batch).leaves["batch['r']"] == leaf_r
    # pinned: what a ledger of these leaves holds (digest format 2)
    assert (rows, leaf_r) == (
        ["895a909c1f661ef68d66b33e984fcc40", "9ba3871df96df3926eb47f37df75f381", "fa9e7f2a977d34a8cadd239aebacabf4"],
        "5d5b84f89f4bb184f6b7179ba7407c4c",
    )
