"""Reliability scenarios of digests that collide: ml_dtypes and structured leaves (issue 36 point 6).

Each scenario is a function ``(trials, rng, tmp) -> (tried, held, notes)`` as in
:mod:`faults`, which runs the ones in :data:`SCENARIOS` with its own.

* ``digest collisions``: per trial, 12 random pairs of leaves of one itemsize (NumPy's
  numbers, bools, datetimes, strings and raw bytes, and every ml_dtypes type: 17 of them
  share ``dtype.str == '<V1'``) holding the same bytes or one row changed, and 12 random
  pairs of structured leaves (1-4 fields among numbers and ml_dtypes, sub-array and nested
  fields) in two random layouts each: aligned or packed, any byte order per field, room
  between fields and after the last, filled with random bytes, a multi-field view of a wider
  record, Fortran order or a strided view; holding the same values, one record changed, or
  another type (a field renamed, two fields swapped, a field's type changed with its bytes
  kept). Held when, row by row, two digests are equal exactly when the rows' value types and
  values are: the expected outcome is known by construction, the values compared as the
  scenario's own packed little-endian copy, never through quern.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from quern.pipeline.integrity.batch_digest import row_digests_of

_NUMPY = [np.dtype(t) for t in ("u1", "i1", "?", "u2", "i2", "f2", "u4", "i4", "f4", "u8", "i8", "f8", "c8", "c16")]
_NUMPY += [np.dtype(t) for t in ("V1", "V2", "V4", "V8", "S2", "S4", "U1", "M8[ns]", "m8[s]", "M8[D]")]
_NAMES = ["a", "b", "c", "d", "e"]


@functools.cache
def _dtypes() -> tuple[list[np.dtype], list[np.dtype]]:
    """The plain dtypes (every ml_dtypes type, then NumPy's) and the field dtypes of structured leaves.

    Built at the first use: importing ml_dtypes takes most of a second, which the other scenarios of
    ``faults.py`` (each a fresh interpreter in the tests) need not pay.
    """
    import ml_dtypes

    ml = [np.dtype(t) for t in vars(ml_dtypes).values() if isinstance(t, type) and issubclass(t, np.generic)]
    fields = [d for d in ml if d.itemsize <= 2] + [np.dtype(t) for t in ("u1", "i2", "f2", "i4", "f4", "f8", "?")]
    return ml + _NUMPY, fields


def _swapped(dtype: np.dtype) -> np.dtype:
    """``dtype`` big-endian where it has a byte order (itself otherwise)."""
    return dtype.newbyteorder(">") if dtype.byteorder not in "|" and dtype.itemsize > 1 else dtype


def _present(arr: np.ndarray, rng: random.Random) -> np.ndarray:
    """The same values in another memory layout: Fortran order, a strided view, or as they are."""
    how = rng.choice(["c", "fortran", "strided"])
    if how == "fortran" and arr.ndim > 1:
        return np.asfortranarray(arr)
    if how == "strided":
        wide = np.zeros((arr.shape[0] * 2, *arr.shape[1:]), arr.dtype)
        wide[::2] = arr
        return wide[::2]
    return arr


def _plain_pair(rng: random.Random) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """Two leaves of dtypes of one itemsize, the same bytes or one row changed; which rows must agree."""
    plain = _dtypes()[0]
    a = rng.choice(plain)
    b = a if rng.random() < 0.3 else rng.choice([d for d in plain if d.itemsize == a.itemsize])
    n, k = rng.randint(1, 6), rng.choice([1, 2, 3, 8, 40])  # rows, items a row (small and large leaves)
    nrng = np.random.default_rng(rng.getrandbits(32))
    raw = nrng.integers(0, 256, (n, k * a.itemsize), dtype=np.uint8)
    if "U" in a.kind + b.kind:  # UCS4 code points below 2**16: valid characters
        raw.reshape(n, k, 4)[:, :, 2:] = 0
    other = raw.copy()
    changed = rng.randrange(n) if rng.random() < 0.5 else None
    if changed is not None:
        other[changed, rng.randrange(other.shape[1])] ^= 1
    same_type = a.newbyteorder("<") == b.newbyteorder("<")
    agree = [same_type and bytes(raw[i]) == bytes(other[i]) for i in range(n)]
    x, y = raw.view(a.newbyteorder("<")), other.view(b.newbyteorder("<"))
    if rng.random() < 0.5:
        x = x.astype(_swapped(x.dtype))  # the same values, big-endian
    return _present(x, rng), _present(y, rng), agree


def _spec(rng: random.Random, depth: int = 0) -> list[tuple[str, Any]]:
    """A random record type: ``[(name, dtype or nested spec or (dtype, shape)), ...]``."""
    out: list[tuple[str, Any]] = []
    for name in rng.sample(_NAMES, rng.randint(1, 4)):
        r = rng.random()
        base = rng.choice(_dtypes()[1])
        out.append(
            (name, _spec(rng, 1) if r < 0.15 and not depth else (base, (rng.randint(1, 3),)) if r < 0.35 else base)
        )
    return out


def _dtype(spec: list[tuple[str, Any]], rng: random.Random | None) -> np.dtype:
    """The record type of ``spec``: packed little-endian (``rng`` None), or a random layout of it."""
    names, formats = [], []
    for name, f in spec:
        if isinstance(f, list):
            f = _dtype(f, rng)
        elif isinstance(f, tuple):
            f = (f[0] if rng is None or rng.random() < 0.5 else _swapped(f[0]), f[1])
        elif rng is not None and rng.random() < 0.5:
            f = _swapped(f)
        names.append(name)
        formats.append(f)
    if rng is None:
        return np.dtype({"names": names, "formats": formats})
    align = rng.random() < 0.5
    packed = np.dtype({"names": names, "formats": formats}, align=align)
    if rng.random() < 0.5:  # room between the fields and after the last
        offsets, at = [], 0
        for name in names:
            field = packed.fields[name][0]
            step = field.alignment if align else 1
            at = -(-at // step) * step + step * rng.randint(0, 3)
            offsets.append(at)
            at += field.itemsize
        size = at + rng.randint(0, 5) * (packed.alignment if align else 1)
        size = -(-size // packed.alignment) * packed.alignment if align else size
        return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size}, align=align)
    return packed


def _fill(vals: np.ndarray, nrng: np.random.Generator) -> None:
    """Values for every field of a packed record array: small integers cast to the field's type."""
    for name in vals.dtype.names:
        field = vals[name]
        if field.dtype.names is not None:
            _fill(field, nrng)
        else:
            field[...] = nrng.integers(0, 4, field.shape).astype(field.dtype)


def _laid_out(vals: np.ndarray, spec: list[tuple[str, Any]], rng: random.Random) -> np.ndarray:
    """``vals`` in a random layout: the bytes outside its fields random, maybe a view of a wider record."""
    dtype = _dtype(spec, rng)
    view = rng.random() < 0.3
    if view:  # a multi-field view of a record with one more field ("zz", random bytes) among them
        at = rng.randint(0, len(dtype.names))
        names = [*dtype.names[:at], "zz", *dtype.names[at:]]
        formats = [dtype.fields[n][0] if n != "zz" else np.dtype("i4") for n in names]
        dtype = np.dtype({"names": names, "formats": formats}, align=rng.random() < 0.5)
    nrng = np.random.default_rng(rng.getrandbits(32))
    raw = nrng.integers(0, 256, (*vals.shape, dtype.itemsize), dtype=np.uint8)
    out = raw.view(dtype).reshape(vals.shape)
    for name in vals.dtype.names:  # by name: the bytes outside the fields stay random
        out[name] = vals[name]
    if view:
        out = out[list(vals.dtype.names)]
    return _present(out, rng)


def _struct_pair(rng: random.Random) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """Two structured leaves in random layouts: the same values, one record changed, or another type."""
    spec = _spec(rng)
    n, m = rng.randint(1, 6), rng.randint(1, 3)
    vals = np.zeros((n, m), _dtype(spec, None))
    _fill(vals, np.random.default_rng(rng.getrandbits(32)))
    how = rng.choice(["same", "changed", "renamed", "swapped", "retyped"])
    other_spec, other = spec, vals.copy()
    if how == "changed":
        flat = [name for name, f in spec if not isinstance(f, list)]  # a field of numbers, not a nested record
        if flat:
            field, i = other[rng.choice(flat)], rng.randrange(n)
            with np.errstate(invalid="ignore", over="ignore"):  # a float8 without inf: NaN
                field[i] = (np.asarray(field[i]).astype(np.float64) + 1).astype(field.dtype)  # may round to itself
    elif how == "renamed":
        other_spec = [("q" if k == 0 else name, f) for k, (name, f) in enumerate(spec)]
    elif how == "swapped" and len(spec) > 1:
        other_spec = [spec[1], spec[0], *spec[2:]]
    elif how == "retyped":
        k = rng.randrange(len(spec))
        name, f = spec[k]
        if not isinstance(f, list):
            base = f[0] if isinstance(f, tuple) else f
            choices = [d for d in _dtypes()[1] if d.itemsize == base.itemsize and d != base]
            if choices:
                new = rng.choice(choices)
                other_spec = [*spec[:k], (name, (new, f[1]) if isinstance(f, tuple) else new), *spec[k + 1 :]]
    if other_spec is not spec:
        other = vals.view(_dtype(other_spec, None))  # the same bytes, another record type
    same_type = vals.dtype == other.dtype
    agree = [same_type and vals[i].tobytes() == other[i].tobytes() for i in range(n)]
    return _laid_out(vals, spec, rng), _laid_out(other, other_spec, rng), agree


def digest_collisions(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    """Random pairs of leaves: digests equal exactly when value types and values are (see the module docstring)."""
    tried = held = 0
    pairs = {"dtype pairs": 0, "of equal bytes": 0, "structured pairs": 0, "of equal values": 0}
    failures: list[str] = []
    for _ in range(trials):
        tried += 1
        ok = True
        for kind, make in (("dtype pairs", _plain_pair), ("structured pairs", _struct_pair)):
            for _ in range(12):
                x, y, agree = make(rng)
                pairs[kind] += 1
                pairs["of equal bytes" if kind == "dtype pairs" else "of equal values"] += all(agree)
                extra = {"n": np.arange(x.shape[0])} if rng.random() < 0.5 else {}  # a second leaf: the seed path
                dx, dy = row_digests_of({"x": x, **extra}), row_digests_of({"x": y, **extra})
                got = [p == q for p, q in zip(dx, dy)]
                if got != agree:
                    ok = False
                    failures.append(f"{kind}: {x.dtype} and {y.dtype}: rows equal {got}, values equal {agree}")
        held += ok
    notes = (
        f"{pairs['dtype pairs']} dtype pairs ({pairs['of equal bytes']} of equal bytes and value type), "
        f"{pairs['structured pairs']} structured pairs ({pairs['of equal values']} of equal values, other layouts); "
        "held = digests equal exactly where value types and values are"
    )
    return tried, held, notes + ("; not held: " + " | ".join(failures[:3]) if failures else "")


SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {
    "digest collisions": digest_collisions,
}
