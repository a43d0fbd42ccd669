"""A prepared folder, as ``quern prepare`` writes it: the manifest, its checks and the metadata index.

A prepared folder holds ArrayRecord shards, ``manifest.json`` (written last:
its presence means the folder is complete) and ``metadata/<field>.npy`` (one
value per record; ``length`` always). :func:`check_manifest` checks a
manifest's form whoever wrote it, :func:`open_manifest` also that the files it
names are there with their sizes, :func:`verify` every byte against the
manifest's SHA-256 checksums. The layout, the manifest's keys and what is
checked when are described in ``docs/design/prepared.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import numpy as np

from ..core.errors import SourceError

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
_HEX = re.compile(r"[0-9a-f]{16,64}")  # job: what prepare writes is 32 hex digits
_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: str, chunk: int = 8 << 20) -> str:
    """The SHA-256 hex digest of the bytes of ``path``.

    Args:
        path: the file.
        chunk: bytes read at a time.

    Returns:
        64 lowercase hex digits.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder that a prepare wrote to (finished or not).

    Args:
        path: any path.

    Returns:
        Whether it is a folder holding a manifest or an unfinished prepare's staging folder.
    """
    p = os.fspath(path)
    return os.path.isdir(p) and (os.path.exists(os.path.join(p, MANIFEST)) or os.path.exists(os.path.join(p, STAGING)))


def _plain(name: Any) -> bool:
    r"""Whether ``name`` is one plain file name.

    Not empty, ``.`` or ``..``; no ``/``, ``\``, NUL or control character; at most 255 bytes.
    """
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name)
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def _form(name: Any, metadata: bool) -> bool:
    """Whether ``name`` has the form prepare writes: a plain name (a shard), ``metadata/<plain name>``."""
    if not metadata:
        return _plain(name)
    return isinstance(name, str) and name.startswith("metadata/") and _plain(name[len("metadata/") :])


def _inside(folder: str, name: Any, what: str, manifest: str | None = None, metadata: bool = False) -> str:
    """``folder/name`` for a manifest's relative file name, checked.

    Anything not of the form prepare writes (:func:`_form`) is refused, and so
    is a path that resolves (links followed) outside ``folder``.
    """
    where = manifest or os.path.join(folder, MANIFEST)
    if not _form(name, metadata):
        form = "'metadata/<name>'" if metadata else "a plain file name"
        raise SourceError(f"{where!r}: {what} {name!r} is not a file name inside the folder ({form})")
    path = os.path.join(folder, name)
    if folder:
        root, real = os.path.realpath(folder), os.path.realpath(path)
        if os.path.commonpath([root, real]) != root or real == root:
            raise SourceError(
                f"{where!r}: {what} {name!r} is a link that leads outside the folder (to {real!r}): refused"
            )
    return path


def open_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the prepared folder ``folder``, checked.

    Its form is checked (:func:`check_manifest`), and every shard and metadata
    file it names is inside the folder (no link leading out) and present, each
    shard of the size the manifest says.

    Args:
        folder: the prepared folder.

    Returns:
        The parsed manifest.

    Raises:
        SourceError: no manifest (an unfinished prepare, or not a prepared
            folder), a manifest that cannot be read or is malformed, or a file
            missing or of the wrong size; the message names it.
    """
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
        file = os.path.join(folder, s["file"])
        if not os.path.lexists(file):
            raise SourceError(f"{folder!r}: shard {s['file']!r} named by the manifest is missing")
        _inside(folder, s["file"], "shard")
        if not os.path.exists(file):
            raise SourceError(f"{folder!r}: shard {s['file']!r} named by the manifest is missing")
        size = os.path.getsize(file)
        if size != s.get("bytes"):
            raise SourceError(
                f"{folder!r}: shard {s['file']!r} has {size} bytes; the manifest says {s.get('bytes')} "
                "(truncated or replaced)"
            )
    for field, spec in m["metadata"].items():
        file = os.path.join(folder, spec["file"])
        if os.path.lexists(file):
            _inside(folder, spec["file"], f"metadata field {field!r}", metadata=True)
        if not os.path.exists(file):
            raise SourceError(f"{folder!r}: metadata file {spec['file']!r} (field {field!r}) is missing")
    return m


def check_manifest(m: Any, path: str) -> dict[str, Any]:
    """A parsed manifest, checked for its form.

    Format, version, every key and its type, plain file names, digests,
    record counts that add up and at most one record per byte of each shard.

    Args:
        m: the parsed JSON.
        path: where it was read from (a file or a URL), for the messages.

    Returns:
        ``m`` itself.

    Raises:
        SourceError: naming ``path`` and the key or file that is wrong.
    """
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise SourceError(f"{path!r} is not a quern prepare manifest (format {FORMAT!r})")
    if m.get("version") != VERSION:
        raise SourceError(f"{path!r} has version {m.get('version')!r}; this quern reads version {VERSION}")
    missing = [k for k in _KEYS if k not in m]
    if missing:
        raise SourceError(f"{path!r} is incomplete: it lacks {missing}")

    def wrong(key: str, value: Any, want: str) -> SourceError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return SourceError(f"{path!r}: {key} is {shown} ({type(value).__name__}); a manifest has {want} there")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(m["job"], str) or not _HEX.fullmatch(m["job"]):
        raise wrong("'job'", m["job"], "the hex digest of the prepare job")
    shards, records, metadata = m["shards"], m["records"], m["metadata"]
    if not isinstance(shards, list):
        raise wrong("'shards'", shards, "a list of {file, records, bytes, sha256}")
    if not shards:
        raise SourceError(f"{path!r} names no shard")
    if not isinstance(records, dict):
        raise wrong("'records'", records, "{count, type}")
    if not count(records.get("count")):
        raise wrong("'records.count'", records.get("count"), "a record count")
    if records.get("type") not in ("bytes", "array") or (
        records["type"] == "array" and not isinstance(records.get("dtype"), str)
    ):
        raise wrong("'records.type'", records.get("type"), "'bytes', or 'array' with a 'dtype'")
    if not isinstance(metadata, dict):
        raise wrong("'metadata'", metadata, "{field: {file, dtype, sha256}}")
    for k, s in enumerate(shards):
        if not isinstance(s, dict):
            raise wrong(f"'shards[{k}]'", s, "{file, records, bytes, sha256}")
        _inside("", s.get("file"), "shard", path)
        if not count(s.get("bytes")) or not count(s.get("records")) or "sha256" not in s:
            raise SourceError(f"{path!r}: shard {s.get('file')!r} lacks its bytes, records or sha256")
        if not isinstance(s["sha256"], str) or not _SHA256.fullmatch(s["sha256"]):
            raise wrong(f"the sha256 of shard {s['file']!r}", s["sha256"], "64 lowercase hex digits")
        if s["records"] > s["bytes"]:  # prepare writes one chunk (tens of bytes) per record
            raise SourceError(
                f"{path!r}: shard {s['file']!r} claims {s['records']} records in {s['bytes']} bytes: a prepared "
                "shard holds at least one byte per record"
            )
    total = sum(s["records"] for s in shards)
    if total != records["count"]:
        raise SourceError(f"{path!r}: its shards hold {total} records in all; 'records.count' says {records['count']}")
    for field, spec in metadata.items():
        if not isinstance(spec, dict):
            raise wrong(f"'metadata[{field!r}]'", spec, "{file, dtype, sha256}")
        _inside("", spec.get("file"), f"metadata field {field!r}", path, metadata=True)
        if not isinstance(spec.get("dtype"), str):
            raise wrong(f"the dtype of metadata field {field!r}", spec.get("dtype"), "a NumPy dtype name")
        if not isinstance(spec.get("sha256"), str) or not _SHA256.fullmatch(spec["sha256"]):
            raise wrong(f"the sha256 of metadata field {field!r}", spec.get("sha256"), "64 lowercase hex digits")
    return m


def verify(folder: str | os.PathLike, manifest: dict[str, Any] | None = None) -> None:
    """Check every byte of the shards and metadata files of ``folder`` against the manifest's SHA-256 checksums.

    Args:
        folder: the prepared folder.
        manifest: its manifest, already checked (default: :func:`open_manifest`).

    Raises:
        SourceError: a file differs from its checksum (the first, named), or as
            :func:`open_manifest`.
    """
    folder = os.fspath(folder)
    m = manifest if manifest is not None else open_manifest(folder)
    files = [(s["file"], s["sha256"]) for s in m["shards"]]
    files += [(spec["file"], spec["sha256"]) for spec in m["metadata"].values()]
    for k, (name, want) in enumerate(files):
        got = file_sha256(_inside(folder, name, "file", metadata=k >= len(m["shards"])))
        if got != want:
            raise SourceError(
                f"{folder!r}: {name!r} does not match its checksum in the manifest (sha256 {got[:16]}..., "
                f"expected {want[:16]}...): the file is damaged"
            )


def load_metadata(
    folder: str | os.PathLike, manifest: dict[str, Any], *, files: dict[str, str] | None = None
) -> dict[str, np.ndarray]:
    """The metadata index of a prepared folder, each file checked against its checksum.

    Args:
        folder: the prepared folder (or its URL, with ``files``).
        manifest: its manifest, checked (:func:`check_manifest`).
        files: where each field's file is read from instead of ``folder/<file>`` (a remote
            folder's copies in the disk cache); errors name ``folder/<file>``.

    Returns:
        ``{field: read-only array}`` with one value per record, fields sorted.

    Raises:
        SourceError: a file does not match its checksum, is not a NumPy array
            file, or has another shape or dtype than the manifest says.
    """
    folder = os.fspath(folder)
    out: dict[str, np.ndarray] = {}
    count = manifest["records"]["count"]
    for field, spec in sorted(manifest["metadata"].items()):
        if files is None:
            path = shown = _inside(folder, spec["file"], f"metadata field {field!r}", metadata=True)
        else:
            path, shown = files[field], f"{folder}/{spec['file']}"
        if file_sha256(path) != spec["sha256"]:
            raise SourceError(f"{shown!r} (metadata field {field!r}) does not match its checksum in the manifest")
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise SourceError(f"{shown!r}: metadata field {field!r} is not a NumPy array file: {e}") from e
        if not isinstance(arr, np.ndarray) or arr.shape != (count,) or str(arr.dtype) != spec["dtype"]:
            raise SourceError(
                f"{shown!r}: metadata field {field!r} has shape {getattr(arr, 'shape', None)} and dtype "
                f"{getattr(arr, 'dtype', None)}; the manifest says ({count},) and {spec['dtype']}"
            )
        arr.setflags(write=False)
        out[field] = arr
    return out
