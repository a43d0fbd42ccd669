"""Batch digests: one hash per row of a collated batch, over the row's canonical content.

A row's canonical content is, for each leaf of the batch (``batch['tokens']``;
:func:`quern.pipeline.core.tree.leaves`), the leaf's row in canonical form
(:func:`quern.pipeline.identity.canonical.values`: its values in C order, little-endian; a
structured leaf's fields' values packed in field order, without padding or the
bytes outside a field view), and the *layout*: each leaf's path, dtype
description and row shape. So a digest depends on the values, dtypes and shapes
only: never on the memory layout (a Fortran-ordered, strided, big-endian, aligned
or padded batch of the same values gives the same digests), the nesting's
container types or the order of a dict's keys; and two dtypes are never taken for
one (``float8_e4m3fn`` and ``int4`` rows of the same bytes differ). Every byte
is hashed once, by xxHash's XXH3, row by row for each *large* leaf (a
numeric leaf whose rows are over :data:`SMALL` bytes, or an object leaf); the
*small* leaves (a scalar per row) and the layout enter through a 64-bit seed per
row, made with NumPy for all rows at once:

- layout seed ``L = xxh3_64(layout)``, the layout being the JSON text
  ``[[path, dtype, row shape], ...]`` sorted by path (dtype: its description,
  :func:`quern.pipeline.identity.canonical.dtype_text`: ``<i4``, ``|u1``,
  ``ml_dtypes.bfloat16:<V2``, ``{"fields":[["a",null,"<i4"],...]}``, ``|O`` for an
  object leaf; the version of this form is :data:`FORMAT`, in every ledger line);
- the row's *parts*: per large leaf, in path order, ``xxh3_128(row bytes)`` (16
  bytes, as ``xxh3_128_digest`` gives them). A batch without a large leaf has one
  part: ``xxh3_128`` of the row's bytes of all its leaves, concatenated in path order;
- the row's seed: ``s = L``, then ``s = hash64(s) ^ w`` for each 8-byte
  little-endian word ``w`` of, in turn, the row's small leaves' bytes (with a large
  leaf), concatenated in path order and zero-padded to a multiple of 8, and each
  part but the last (two words each); ``hash64`` is SplitMix64's finaliser
  (:func:`quern.pipeline.order.index.hash64`);
- row digest: the last part's 16 bytes XOR ``s`` as 8 bytes little-endian, twice,
  as 32 hex digits. A batch of one leaf: ``xxh3_128(row bytes)`` XOR ``L`` twice;
- leaf digest: ``xxh3_128(X, seed=xxh3_64([path, dtype, shape]))``, ``shape`` with
  the rows and ``X`` a large leaf's parts, row after row, or a small leaf's bytes:
  which leaf of a host slice differs;
- step digest (:func:`step_digest_of`): ``xxh3_128`` of the row digests' 16-byte
  values in row order, so it does not depend on how the rows were split over
  hosts or workers.

Two different rows share a digest with a chance of about ``2**-128`` when their
last parts differ. Otherwise they differ in the words folded into the seed, and
each fold is one-to-one in its word and in the seed before it: the seeds differ
always when one word differs (a ``length``), and but for a chance of ``2**-64``
when several do. A check of accidents, not of forgeries.

An object leaf (``bytes`` and ``str`` rows, as :func:`quern.pipeline.core.collate.collate`
makes them; or NumPy's ``StringDType``, described as such) has as a row's bytes, per
element, a type byte (``b`` or ``s``), the length as 8 bytes little-endian and the
bytes (UTF-8 for ``str``): a large leaf. A structured leaf with a field of Python
objects is refused, naming the field.
The per-row hashing is one call per part (:mod:`quern.pipeline.integrity.rowhash`): a C loop over
xxHash built with the wheel, or, without it, one ``xxhash.xxh3_128_digest`` call per row (the
same bytes). A batch of 256 rows of 512 int32 tokens hashes in about 12 µs in C against 28 µs
row by row, 64 images of 224x224x3 in about 130 µs (``benchmarks/verify.py``).
:class:`quern.pipeline.integrity.digesting.Digesting` makes the ledger values of consecutive batches
with one C call per batch (the same digests).
"""

from __future__ import annotations

import binascii
import itertools
import json
import math
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import xxhash

from ..core.collate import describe
from ..core.tree import leaves
from ..identity.canonical import dtype_text, is_plain, values
from ..order.index import hash64
from . import rowhash

__all__ = [
    "BatchDigests",
    "FORMAT",
    "HASH",
    "SMALL",
    "digests_of",
    "leaf_row_digests",
    "check_format",
    "ledger_digests",
    "row_digests_of",
    "step_digest_of",
]

HASH = "xxh3_128"
"""The hash of every digest here (xxHash's XXH3, 128 bits)."""
FORMAT = 2
"""The version of the canonical form, in every ledger line (``"digest_format"``).

1 (a line without the field): a dtype was its ``dtype.str`` (``<V1`` for 17 ml_dtypes) and a
structured leaf its bytes, padding included. 2: dtypes by name (:func:`~quern.pipeline.identity.canonical.dtype_text`),
structured leaves by their fields' values. Digests of two formats are never compared
(:func:`check_format`)."""
SMALL = 16
"""A numeric leaf's rows of at most this many bytes enter a row digest through its seed (others are hashed)."""

_TYPE_BYTE = {bytes: b"b", str: b"s"}
_U8, _LE_U64, _OBJECT = np.dtype(np.uint8), np.dtype("<u8"), np.dtype(object)
_FAST_MAX = 512  # layouts of flat dict batches remembered (a bucketed stream has one per bucket)


class BatchDigests(NamedTuple):
    """The digests of one collated batch (a host slice of a step)."""

    rows: list[str]
    """One digest per row, in row order (32 hex digits each)."""
    leaves: dict[str, str]
    """Per leaf (by key path), the digest of its rows: which leaf differs."""


class _LeafPlan(NamedTuple):
    """What one leaf's digests need that depends only on its path, dtype and shape."""

    key: tuple[str, np.dtype, tuple[int, ...]]  # (path, dtype little-endian or object, shape with the rows)
    objects: bool  # an object leaf: its rows are a list of canonical bytes
    rows: tuple[int, int] | None  # the (rows, elements) shape its array is read as; None: it is 2-d already
    width: int  # bytes per row (0 for an object leaf)
    seed: int  # its leaf digest's seed: xxh3_64([path, dtype, shape])


class _Plan(NamedTuple):
    """What a batch's digests need that depends only on its layout (cached)."""

    n: int  # rows
    leaves: tuple[_LeafPlan, ...]  # by path
    small: tuple[int, ...]  # indices of the small leaves of over 0 bytes a row, by path
    large: tuple[int, ...]  # indices of the large leaves, by path
    seed: int  # L: xxh3_64 of the layout
    first: np.uint64  # hash64(L): the first fold of a row's seed
    words: int  # 8-byte words of a row's small leaves' bytes
    offsets: tuple[int, ...]  # each small leaf's first byte in them
    word: np.dtype | None  # one small leaf of 1, 2, 4 or 8 bytes a row: its rows as unsigned integers
    leaf_json: str  # the leaf digests' JSON object, a %s per digest
    native: rowhash.BatchLayout | None  # what the C digests need (None: an object leaf)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@lru_cache(maxsize=1024)
def _plan(key: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> _Plan:
    """The plan of a batch whose leaves are ``(path, dtype, shape)`` (dtype little-endian), sorted by path."""
    plans, layout = [], []
    for path, dtype, shape in key:
        row_shape = [int(x) for x in shape[1:]]
        objects = dtype.hasobject
        text = dtype_text(dtype)
        items = math.prod(row_shape)
        width = 0 if objects else dtype.itemsize * items
        seed = xxhash.xxh3_64_intdigest(_json([path, text, [int(shape[0]), *row_shape]]).encode())
        plans.append(
            _LeafPlan((path, dtype, shape), objects, None if len(shape) == 2 else (shape[0], items), width, seed)
        )
        layout.append([path, text, row_shape])
    small = tuple(i for i, p in enumerate(plans) if not p.objects and 0 < p.width <= SMALL)
    large = tuple(i for i, p in enumerate(plans) if p.objects or p.width > SMALL)
    offsets = tuple(itertools.accumulate((plans[i].width for i in small), initial=0))
    seed = xxhash.xxh3_64_intdigest(_json(layout).encode())
    word = np.dtype(f"<u{plans[small[0]].width}") if len(small) == 1 and plans[small[0]].width in (1, 2, 4, 8) else None
    leaf_json = "{" + ", ".join(json.dumps(p.key[0]).replace("%", "%%") + ': "%s"' for p in plans) + "}"
    n = int(key[0][2][0])
    first, words = np.uint64(hash64(seed)[()]), -(-offsets[-1] // 8)
    native = None
    if not any(p.objects for p in plans):
        native = rowhash.batch_layout(
            [p.width for p in plans], [i in large for i in range(len(plans))], [p.seed for p in plans], seed
        )
    return _Plan(n, tuple(plans), small, large, seed, first, words, offsets[:-1], word, leaf_json, native)


def _object_bytes(value: Any, path: str, where: str) -> bytes:
    """The canonical bytes of one element of an object leaf: type byte, length (8 bytes LE), bytes."""
    kind = bytes if isinstance(value, bytes) else str if isinstance(value, str) else None
    if kind is None:
        raise TypeError(
            f"{where}: leaf {path} is an object array holding {type(value).__name__}: only bytes and str "
            "elements can be digested (as collate makes them); convert the leaf to a numeric array"
        )
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _TYPE_BYTE[kind] + len(data).to_bytes(8, "little") + data


def _as_array(path: str, value: Any, where: str) -> np.ndarray:
    """``value`` (a leaf of a batch) as an array with a row axis.

    Raises:
        ValueError: the leaf has no row axis (a 0-d array, a scalar).
    """
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, np.generic) or not hasattr(value, "__array__"):
        raise ValueError(
            f"{where}: leaf {path} is {describe(value)}, not an array with a row axis: "
            "it cannot be digested per row (a batch transform that returns a per-batch value? give it one "
            "value per row)"
        )
    else:
        arr = np.asarray(value)  # a jax.Array, say
    if arr.ndim == 0:
        raise ValueError(
            f"{where}: leaf {path} is a 0-d array (dtype {arr.dtype}), it has no row axis: it cannot be "
            "digested per row (a batch transform that returns a per-batch value? give it one value per row)"
        )
    return arr


def _check_rows(arrays: list[tuple[str, np.ndarray]], where: str) -> None:
    """Raise unless all leaves have the batch's rows along their first axis.

    Raises:
        ValueError: a first axis other than the batch's rows (those of most leaves).
    """
    sizes = [arr.shape[0] for _, arr in arrays]
    rows = max(sizes, key=sizes.count)  # the batch's rows: those of most leaves
    if sizes.count(rows) * 2 <= len(sizes):  # no majority: say all
        each = ", ".join(f"{path} has {arr.shape[0]}" for path, arr in arrays)
        raise ValueError(
            f"{where}: the leaves do not share a row axis ({each} along the first axis): the batch cannot be "
            "digested per row"
        )
    for path, arr in arrays:
        if arr.shape[0] != rows:
            raise ValueError(
                f"{where}: leaf {path} has shape {arr.shape}, {arr.shape[0]} along its first axis, while the "
                f"batch has {rows} rows: it has no row axis, and cannot be digested per row"
            )


def _canonical(batch: Any, where: str) -> tuple[_Plan, list[Any]]:
    """The plan of ``batch`` and its leaves made canonical, in path order.

    A numeric leaf becomes a C-contiguous little-endian array, an object leaf the list of its rows'
    canonical bytes.

    Raises:
        ValueError: no leaf, or a leaf without a row axis: a scalar, a 0-d array, or a first axis
            other than the batch's rows.
        TypeError: an object leaf holds something other than bytes or str, or a structured leaf a
            field of objects.
    """
    found = sorted(leaves(batch), key=lambda item: item[0])
    if not found:
        raise ValueError(f"{where}: the batch has no leaf (an empty dict?): nothing to digest")
    arrays = [(path, _as_array(path, value, where)) for path, value in found]
    n = arrays[0][1].shape[0]
    if any(arr.shape[0] != n for _, arr in arrays):
        _check_rows(arrays, where)
    key: list[tuple[str, np.dtype, tuple[int, ...]]] = []
    out: list[Any] = []
    for path, arr in arrays:
        if arr.dtype.hasobject and arr.dtype.names is None:  # objects, or NumPy's StringDType
            flat = np.ascontiguousarray(arr).reshape(n, math.prod(arr.shape[1:]))
            out.append([b"".join(_object_bytes(v, path, where) for v in row) for row in flat])
            key.append((path, _OBJECT if arr.dtype.kind == "O" else arr.dtype, arr.shape))
            continue
        canon = values(arr, f"{where}: leaf {path}")  # C order, little-endian, structures packed
        out.append(canon)
        key.append((path, canon.dtype, arr.shape))
    return _plan(tuple(key)), out


_FAST: dict[Any, Any] = {}  # a flat dict batch's layout -> (its plan, its leaves' order by path) or None
_MISSING = object()


def _fast(batch: dict, sig: Any) -> tuple[_Plan, tuple[int, ...]] | None:
    """The plan of a flat dict batch of canonical arrays and the order of its leaves by path (``None``: not one)."""
    arrays = list(batch.values())
    ok = all(
        type(a) is np.ndarray
        and a.ndim >= 1
        and a.shape[0] == arrays[0].shape[0]
        and is_plain(a.dtype)
        and a.flags.c_contiguous
        for a in arrays
    )
    out = None
    if ok and arrays:
        paths = [f"batch[{k!r}]" for k in batch]  # as tree.leaves names them
        order = tuple(sorted(range(len(paths)), key=paths.__getitem__))
        out = _plan(tuple((paths[i], arrays[i].dtype, arrays[i].shape) for i in order)), order
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[sig] = out
    return out


def _prepare(batch: Any, where: str) -> tuple[_Plan, list[Any]]:
    """The plan of ``batch`` and its leaves, canonical, in path order (see :func:`_canonical`).

    A flat dict of C-contiguous little-endian arrays (what collate makes) is taken as it is, its
    plan looked up by the leaves' names, types, dtypes, shapes and strides.
    """
    if type(batch) is dict:
        try:
            sig = tuple([(k, type(v), v.dtype, v.shape, v.strides) for k, v in batch.items()])
        except AttributeError:  # a leaf that is not an array
            pass
        else:
            fast = _FAST.get(sig, _MISSING)
            if fast is _MISSING:
                fast = _fast(batch, sig)
            if fast is not None:
                values = list(batch.values())
                return fast[0], [values[i] for i in fast[1]]
    return _canonical(batch, where)


def _hashed(plan: _Plan, arrays: list[Any]) -> list[bytes]:
    """Per part (each large leaf; without one, all the row's bytes): ``xxh3_128`` of each row.

    One call per part (:mod:`~quern.pipeline.integrity.rowhash`: a C loop, or one Python call per row).
    """
    n = plan.n
    if not plan.large:  # small leaves only: the rows' bytes, all leaves, are the one part
        mats = [np.frombuffer(arrays[i], _U8).reshape(n, plan.leaves[i].width) for i in plan.small]
        mat = np.zeros((n, 0), _U8) if not mats else mats[0] if len(mats) == 1 else np.concatenate(mats, axis=1)
        return [rowhash.rows_digests(mat)]
    out = []
    for i in plan.large:
        p, rows = plan.leaves[i], arrays[i]
        if p.objects:
            out.append(rowhash.spans_digests(rows))
        else:
            out.append(rowhash.rows_digests(rows if p.rows is None else rows.reshape(p.rows)))
    return out


def _row_raw(plan: _Plan, hashed: list[bytes], arrays: list[Any]) -> bytes:
    """The row digests, 16 bytes each, from the parts hashed: the last part XOR the row's seed, twice."""
    n = plan.n
    s: Any = plan.seed
    if plan.large and plan.word is not None:  # one small leaf of one word
        s = np.frombuffer(arrays[plan.small[0]], plan.word).astype(_LE_U64) ^ plan.first
    elif plan.large and plan.words:
        buf = np.zeros((n, 8 * plan.words), _U8)
        for i, at in zip(plan.small, plan.offsets):
            width = plan.leaves[i].width
            buf[:, at : at + width] = np.frombuffer(arrays[i], _U8).reshape(n, width)
        words = buf.view(_LE_U64)
        s = words[:, 0] ^ plan.first
        for j in range(1, plan.words):
            s = hash64(s) ^ words[:, j]
    for part in hashed[:-1]:  # the other large leaves' row hashes, two words each
        for w in np.frombuffer(part, _LE_U64).reshape(n, 2).T:
            s = hash64(s) ^ w
    last = np.frombuffer(hashed[-1], _LE_U64).reshape(n, 2)
    return (last ^ (s[:, None] if isinstance(s, np.ndarray) and s.ndim else np.uint64(s))).tobytes()


def _leaf_hex(plan: _Plan, hashed: list[bytes], arrays: list[Any]) -> list[str]:
    """Per leaf in path order: ``xxh3_128`` of its bytes (a large leaf: of its rows' hashes)."""
    parts = dict(zip(plan.large, hashed))
    return [
        xxhash.xxh3_128_hexdigest(parts[i] if i in parts else a, p.seed)
        for i, (p, a) in enumerate(zip(plan.leaves, arrays))
    ]


def _hex_rows(raw: Any) -> list[str]:
    """16-byte digests (``bytes`` or a C-contiguous ``uint8`` array) as 32 hex digits each."""
    return binascii.hexlify(raw, b" ", 16).decode().split(" ") if len(raw) else []


def digests_of(batch: Any, where: str = "batch") -> BatchDigests:
    """The row digests and the leaf digests of a collated batch.

    Args:
        batch: a pytree (dicts, tuples, lists) of arrays sharing a leading row axis.
        where: what the batch is, for messages (``step 3 (host 0 of 2)``).

    Returns:
        The digests; each depends only on the leaves' paths, dtypes, shapes and values.

    Raises:
        ValueError: a leaf without a row axis (a scalar, a 0-d array, another number of rows), named
            with ``where``.
        TypeError: an object leaf holding other than ``bytes`` or ``str`` (or a structured leaf a field of objects).

    Example:
        >>> import numpy as np
        >>> d = digests_of({"x": np.arange(6).reshape(3, 2)})
        >>> len(d.rows), len(d.rows[0]), list(d.leaves)
        (3, 32, ["batch['x']"])
    """
    plan, arrays = _prepare(batch, where)
    hashed = _hashed(plan, arrays)
    leaf = dict(zip((p.key[0] for p in plan.leaves), _leaf_hex(plan, hashed, arrays)))
    return BatchDigests(_hex_rows(_row_raw(plan, hashed, arrays)), leaf)


def ledger_digests(batch: Any, where: str = "batch") -> tuple[int, str, str]:
    """A batch's rows, row digests and leaf digests as a ledger line's JSON values.

    Args:
        batch: a pytree of arrays sharing a leading row axis.
        where: what the batch is, for messages.

    Returns:
        ``(rows, row digests, leaf digests)``: the number of rows, the JSON array of the row digests
        and the JSON object of the leaf digests, as :func:`digests_of` gives them.

    Raises:
        ValueError: a leaf without a row axis, named with ``where``.
        TypeError: an object leaf holding other than ``bytes`` or ``str`` (or a structured leaf a field of objects).

    Example:
        >>> import numpy as np
        >>> n, rows, leaves = ledger_digests({"x": np.arange(2)})
        >>> n, len(rows), json.loads(leaves).keys() == digests_of({"x": np.arange(2)}).leaves.keys()
        (2, 72, True)
    """
    plan, arrays = _prepare(batch, where)
    hashed = _hashed(plan, arrays)
    rows = f"[{rowhash.json_hex(_row_raw(plan, hashed, arrays))}]"  # hex digits: nothing to escape
    return plan.n, rows, plan.leaf_json % tuple(_leaf_hex(plan, hashed, arrays))


def check_format(found: Any, where: str) -> None:
    """Refuse a ledger line whose digests are of another format than :data:`FORMAT`.

    Args:
        found: the line's ``"digest_format"`` (``None``: it has none, format 1).
        where: the line, ``FILE:LINE``.

    Raises:
        ValueError: another format: its digests cannot be compared with this quern's (every row
            would differ), naming the line, both formats and what to do.
    """
    if type(found) is int and found == FORMAT:
        return
    if found is None:
        what = "digest format 1 (it has no digest_format: an older quern wrote it)"
    elif type(found) is int and found > FORMAT:
        what = f"digest format {found} (a newer quern wrote it)"
    else:
        what = f"digest_format {found!r}, which no quern writes"
    raise ValueError(
        f"{where}: the line's digests are of {what}, and this quern computes digest format {FORMAT} (a dtype by "
        "its name, a structured leaf by its fields' values): they cannot be compared; check the ledger with the "
        "quern that wrote it, or record the run again"
    )


def row_digests_of(batch: Any, where: str = "batch") -> list[str]:
    """One digest per row of a collated batch, over the row's canonical content (see the module docstring).

    Args:
        batch: a pytree of arrays sharing a leading row axis.
        where: what the batch is, for messages.

    Returns:
        32 hex digits per row, in row order; the digests of a host slice are the global batch's
        digests of the same rows.

    Raises:
        ValueError: a leaf without a row axis, named with ``where``.
        TypeError: an object leaf holding other than ``bytes`` or ``str`` (or a structured leaf a field of objects).

    Example:
        >>> import numpy as np
        >>> x = np.arange(12, dtype=np.int32).reshape(4, 3)
        >>> row_digests_of({"x": x})[2:] == row_digests_of({"x": np.asfortranarray(x[2:])})
        True
    """
    plan, arrays = _prepare(batch, where)
    return _hex_rows(_row_raw(plan, _hashed(plan, arrays), arrays))


def leaf_row_digests(batch: Any, where: str = "batch") -> dict[str, list[str]]:
    """Per leaf, one digest per row of that leaf alone: which leaf of a row differs.

    Args:
        batch: a pytree of arrays sharing a leading row axis.
        where: what the batch is, for messages.

    Returns:
        ``{path: [digest per row]}``, each as :func:`row_digests_of` of a batch holding that leaf only:
        ``xxh3_128(row bytes, seed=L)``, ``L`` of that leaf's layout.

    Raises:
        ValueError: a leaf without a row axis, named with ``where``.
        TypeError: an object leaf holding other than ``bytes`` or ``str`` (or a structured leaf a field of objects).
    """
    plan, arrays = _prepare(batch, where)
    out = {}
    for p, a in zip(plan.leaves, arrays):
        one = _plan((p.key,))
        out[p.key[0]] = _hex_rows(_row_raw(one, _hashed(one, [a]), [a]))
    return out


def step_digest_of(row_digests: list[str]) -> str:
    """The digest of a global batch: ``xxh3_128`` of its row digests (16 bytes each) in row order.

    Args:
        row_digests: the rows' digests, the hosts' slices concatenated in host order.

    Returns:
        32 hex digits; it depends only on the row digests and their order, not on how many hosts or
        workers made them.

    Example:
        >>> import numpy as np
        >>> rows = row_digests_of({"x": np.arange(4)})
        >>> step_digest_of(rows) == step_digest_of(rows[:2] + rows[2:])
        True
    """
    return xxhash.xxh3_128_hexdigest(bytes.fromhex("".join(row_digests)))
