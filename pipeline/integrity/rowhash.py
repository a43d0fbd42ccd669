"""XXH3-128 of every row of an array in one call: a C loop over xxHash, or one Python call per row.

:mod:`quern.pipeline.integrity.batch_digest` hashes each row of each leaf of a batch. From Python that is one
``xxhash.xxh3_128_digest`` call per row, and for a batch of small rows those calls cost more than
the hashing (about 105 ns a row; 256 rows of 2 KiB: 28 µs, where the hashing itself is 12 µs). The
wheel therefore carries a small C library (``native/rowhash.c``, built by ``.build/hatch_build.py`` with
the platform's C compiler and xxHash 0.8.4, the release the ``xxhash`` package bundles) whose loops
make the same calls in C, with the GIL released.

Both paths give the same bytes: :func:`rows_digests` and :func:`spans_digests` equal
``b"".join(map(xxhash.xxh3_128_digest, rows))``. The library is used only when it loads, reports the
expected ABI and xxHash release, and hashes a few test inputs to xxhash's own digests; otherwise
(no C compiler at install, another platform, ``QUERN_NATIVE=0`` in the environment) the Python path
is used, and :func:`native_why` says why. The library is loaded and checked on first use, not at
import (a worker process that never digests never loads it).
"""

from __future__ import annotations

import binascii
import ctypes
import functools
from pathlib import Path
from typing import Any, cast

import numpy as np
import xxhash

from ..core import libraries

__all__ = [
    "LIBRARY",
    "BatchLayout",
    "address",
    "batch_digests_into",
    "batch_layout",
    "is_native",
    "json_hex",
    "json_hex_into",
    "native_why",
    "rows_digests",
    "spans_digests",
]

LIBRARY = Path(__file__).resolve().parent.parent / "native" / "librowhash.so"
"""Where the wheel puts the compiled row hash (``.build/hatch_build.py``)."""

_ABI = 2  # quern_rowhash_abi() of the library this module was written for
_XXH_VERSION = 804  # xxHash 0.8.4 (native/xxhash/)
_U8 = np.dtype(np.uint8)
_BYTE = ctypes.c_char


def _python_rows(rows: Any) -> bytes:
    """``xxh3_128`` of each row, one Python call per row."""
    return b"".join(map(xxhash.xxh3_128_digest, rows))


def _typed(lib: Any) -> str:
    """Type the library's functions; why its ABI or xxHash release is not this module's (``""``: it is)."""
    lib.quern_rowhash_abi.restype = ctypes.c_int
    lib.quern_rowhash_xxh_version.restype = ctypes.c_uint
    abi, version = lib.quern_rowhash_abi(), lib.quern_rowhash_xxh_version()
    if (abi, version) != (_ABI, _XXH_VERSION):  # before its functions are looked up: an older one lacks some
        return f"has ABI {abi} and xxHash {version}, not {_ABI} and {_XXH_VERSION}"
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    lib.quern_xxh3_128_rows.argtypes = [ptr, size, size, size, ptr]
    lib.quern_xxh3_128_rows.restype = None
    lib.quern_xxh3_128_spans.argtypes = [ptr, ptr, size, ptr]
    lib.quern_xxh3_128_spans.restype = None
    lib.quern_json_hex.argtypes = [ptr, size, ptr]
    lib.quern_json_hex.restype = None
    lib.quern_batch_digests.argtypes = [size, size, ptr, ptr, ptr, ptr, ctypes.c_uint64, ptr, ptr]
    lib.quern_batch_digests.restype = ctypes.c_int
    return ""


def _native_rows(lib: Any, mat: np.ndarray) -> bytes:
    """``xxh3_128`` of each row of a 2-d C-contiguous array, in one call."""
    n = mat.shape[0]
    out = np.empty(16 * n, _U8)
    if n:
        width = mat.nbytes // n  # C order: each row's bytes follow the last's
        lib.quern_xxh3_128_rows(mat.__array_interface__["data"][0], n, width, width, out.__array_interface__["data"][0])
    return out.tobytes()


def _native_spans(lib: Any, rows: list[bytes]) -> bytes:
    """``xxh3_128`` of each bytes object, in one call over their concatenation."""
    n = len(rows)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    data = np.frombuffer(b"".join(rows) or b"\0", _U8)
    out = np.empty(16 * n, _U8)
    if n:
        lib.quern_xxh3_128_spans(
            data.__array_interface__["data"][0],
            offsets.__array_interface__["data"][0],
            n,
            out.__array_interface__["data"][0],
        )
    return out.tobytes()


def _python_json_hex(raw: bytes) -> str:
    """16-byte digests as the items of a JSON array: ``"32 hex digits", ...``."""
    return '"' + binascii.hexlify(raw, b" ", 16).replace(b" ", b'", "').decode() + '"' if raw else ""


def _native_json_hex(lib: Any, raw: bytes) -> str:
    n = len(raw) // 16
    if not n:
        return ""
    out = np.empty(36 * n - 2, _U8)
    lib.quern_json_hex(raw, n, out.__array_interface__["data"][0])
    return out.tobytes().decode()


class BatchLayout:
    """What :func:`batch_digests_into` needs of a batch's layout (made once per layout, in this process).

    Args:
        widths: bytes a row of each leaf, in path order.
        large: for each leaf, whether it is hashed by row (over 16 bytes a row) or small.
        seeds: each leaf digest's seed.
        layout: ``L``, the ``xxh3_64`` of the layout.
    """

    __slots__ = {
        "arrays": "The widths (``uintp``), large flags (``uint8``) and seeds (``uint64``) as arrays.",
        "layout": "``L``.",
        "addresses": "The three arrays' addresses (a pickled copy makes its own arrays and addresses).",
        "pointers": "The ctypes type of an array of one address per leaf.",
    }

    def __init__(self, widths: list[int], large: list[bool], seeds: list[int], layout: int) -> None:
        self.arrays = np.array(widths, np.uintp), np.array(large, np.uint8), np.array(seeds, np.uint64)
        self.layout = int(layout)
        self.addresses = tuple(address(a) for a in self.arrays)
        self.pointers = ctypes.c_void_p * len(widths)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        widths, large, seeds = (a.tolist() for a in self.arrays)
        return BatchLayout, (widths, [bool(x) for x in large], seeds, self.layout)


def batch_layout(widths: list[int], large: list[bool], seeds: list[int], layout: int) -> BatchLayout:
    """The :class:`BatchLayout` of leaves of ``widths`` bytes a row, ``large`` or small, with leaf ``seeds``."""
    return BatchLayout(widths, large, seeds, layout)


def address(array: np.ndarray) -> int:
    """The address of ``array``'s first byte (for :func:`batch_digests_into`).

    Taken from a ctypes view of the array's buffer where it is C-contiguous and not empty (about
    0.7 µs a call here), else, and where ctypes refuses the view (a read-only array, a dtype numpy
    keeps out of buffers: ``datetime64``; about 2.8 µs then), from its array interface (about
    1.5 µs: the interface is a new dict each time). Writability is left to ctypes to find: reading
    ``flags.writeable`` warns for some views (``np.broadcast_arrays``'s).
    """
    if array.flags.c_contiguous and array.size:
        try:
            return ctypes.addressof(_BYTE.from_buffer(cast(Any, array)))  # numpy's stubs do not type arrays as buffers
        except (TypeError, ValueError, BufferError):  # read-only, or a dtype numpy does not export
            pass
    return int(array.__array_interface__["data"][0])


def batch_digests_into(layout: BatchLayout, arrays: list[np.ndarray], n: int, rows: int, leaves: int) -> bool:
    """A batch's row and leaf digests (16 bytes each) in one C call, where the C library is used.

    Args:
        layout: the batch's :class:`BatchLayout`.
        arrays: its leaves in path order, numeric, C-contiguous and little-endian, sharing a first axis
            of ``n`` rows (``n * widths[i]`` bytes each: not checked, the caller made them so; as
            :mod:`quern.pipeline.integrity.batch_digest` does).
        n: the rows.
        rows: the :func:`address` of ``16 * n`` writable bytes, for the row digests.
        leaves: the address of 16 writable bytes a leaf, for the leaf digests.

    Returns:
        Whether they were written: ``False`` without the C library (the caller computes them in
        Python: :mod:`quern.pipeline.integrity.batch_digest`, whose scheme the C code follows).

    Raises:
        MemoryError: the C code could not allocate its scratch memory.
    """
    lib = _library()[0]
    if lib is None:
        return False
    k = len(arrays)
    if k != len(layout.arrays[0]):
        raise ValueError(f"batch_digests_into: {k} arrays for a layout of {len(layout.arrays[0])} leaves")
    data = layout.pointers(*map(address, arrays))
    if lib.quern_batch_digests(n, k, data, *layout.addresses, layout.layout, rows, leaves):
        raise MemoryError(f"quern_batch_digests: no memory for the parts of {n} rows")
    return True


def _self_test(lib: Any) -> str:
    """Why the library's digests differ from xxhash's on a few inputs (``""``: they agree)."""
    rng = np.random.default_rng(0)
    for width in (0, 1, 16, 17, 128, 129, 240, 241, 1024, 4099):
        mat = rng.integers(0, 256, (3, width), dtype=np.uint8)
        if _native_rows(lib, mat) != _python_rows(mat):
            return f"{LIBRARY} hashes rows of {width} bytes unlike xxhash {xxhash.VERSION} (a bad build)"
    spans = [b"", b"a", bytes(range(200)) * 3]
    if _native_spans(lib, spans) != _python_rows(spans):
        return f"{LIBRARY} hashes spans unlike xxhash {xxhash.VERSION} (a bad build)"
    raw = bytes(range(256)) * 2
    if _native_json_hex(lib, raw) != _python_json_hex(raw):
        return f"{LIBRARY} writes hex digits unlike binascii (a bad build)"
    return ""


@functools.cache
def _library() -> tuple[Any, str]:
    """The checked library (loaded on the first call), or ``None`` and why it is not used."""
    return libraries.checked(libraries.load(LIBRARY, _typed), _self_test)


def is_native() -> bool:
    """Whether the C row hash is used (:func:`native_why` says why not)."""
    return _library()[0] is not None


def native_why() -> str:
    """Why the C row hash is not used (``""`` when it is)."""
    return _library()[1]


def rows_digests(mat: np.ndarray) -> bytes:
    """``xxh3_128`` of each row of ``mat``, 16 bytes a row as ``xxhash.xxh3_128_digest`` gives them.

    Args:
        mat: a numeric array of at least 2 dimensions; its first axis is the rows, and a row's
            bytes are its elements in C order (an array in another order is copied first).

    Returns:
        ``16 * len(mat)`` bytes: each row's digest, in row order; the same with or without
        the C library.
    """
    if not mat.flags.c_contiguous:
        mat = np.ascontiguousarray(mat)
    lib = _library()[0]
    return _python_rows(mat) if lib is None or mat.ndim < 2 or mat.dtype.hasobject else _native_rows(lib, mat)


def spans_digests(rows: list[bytes]) -> bytes:
    """``xxh3_128`` of each bytes object of ``rows``, 16 bytes each, in order (as :func:`rows_digests`)."""
    lib = _library()[0]
    return _python_rows(rows) if lib is None else _native_spans(lib, rows)


def json_hex(raw: bytes) -> str:
    """16-byte digests as the items of a JSON array, ``"0a1b...", "..."`` (32 hex digits each).

    Args:
        raw: digests, 16 bytes each.

    Returns:
        The items, separated by ``", "``, without the brackets (``""`` for no digest); the same with
        or without the C library.
    """
    lib = _library()[0]
    return _python_json_hex(raw) if lib is None else _native_json_hex(lib, raw)


def json_hex_into(raw: Any, out: np.ndarray) -> None:
    """:func:`json_hex` of ``raw`` written into ``out`` as ASCII bytes, with no new text object.

    Args:
        raw: digests, 16 bytes each (``bytes`` or a C-contiguous array).
        out: a C-contiguous ``uint8`` array of exactly ``36 * n - 2`` bytes for ``n`` digests
            (empty for none), written whole.

    Raises:
        ValueError: ``out`` is not of that size, or not a C-contiguous ``uint8`` array.
    """
    data = np.frombuffer(raw, _U8)
    n = data.size // 16
    if out.dtype != _U8 or not out.flags.c_contiguous or out.size != max(36 * n - 2, 0):
        raise ValueError(f"json_hex_into: {n} digests need a C-contiguous uint8 array of {max(36 * n - 2, 0)} bytes")
    lib = _library()[0]
    if not n:
        return
    if lib is None:
        out[:] = np.frombuffer(_python_json_hex(data.tobytes()).encode(), _U8)
    else:
        lib.quern_json_hex(data.__array_interface__["data"][0], n, out.__array_interface__["data"][0])
