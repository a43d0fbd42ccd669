"""Reliability scenarios of smaller holes: odd inputs, each a clear error (issue 36 points 4, 8 and 10).

Each scenario is a function ``(trials, rng, tmp) -> (tried, held, notes)`` as in
:mod:`faults`, which runs the ones in :data:`SCENARIOS` with its own.

* ``odd json lines``: a JSON-lines file of 3-30 good lines and one nested 10 to
  300,000 deep (arrays or objects), at a random line; held when every line reads
  as ``json.loads`` reads it, or, for the deep one, as a ``SourceError`` naming the
  file and its line number: never a bare ``RecursionError``.
* ``odd exclude ids``: a config whose ``exclude:`` holds, at random, an inline id
  past int64 (either side), a text file with one at a random line, a ``.npy`` of
  uint64 with one past int64, a ``.npy`` whose header claims 1 GiB to 256 TiB (v1.0
  or v2.0 header), one of floats, objects or two dimensions, or good uint64/int32
  ids; held when a bad one is a ``ConfigError`` naming ``exclude.0``, the file and
  the value (the CLI's exit 2 in the first trial), and a good one loads as
  ``exclude()`` of those ids: never an ``OverflowError``, a ``MemoryError``, or an id
  reported as another.
* ``odd tar members``: a shard of 3-8 samples (ustar, GNU or pax headers) with, at
  random: a POSIX sparse member (pax ``GNU.sparse.*``, format 0.1 or 1.0) or an old
  GNU one (type ``S``); a key seen before (read as the webdataset library reads it);
  or a member renamed in place under an open source (same size and mtime) so that
  the index splits one sample in two. Held when the sparse member is refused by
  name (the shard and the file's own name), and otherwise every sample read is one
  the webdataset library reads from the file as it is now, or a ``SourceError``
  naming the shard: never a sample the library does not give.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from typing import Any

import numpy as np

import quern
from quern.pipeline.core.errors import SourceError
from quern.pipeline.sources import JsonlSource, WebDatasetSource

# --------------------------------------------------------------------------- odd json lines


def odd_json_lines(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    held, deep_errors, parsed = 0, 0, 0
    for t in range(trials):
        path = os.path.join(tmp, f"odd-{t}.jsonl")
        depth = rng.choice([rng.randrange(10, 900), rng.randrange(1000, 300_000)])
        opening, closing = rng.choice([("[", "]"), ('{"a":', "}")])
        deep = opening * depth + "0" + closing * depth
        lines = [json.dumps({"text": f"line {i}", "n": i}) for i in range(rng.randrange(3, 31))]
        at = rng.randrange(len(lines) + 1)
        lines.insert(at, deep)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        src = JsonlSource(path, index_cache=os.path.join(tmp, "odd-idx"))
        ok = True
        for r in rng.sample(range(len(lines)), len(lines)):
            try:
                got = src.read_many(np.array([r]))[0]
            except SourceError as e:
                named = r == at and f"odd-{t}.jsonl' line {at + 1} (record {at})" in str(e) and "too deep" in str(e)
                deep_errors += named
                ok &= named
                continue
            except Exception:  # a bare RecursionError, or anything else: not held
                ok = False
                continue
            try:
                want = json.loads(lines[r])
            except RecursionError:  # what the library cannot parse is an error, never a value
                want = SourceError
            ok &= got == want
            parsed += r == at
        held += ok
    return trials, held, f"{deep_errors} deep lines named by file and line, {parsed} parsed"


# --------------------------------------------------------------------------- odd exclude ids


def _npy_claiming(path: str, count: int, version: tuple[int, int]) -> None:
    """A .npy file whose header claims ``count`` int64 ids, with 64 bytes of data."""
    header = {"descr": "<i8", "fortran_order": False, "shape": (count,)}
    with open(path, "wb") as f:
        if version == (1, 0):
            np.lib.format.write_array_header_1_0(f, header)
        else:
            np.lib.format.write_array_header_2_0(f, header)
        f.write(bytes(64))


def _odd_ids_case(rng: random.Random, folder: str) -> tuple[dict[str, Any], list[str], list[int] | None]:
    """An ``exclude`` entry, the texts its refusal must hold (none: it loads), and the ids it must exclude."""
    odd = rng.choice([2**63 + rng.randrange(1000), 2**64 + rng.randrange(1000), -(2**63) - 1 - rng.randrange(1000)])
    good = [rng.randrange(23) for _ in range(rng.randrange(1, 5))]
    case = rng.choice(["inline", "text", "uint64", "claims", "claims-v2", "float", "object", "2-D", "good"])
    if case == "inline":
        ids = good + [odd]
        rng.shuffle(ids)
        return {"ids": ids}, ["exclude.0", f"record id {odd} is out of range"], None
    if case == "text":
        lines = [" ".join(map(str, good)) for _ in range(rng.randrange(1, 6))]
        at = rng.randrange(len(lines) + 1)
        lines.insert(at, f"{rng.randrange(23)}, {odd}")
        with open(os.path.join(folder, "ids.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return {"file": "ids.txt"}, ["exclude.0", f"ids.txt, line {at + 1}: record id {odd} is out of range"], None
    if case == "uint64":
        big = 2**63 + rng.randrange(2**63)
        np.save(os.path.join(folder, "ids.npy"), np.asarray(good + [big], dtype=np.uint64))
        return {"file": "ids.npy"}, ["exclude.0", f"ids.npy: record id {big} is out of range"], None
    if case.startswith("claims"):
        count = rng.randrange(2**27, 2**45)
        _npy_claiming(os.path.join(folder, "ids.npy"), count, (2, 0) if case == "claims-v2" else (1, 0))
        return {"file": "ids.npy"}, ["exclude.0", f"ids.npy: its .npy header claims {count} ids of int64"], None
    if case in ("float", "object", "2-D"):
        values = {
            "float": np.asarray(good, dtype=np.float64),
            "object": np.asarray(good + [None], dtype=object),
            "2-D": np.asarray([good, good]),
        }[case]
        np.save(os.path.join(folder, "ids.npy"), values)
        return {"file": "ids.npy"}, ["exclude.0", "ids.npy: needs a 1-D array of integer ids"], None
    np.save(os.path.join(folder, "ids.npy"), np.asarray(good, dtype=rng.choice([np.uint64, np.int32])))
    return {"file": "ids.npy"}, [], good


def _config(folder: str, **extra: Any) -> str:
    spec = {"driver": "array", "array": list(range(23)), "dtype": "int64"}
    cfg = {"source": {"type": "tensorstore", "spec": spec}, "seed": 3, "shuffle": "global", "batch": 4, **extra}
    path = os.path.join(folder, "c.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def odd_exclude_ids(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    held, refused, loaded, cli = 0, 0, 0, 0
    for t in range(trials):
        folder = os.path.join(tmp, f"ids-{t}")
        os.makedirs(folder)
        entry, texts, good = _odd_ids_case(rng, folder)
        path = _config(folder, exclude=[{"from_step": 1, **entry}])
        try:
            got = quern.load_config(path)
        except quern.ConfigError as e:
            ok = bool(texts) and all(s in str(e) for s in texts)
            refused += ok
            if ok and not cli:  # the command line says the same, once, as a usage error (exit 2)
                done = subprocess.run(
                    [sys.executable, "-m", "quern", "explain", path, "--step", "0"], capture_output=True, text=True
                )
                ok = done.returncode == 2 and all(s in done.stderr for s in texts) and "Traceback" not in done.stderr
                cli += 1
            held += ok
            continue
        except Exception:  # an OverflowError, a MemoryError, ...: not held
            continue
        want = quern.load_config(_config(folder)).exclude(good, from_step=1) if good is not None else None
        ok = want is not None and got.fingerprint() == want.fingerprint()
        loaded += ok
        held += ok
    return trials, held, f"{refused} refused naming the file and value ({cli} by the CLI, exit 2), {loaded} loaded"


# --------------------------------------------------------------------------- odd tar members


def _library(path: str) -> list[dict[str, Any]]:
    """The samples of a shard as the webdataset library reads them (its tar iterator and grouping)."""
    from webdataset import tariterators

    with open(path, "rb") as stream:
        source = {"url": path, "stream": stream, "local_path": path}
        samples = list(tariterators.group_by_keys(tariterators.tar_file_expander([source])))
    return [{k: v for k, v in s.items() if k not in ("__url__", "__local_path__")} for s in samples]


def _sparse(name: str, version: str) -> tuple[tarfile.TarInfo, bytes]:
    """A POSIX sparse member ``name`` (1 MiB, four bytes at 700,000) as GNU tar 1.x writes it."""
    info = tarfile.TarInfo(f"./GNUSparseFile.0/{name}")
    if version == "1.0":
        head = b"1\n700000\n4\n"
        data = head + bytes(-len(head) % 512) + b"data"
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name}
        info.pax_headers["GNU.sparse.realsize"] = str(1 << 20)
    else:
        data = b"data"
        info.pax_headers = {"GNU.sparse.map": "700000,4", "GNU.sparse.name": name, "GNU.sparse.size": str(1 << 20)}
    info.size = len(data)
    return info, data


def _shard(rng: random.Random, path: str, odd: str) -> str | None:
    """A shard of 3-8 samples with one odd member; returns the name a refusal must hold (``None``: none)."""
    keys = [f"k{i:03d}" for i in range(rng.randrange(3, 9))]
    members = [
        (f"{k}.{ext}", rng.randbytes(rng.randrange(0, 700)))
        for k in keys
        for ext in ("txt", "json", "cls")[: rng.randrange(1, 4)]
    ]
    fmt = (
        tarfile.PAX_FORMAT
        if odd.startswith("sparse")
        else rng.choice([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
    )
    at = rng.randrange(len(members) + 1)
    refused = None
    with tarfile.open(path, "w", format=fmt) as tar:
        for i, (name, data) in enumerate(members + [(None, b"")]):
            if i == at and odd.startswith("sparse"):
                real = f"{rng.choice(keys)}.bin"
                if odd == "sparse-S":
                    info, sdata = tarfile.TarInfo(real), b"data"
                    info.type, info.size = tarfile.GNUTYPE_SPARSE, 4
                else:
                    info, sdata = _sparse(real, odd.split("-")[1])
                tar.addfile(info, io.BytesIO(sdata))
                refused = f"member {real!r}"
            if i == at and odd == "key seen before" and at > 0:
                info = tarfile.TarInfo(f"{members[rng.randrange(at)][0].split('.')[0]}.seen")
                info.size = 3
                tar.addfile(info, io.BytesIO(b"old"))
            if name is not None:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), rng.choice([0, 1.5e9 + rng.random()])
                tar.addfile(info, io.BytesIO(data))
    return refused


def _rename_in_place(path: str, rng: random.Random) -> bool:
    """Rename a sample's first member to the key of the member before it (same size and mtime); ``False``: none."""
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
    starts = [i for i in range(1, len(infos)) if infos[i].name.split(".")[0] != infos[i - 1].name.split(".")[0]]
    if not starts:
        return False
    i = rng.choice(starts)
    old, prev = infos[i].name, infos[i - 1].name.split(".")[0]
    new = prev + "." + "z" * (len(old) - len(prev) - 1)
    if len(new) != len(old) or len(old) - len(prev) - 1 < 1:
        return False
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    for m in re.finditer(re.escape(old.encode()), bytes(data)):
        data[m.start() : m.end()] = new.encode()
        head = m.start() - m.start() % 512
        if m.start() % 512 < 100:  # a header's name: its checksum again (over the field as spaces)
            data[head + 148 : head + 156] = b" " * 8
            data[head + 148 : head + 156] = b"%06o\0 " % sum(data[head : head + 512])
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return True


def odd_tar_members(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    held, refused, same, split = 0, 0, 0, 0
    for t in range(trials):
        path = os.path.join(tmp, f"odd-{t}.tar")
        odd = rng.choice(["sparse-0.1", "sparse-1.0", "sparse-S", "key seen before", "renamed under an open source"])
        name = _shard(rng, path, odd)
        index = os.path.join(tmp, f"odd-idx-{t}")
        try:
            src = WebDatasetSource(path, index_cache=index)
        except SourceError as e:
            ok = name is not None and f"odd-{t}.tar" in str(e) and name in str(e) and "sparse" in str(e)
            refused += ok
            held += ok
            continue
        if name is not None:  # a sparse member read as bytes: not held
            continue
        if odd.startswith("renamed") and not _rename_in_place(path, rng):
            odd = "key seen before"
        library = _library(path)
        ok, errors = True, 0
        for _ in range(6):  # random reads: each sample one the library gives now, or an error naming the shard
            ids = np.asarray(rng.sample(range(len(src)), rng.randrange(1, len(src) + 1)))
            try:
                got = src.read_many(ids)
            except SourceError as e:
                errors += 1
                ok &= odd.startswith("renamed") and f"odd-{t}.tar" in str(e)
                continue
            ok &= all(s in library for s in got)
        split += odd.startswith("renamed") and errors > 0
        same += errors == 0
        held += ok
    return trials, held, f"{refused} sparse refused by name, {split} split samples refused, {same} read as the library"


SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {
    "odd json lines": odd_json_lines,
    "odd exclude ids": odd_exclude_ids,
    "odd tar members": odd_tar_members,
}
