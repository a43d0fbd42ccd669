"""Reliability scenarios of offset indexes: stale, forged and fetched sidecars (issue 36 points 4 and 5).

Each scenario is a function ``(trials, rng, tmp) -> (tried, held, notes)`` as in
:mod:`faults`, which runs the ones in :data:`SCENARIOS` with its own.

* ``stale index <format>`` (tar, TFRecord, JSON lines): a file of 40-400 records
  (every other one over 1 MiB, where the sampled hash reads ranges only), made
  2.2 s before (so the record of its hash is trusted), opened once (its index
  cached), then changed in place, same size: 1-16 random bytes (for a big file,
  only bytes the sampled hash does not read), or an edit that keeps the format
  valid (a tar member's data changed, or a member renamed, its header's checksum
  made again, to join the sample before; a TFRecord record's data changed or two
  records split at another point, their CRCs made again; a letter of a JSON
  string changed, or a space turned into a newline or back); in half the trials
  the modification time is set back. Then opened again with the same cache, and
  with a cache holding the old index but no record of the file (another host).
  Held when, for both, reading every record gives the records a fresh index
  gives (a new cache folder), or a ``SourceError`` naming the file: never other
  records, never another count.
* ``forged sidecar``: a file of 10-60 records of a random format with a sidecar of a
  valid checksum and the file's content hash whose offsets are forged at random
  (records left out at the start, the end or both; boundaries removed (records
  merged), added, shifted; records split inside: at a tar member's header within a
  sample, at a byte inside a TFRecord frame or a JSON line; random increasing
  offsets). Held when reading every record gives the
  records of a fresh index, or a ``SourceError`` naming the file: never fewer or
  other records.
* ``fetched sidecar``: the same forged sidecar served beside the file's URL (an HTTP
  server on 127.0.0.1), the source of the URL opened, then a local copy of the file
  without a sidecar opened with the same index cache. Held when both read the
  records of a fresh index (or a ``SourceError`` naming the file or URL).
"""

from __future__ import annotations

import collections
import http.server
import io
import json
import os
import random
import shutil
import struct
import tarfile
import threading
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from quern.pipeline.core.errors import SourceError
from quern.pipeline.remote.cache import ShardCache
from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources import contents as contents_mod
from quern.pipeline.sources import offsets as offsets_mod
from quern.pipeline.sources.base import sample_ranges
from quern.pipeline.sources.tfrecord import masked_crc

CLASSES: dict[str, Any] = {"tar": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}
SUFFIX = {"tar": ".tar", "tfrecord": ".tfrecord", "jsonl": ".jsonl"}


# --------------------------------------------------------------------------- files


def write_file(fmt: str, path: str, n: int, rng: random.Random, big: bool) -> None:
    """A file of ``n`` records (``big``: over 1 MiB) of the format, written with ``tarfile``, ``json`` or by frames."""
    pad = (1 << 20) // n + 1 if big else 0
    if fmt == "tar":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=rng.choice([tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])) as tar:
            for i in range(n):
                for ext in rng.sample(["txt", "cls", "json", "bin"], rng.randrange(1, 4)):
                    data = f"{i}:{ext}:".encode() + rng.randbytes(rng.randrange(0, 200) + pad // 2)
                    info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                    info.size, info.mtime = len(data), rng.choice([0, 1_700_000_000])
                    tar.addfile(info, io.BytesIO(data))
        data = buf.getvalue()
    elif fmt == "tfrecord":
        frames = []
        for i in range(n):
            body = f"{i}:".encode() + rng.randbytes(rng.randrange(0, 300) + pad)
            head = struct.pack("<Q", len(body))
            frames.append(head + struct.pack("<I", masked_crc(head)) + body + struct.pack("<I", masked_crc(body)))
        data = b"".join(frames)
    else:
        lines = []
        for i in range(n):
            obj = {"id": i, "text": "w " * rng.randrange(0, 60) + "x" * pad, "v": [rng.random(), None, True]}
            lines.append(json.dumps(obj) + rng.choice(["", " ", "\n", "\r"]))
        data = ("\n".join(lines) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)


def outcome(src_or_error: Any) -> Any:
    """Every record of a source (``read_many`` over all ids), or the ``SourceError`` it raised (its message)."""
    if isinstance(src_or_error, str):
        return src_or_error
    try:
        return list(src_or_error.read_many(np.arange(len(src_or_error))))
    except SourceError as e:
        return f"SourceError: {e}"


def opened(fmt: str, path: str, index_cache: str, **kw: Any) -> Any:
    """The source of ``path``, or the message of the ``SourceError`` opening it raised; warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return CLASSES[fmt](path, index_cache=index_cache, **kw)
        except SourceError as e:
            return f"SourceError: {e}"


def fresh(fmt: str, path: str, tmp: str) -> Any:
    """What a fresh index of the file (a new, empty index cache) reads."""
    folder = os.path.join(tmp, f"fresh-{random.getrandbits(64):x}")
    try:
        return outcome(opened(fmt, path, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def agrees(got: Any, want: Any, *names: str) -> bool:
    """Whether ``got`` is ``want``'s records, or a ``SourceError`` naming one of ``names``."""
    if isinstance(got, str):
        return any(repr(n) in got or n in got for n in names)
    return got == want


# --------------------------------------------------------------------------- stale indexes


def _random_bytes(data: bytearray, rng: random.Random, ranges: list[tuple[int, int]] | None) -> None:
    """1-16 random bytes changed (outside ``ranges``, when given)."""
    for _ in range(rng.randrange(1, 17)):
        at = rng.randrange(len(data))
        if ranges is None or not any(lo <= at < hi for lo, hi in ranges):
            data[at] = rng.randrange(256)


def _tar_edit(data: bytearray, rng: random.Random) -> None:
    """A member's data bytes changed, or a member renamed (its header's checksum made again) to join the sample before."""
    members = tarfile.open(fileobj=io.BytesIO(bytes(data))).getmembers()
    k = rng.randrange(1, len(members))
    m = members[k]
    if rng.random() < 0.5 and m.size:
        for _ in range(rng.randrange(1, 5)):
            data[m.offset_data + rng.randrange(m.size)] = rng.randrange(256)
        return
    key = members[k - 1].name.split(".")[0]
    name = f"{key}.x{m.name.split('.')[1][1:]}".encode()  # another extension of the same length
    block = bytearray(data[m.offset : m.offset + 512])
    block[0:100] = name.ljust(100, b"\0")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    data[m.offset : m.offset + 512] = block


def _tfrecord_edit(data: bytearray, rng: random.Random) -> None:
    """A record's data changed (its CRC made again), or two records split at another point (same total size)."""
    off = _tf_offsets(bytes(data))
    k = rng.randrange(len(off) - 2)
    bodies = [bytes(data[off[j] + 12 : off[j + 1] - 4]) for j in (k, k + 1)]
    if rng.random() < 0.5:
        body = bytearray(bodies[0])
        if body:
            body[rng.randrange(len(body))] ^= 1 + rng.randrange(255)
        bodies[0] = bytes(body)
    else:
        joined = bodies[0] + bodies[1]
        cut = rng.randrange(len(joined) + 1)
        bodies = [joined[:cut], joined[cut:]]
    frames = b""
    for body in bodies:
        head = struct.pack("<Q", len(body))
        frames += head + struct.pack("<I", masked_crc(head)) + body + struct.pack("<I", masked_crc(body))
    data[off[k] : off[k + 2]] = frames


def _tf_offsets(data: bytes) -> list[int]:
    out, pos = [0], 0
    while pos < len(data):
        pos += 16 + struct.unpack_from("<Q", data, pos)[0]
        out.append(pos)
    return out


def _jsonl_edit(data: bytearray, rng: random.Random) -> None:
    """A letter of a string changed, or a whitespace byte turned into a newline or the other way round."""
    if rng.random() < 0.5:
        at = [i for i in range(len(data)) if data[i] == ord("w")]
        if at:
            data[rng.choice(at)] = ord("v")
            return
    at = [i for i in range(len(data)) if data[i] in b" \n"]
    i = rng.choice(at)
    data[i] = ord("\n") if data[i] == ord(" ") else ord(" ")


EDITS = {"tar": _tar_edit, "tfrecord": _tfrecord_edit, "jsonl": _jsonl_edit}


def _change(fmt: str, path: str, rng: random.Random, how: str, keep_mtime: bool) -> None:
    """Change a file in place (same size): random bytes (``how``: ``"bytes"``, or ``"unsampled"`` for bytes the
    sampled hash does not read) or an edit that keeps the format valid (``"edit"``)."""
    st = os.stat(path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "edit":
        EDITS[fmt](data, rng)
    else:
        _random_bytes(data, rng, sample_ranges(len(data)) if how == "unsampled" else None)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def stale_index(fmt: str) -> Callable[[int, random.Random, str], tuple[int, int, str]]:
    """The ``stale index <format>`` scenario."""

    def run(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
        folder = os.path.join(tmp, f"stale-{fmt}")
        os.makedirs(folder, exist_ok=True)
        cases = []
        for t in range(trials):
            path = os.path.join(folder, f"f{t}{SUFFIX[fmt]}")
            big = t % 2 == 1
            write_file(fmt, path, rng.randrange(40, 400), rng, big)
            cases.append((path, big))
        time.sleep(contents_mod.RACY_NS / 1e9 + 0.2)  # old enough files: their hashes' records are trusted
        held, refused, same, hows = 0, 0, 0, collections.Counter()
        for t, (path, big) in enumerate(cases):
            cache = os.path.join(folder, f"idx{t}")
            before = outcome(opened(fmt, path, cache))
            how = rng.choice(["edit", "unsampled" if big else "bytes"])
            hows[how] += 1
            _change(fmt, path, rng, how, keep_mtime=rng.random() < 0.5)
            other = os.path.join(folder, f"other{t}")  # another host: the old index, no record of the file
            shutil.copytree(os.path.join(cache, "offsets"), os.path.join(other, "offsets"))
            shutil.rmtree(os.path.join(other, "offsets", "files"), ignore_errors=True)
            want = fresh(fmt, path, folder)
            results = [outcome(opened(fmt, path, c)) for c in (cache, other)]
            held += all(agrees(r, want, path) for r in results)
            refused += sum(isinstance(r, str) for r in results)
            same += want == before
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(hows.items()))
        notes = (
            f"changes: {kinds}; {refused} of {2 * trials} reads an error naming the file; "
            f"{same} files whose records did not change"
        )
        return trials, held, notes

    return run


# --------------------------------------------------------------------------- forged sidecars


def _inner_points(fmt: str, path: str, off: np.ndarray, rng: random.Random) -> list[int]:
    """1-3 points inside records where a forged boundary splits one: a tar member's header inside a sample
    (else a block inside one), a byte inside a TFRecord frame or a JSON line."""
    if fmt == "tar":
        with tarfile.open(path) as tar:
            heads = sorted(set(m.offset for m in tar.getmembers()) - set(off.tolist()))
        if heads:
            return rng.sample(heads, min(len(heads), rng.randrange(1, 4)))
    ks = [k for k in range(len(off) - 1) if off[k + 1] - off[k] > 2]
    out = []
    for k in rng.sample(ks, min(len(ks), rng.randrange(1, 4))):
        lo, hi = int(off[k]) + 1, int(off[k + 1]) - 1
        out.append(lo + (rng.randrange(hi - lo) // 512 * 512 if fmt == "tar" else rng.randrange(hi - lo)))
    return out


def forge(fmt: str, path: str, off: np.ndarray, size: int, rng: random.Random) -> tuple[np.ndarray, str]:
    """Forged offsets from a file's true ones: strictly increasing within ``[0, size]``, and how."""
    n = len(off) - 1
    how = rng.choice(["head", "tail", "both", "remove", "add", "shift", "random", "split", "split"])
    if how == "split":
        new = np.union1d(off, _inner_points(fmt, path, off, rng))
    elif how == "head":
        new = off[rng.randrange(1, n) :]
    elif how == "tail":
        new = off[: rng.randrange(1, n)]
    elif how == "both":
        a = rng.randrange(1, n - 1)
        new = off[a : rng.randrange(a + 1, n)]
    elif how == "remove":
        drop = set(rng.sample(range(1, n), rng.randrange(1, min(4, n - 1) + 1)))
        new = np.asarray([o for i, o in enumerate(off) if i not in drop])
    elif how == "add":
        new = np.union1d(off, [rng.randrange(1, size) for _ in range(rng.randrange(1, 4))])
    elif how == "shift":
        new = off.copy()
        for i in rng.sample(range(len(off)), rng.randrange(1, 4)):
            new[i] += rng.choice([-1, 1]) * rng.randrange(1, 600)
        new = np.unique(np.clip(new, 0, size))
    else:
        new = np.unique([0, size, *(rng.randrange(size) for _ in range(rng.randrange(1, 2 * n)))])
        new = new[rng.randrange(2) :] if len(new) > 2 else new
    return np.asarray(new, dtype=np.int64), how


def _forged_case(rng: random.Random, folder: str, t: int) -> tuple[str, str, bytes, str]:
    fmt = rng.choice(list(CLASSES))
    path = os.path.join(folder, f"f{t}{SUFFIX[fmt]}")
    write_file(fmt, path, rng.randrange(10, 60), rng, big=False)
    probe = CLASSES[fmt](path, index_cache=os.path.join(folder, f"probe{t}"))
    off, how = forge(fmt, path, probe.offsets(0), probe.sizes[0], rng)
    return fmt, path, offsets_mod.dump(probe.FORMAT, probe.sizes[0], probe.contents[0], off), how


def forged_sidecar(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    folder = os.path.join(tmp, "forged")
    os.makedirs(folder, exist_ok=True)
    held, refused, at_open, hows = 0, 0, 0, set()
    for t in range(trials):
        fmt, path, blob, how = _forged_case(rng, folder, t)
        hows.add(how)
        with open(offsets_mod.sidecar_path(path), "wb") as f:
            f.write(blob)
        src = opened(fmt, path, os.path.join(folder, f"idx{t}"))
        at_open += not isinstance(src, str) and src.index_sources != ["sidecar"]
        got = outcome(src)
        os.unlink(offsets_mod.sidecar_path(path))
        want = fresh(fmt, path, folder)
        held += agrees(got, want, path)
        refused += isinstance(got, str)
    return (
        trials,
        held,
        f"forgeries: {', '.join(sorted(hows))}; {at_open} not used at open, {refused} read as an error naming the file",
    )


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def fetched_sidecar(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    folder = os.path.join(tmp, "fetched")
    www = os.path.join(folder, "www")
    os.makedirs(www, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=www))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    held, refused = 0, 0
    try:
        for t in range(trials):
            fmt, path, blob, _ = _forged_case(rng, www, t)
            with open(offsets_mod.sidecar_path(path), "wb") as f:
                f.write(blob)
            url = f"http://127.0.0.1:{server.server_address[1]}/{os.path.basename(path)}"
            idx = os.path.join(folder, f"idx{t}")
            remote = outcome(opened(fmt, url, idx, cache=ShardCache(os.path.join(folder, f"cache{t}"))))
            local = os.path.join(folder, f"local{t}{SUFFIX[fmt]}")
            shutil.copy(path, local)
            copy = outcome(opened(fmt, local, idx))
            want = fresh(fmt, local, folder)
            held += agrees(remote, want, url) and agrees(copy, want, local)
            refused += isinstance(remote, str) + isinstance(copy, str)
    finally:
        server.shutdown()
        server.server_close()
    return trials, held, f"{refused} of {2 * trials} reads an error naming the file or URL"


SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {
    **{f"stale index {fmt}": stale_index(fmt) for fmt in CLASSES},
    "forged sidecar": forged_sidecar,
    "fetched sidecar": fetched_sidecar,
}
