"""The cost of checking offset indexes: opening WebDataset, TFRecord and JSON-lines files, and reading them.

For each format, ``--mib`` MiB of files (``--files`` of them, records of about
``--record-kib`` KiB) are written, left ``RACY_NS`` + 0.2 s to age (a record of a
file's hash is trusted only then), and the page cache is warm. Then:

* ``build``: the first open, the index built (quern: the content hash and the scan);
* ``open, remembered``: an open with the index in the cache and the record of each
  file's hash (this host opened them before): the usual open;
* ``open, new host``: an open with the index in the cache but no record of the files
  (another host sharing the cache folder, a sidecar on a host that never saw the
  files): every file is read and hashed;
* ``check``: the check of the index at every boundary alone (``check_bounds`` and
  ``check_inside``), which an index found without a verdict of this host pays once
  (a sidecar's first use, a new host: part of ``open, new host``);
* ``read 1``: ``read_many`` of one random id, per call;
* ``read 256``: ``read_many`` of 256 random ids, per record.

Each figure is the median of ``--repeats`` runs. The same script runs against an
older quern (it uses the sources' public API only) for a before/after.

Run:  PYTHONPATH=... .venv/bin/python benchmarks/index_checks.py [--mib 256] [--files 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import struct
import tarfile
import tempfile
import time
from typing import Any

import numpy as np

from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources.tfrecord import masked_crc

CLASSES: dict[str, Any] = {"webdataset": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}
SUFFIX = {"webdataset": ".tar", "tfrecord": ".tfrecord", "jsonl": ".jsonl"}
RACY_S = 2.2  # quern.pipeline.sources.contents.RACY_NS, and a margin (an older quern has no such module)


def write(fmt: str, path: str, size: int, record: int, rng: np.random.Generator) -> None:
    """A file of about ``size`` bytes of records of about ``record`` bytes."""
    n = max(1, size // record)
    with open(path, "wb") as f:
        if fmt == "webdataset":
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(n):
                    for ext, share in (("bin", record - 600), ("json", 80)):
                        data = rng.bytes(share) if ext == "bin" else json.dumps({"i": i}).encode()
                        info = tarfile.TarInfo(f"{i:08d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        elif fmt == "tfrecord":
            for _ in range(n):
                body = rng.bytes(record - 16)
                head = struct.pack("<Q", len(body))
                f.write(head + struct.pack("<I", masked_crc(head)) + body + struct.pack("<I", masked_crc(body)))
        else:
            text, salt = "w" * (record - 60), int(rng.integers(1 << 30))  # files of other contents
            f.write("".join(json.dumps({"id": i, "salt": salt, "text": text}) + "\n" for i in range(n)).encode())


def median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def new_host(cls: Any, paths: list[str], cache: str, other: str) -> float:
    """Seconds to open ``paths`` with a cache holding the indexes of ``cache`` but no record of the files."""
    shutil.rmtree(other, ignore_errors=True)
    os.makedirs(os.path.join(other, "offsets"))
    for name in os.listdir(os.path.join(cache, "offsets")):
        if name.endswith(".idx"):
            shutil.copy(os.path.join(cache, "offsets", name), os.path.join(other, "offsets"))
    t0 = time.perf_counter()
    opened = cls(paths, index_cache=other)
    seconds = time.perf_counter() - t0
    assert set(opened.index_sources) == {"cache"}, opened.index_sources
    return seconds


def measure(fmt: str, args: argparse.Namespace, tmp: str, rng: np.random.Generator) -> str:
    """One format's row of the table."""
    folder = os.path.join(tmp, fmt)
    os.makedirs(folder)
    paths = [os.path.join(folder, f"part-{k}{SUFFIX[fmt]}") for k in range(args.files)]
    for p in paths:
        write(fmt, p, (args.mib << 20) // args.files, int(args.record_kib * 1024), rng)
    for p in paths:  # warm the page cache
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    time.sleep(RACY_S)
    cls, cache = CLASSES[fmt], os.path.join(tmp, f"idx-{fmt}")
    t0 = time.perf_counter()
    src = cls(paths, index_cache=cache)
    build = time.perf_counter() - t0
    cls(paths, index_cache=cache)  # the records of the hashes, trusted now
    remembered = median_s(lambda: cls(paths, index_cache=cache), args.repeats)
    elsewhere = statistics.median(
        new_host(cls, paths, cache, os.path.join(tmp, f"other-{fmt}")) for _ in range(args.repeats)
    )

    def check() -> None:
        for k, p in enumerate(paths):
            off = src.offsets(k)
            with open(p, "rb", buffering=0) as f:
                bad = cls.check_bounds(f.fileno(), src.sizes[k], int(off[0]), int(off[-1]), p)
                bad = bad or getattr(cls, "check_inside", lambda *a: None)(
                    f.fileno(), src.sizes[k], off, src.contents[k], p
                )
            assert bad is None, bad

    checking = median_s(check, args.repeats)
    ids = np.random.default_rng(1).integers(0, len(src), size=(2048,))
    one = median_s(lambda: [src.read_many(ids[i : i + 1]) for i in range(2048)], args.repeats) / 2048
    many = median_s(lambda: [src.read_many(ids[i : i + 256]) for i in range(0, 2048, 256)], args.repeats) / 2048
    shutil.rmtree(folder)
    return (
        f"| {fmt} | {args.mib} | {len(src):,} | {build:.2f} | {remembered * 1e3:.1f} | {elsewhere * 1e3:.0f} "
        f"| {checking * 1e3:.0f} "
        f"| {one * 1e6:.1f} | {many * 1e6:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of files per format (default 256)")
    ap.add_argument("--files", type=int, default=4, help="files per format (default 4)")
    ap.add_argument("--record-kib", type=float, default=16, help="KiB per record (default 16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", default="webdataset,tfrecord,jsonl")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(
        "| format | MiB | records | build: s | open, remembered: ms | open, new host: ms | check: ms | read 1: µs "
        "| read 256: µs/record |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            print(measure(fmt, args, tmp, rng), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
