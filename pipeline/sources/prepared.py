"""A prepared folder, as ``quern prepare`` writes it: the manifest, its checks and the metadata index.

A prepared folder holds ArrayRecord shards, ``manifest.json`` and ``metadata/``::

    out/
      manifest.json                         written last: its presence means the folder is complete
      shard-00000-of-00003.array_record     the records, in the documented order
      ...
      metadata/length.npy                   per record: its length after the map (bytes or elements)
      metadata/<field>.npy                  per record: each scalar field asked for (--fields)

The manifest (JSON, keys sorted) names every file relative to itself and holds
no timestamp, host name or absolute path, so the folder can be copied or moved:

- ``format``: ``"quern-prepared"``, ``version``: :data:`VERSION`, ``quern_version``;
- ``shards``: ``[{"file", "records", "bytes", "sha256"}]`` in record order;
- ``records``: ``{"count", "type"}``: ``"bytes"``, or ``"array"`` with ``"dtype"``
  (each record the raw bytes of a 1-D array of that dtype: decode it with
  ``quern.transforms.decode(dtype)``);
- ``metadata``: ``{field: {"file", "dtype", "sha256"}}``, ``length`` always;
- ``input`` (a description of the input: kinds, names, file and byte counts, a
  digest of every input byte), ``map`` (``null`` or its ``fn`` and code
  fingerprint), ``options``, ``job`` (the hash of what decides the output),
  ``skipped`` (records skipped with ``--skip-errors``: a count and the first
  errors).

:func:`open_manifest` reads a manifest and checks that every shard it names is
there with its size (a stat per shard); :func:`verify` also checks every byte
against the checksums; :func:`load_metadata` checks the metadata files'
checksums as it loads them.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from ..errors import SourceError

__all__ = [
    "MANIFEST",
    "STAGING",
    "VERSION",
    "check_manifest",
    "file_sha256",
    "is_prepared",
    "load_metadata",
    "open_manifest",
    "verify",
]

MANIFEST = "manifest.json"
STAGING = ".quern-prepare"  # where an unfinished prepare keeps its plan, finished shards' records and temporaries
FORMAT = "quern-prepared"
VERSION = 1
_KEYS = ("format", "version", "shards", "records", "metadata", "input", "map", "options", "job", "skipped")


def file_sha256(path: str, chunk: int = 8 << 20) -> str:
    """The SHA-256 hex digest of the bytes of ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder that a prepare wrote to (finished or not)."""
    p = os.fspath(path)
    return os.path.isdir(p) and (os.path.exists(os.path.join(p, MANIFEST)) or os.path.exists(os.path.join(p, STAGING)))


def _inside(folder: str, name: Any, what: str, manifest: str | None = None) -> str:
    """``folder/name`` for a manifest's relative file name; anything that leaves the folder is refused."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        where = manifest or os.path.join(folder, MANIFEST)
        raise SourceError(f"{where!r}: {what} {name!r} is not a file name inside the folder")
    return os.path.join(folder, name)


def open_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the prepared folder ``folder``, checked: every key present,
    every shard and metadata file named inside the folder, present, and of the
    size the manifest says. Raises :class:`SourceError` naming what is missing
    (no manifest: an unfinished prepare, or not a prepared folder)."""
    folder = os.fspath(folder)
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        if os.path.isdir(os.path.join(folder, STAGING)):
            raise SourceError(
                f"{folder!r} has no {MANIFEST}: its prepare did not finish (run the same quern prepare again to "
                "complete it)"
            )
        raise SourceError(f"{folder!r} has no {MANIFEST}: it is not a folder written by quern prepare")
    try:
        with open(path, "rb") as f:
            m = check_manifest(json.loads(f.read()), path)
    except (OSError, ValueError) as e:
        raise SourceError(f"{path!r}: cannot read the manifest: {e}") from e
    for s in m["shards"]:
        file = _inside(folder, s.get("file"), "shard")
        if not os.path.exists(file):
            raise SourceError(f"{folder!r}: shard {s['file']!r} named by the manifest is missing")
        size = os.path.getsize(file)
        if size != s.get("bytes"):
            raise SourceError(
                f"{folder!r}: shard {s['file']!r} has {size} bytes; the manifest says {s.get('bytes')} "
                "(truncated or replaced)"
            )
    for field, spec in m["metadata"].items():
        file = _inside(folder, spec.get("file"), f"metadata field {field!r}")
        if not os.path.exists(file):
            raise SourceError(f"{folder!r}: metadata file {spec['file']!r} (field {field!r}) is missing")
    return m


def check_manifest(m: Any, path: str) -> dict[str, Any]:
    """``m`` (a parsed manifest read from ``path``, a file or a URL) checked for its form:
    format, version, every key, shards and metadata files named inside the folder.
    Raises :class:`SourceError` naming what is wrong."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise SourceError(f"{path!r} is not a quern prepare manifest (format {FORMAT!r})")
    if m.get("version") != VERSION:
        raise SourceError(f"{path!r} has version {m.get('version')!r}; this quern reads version {VERSION}")
    missing = [k for k in _KEYS if k not in m]
    if missing:
        raise SourceError(f"{path!r} is incomplete: it lacks {missing}")
    if not m["shards"]:
        raise SourceError(f"{path!r} names no shard")
    for s in m["shards"]:
        _inside("", s.get("file"), "shard", path)
        if not isinstance(s.get("bytes"), int) or not isinstance(s.get("records"), int) or "sha256" not in s:
            raise SourceError(f"{path!r}: shard {s.get('file')!r} lacks its bytes, records or sha256")
    for field, spec in m["metadata"].items():
        _inside("", spec.get("file"), f"metadata field {field!r}", path)
    return m


def verify(folder: str | os.PathLike, manifest: dict[str, Any] | None = None) -> None:
    """Check every byte of the shards and metadata files of ``folder`` against the
    manifest's SHA-256 checksums; :class:`SourceError` naming the first that differs."""
    folder = os.fspath(folder)
    m = manifest if manifest is not None else open_manifest(folder)
    files = [(s["file"], s["sha256"]) for s in m["shards"]]
    files += [(spec["file"], spec["sha256"]) for spec in m["metadata"].values()]
    for name, want in files:
        got = file_sha256(_inside(folder, name, "file"))
        if got != want:
            raise SourceError(
                f"{folder!r}: {name!r} does not match its checksum in the manifest (sha256 {got[:16]}..., "
                f"expected {want[:16]}...): the file is damaged"
            )


def load_metadata(folder: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """The metadata index of a prepared folder: ``{field: read-only array}`` with one
    value per record, each file checked against its checksum."""
    folder = os.fspath(folder)
    out: dict[str, np.ndarray] = {}
    count = manifest["records"]["count"]
    for field, spec in sorted(manifest["metadata"].items()):
        path = _inside(folder, spec["file"], f"metadata field {field!r}")
        if file_sha256(path) != spec["sha256"]:
            raise SourceError(f"{path!r} (metadata field {field!r}) does not match its checksum in the manifest")
        arr = np.load(path, allow_pickle=False)
        if arr.shape != (count,) or str(arr.dtype) != spec["dtype"]:
            raise SourceError(
                f"{path!r}: metadata field {field!r} has shape {arr.shape} and dtype {arr.dtype}; the manifest "
                f"says ({count},) and {spec['dtype']}"
            )
        arr.setflags(write=False)
        out[field] = arr
    return out
