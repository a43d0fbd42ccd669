"""WebDataset, TFRecord and JSON lines: quern's random-access sources against each format's own reader.

Data (made by the script, cached under ``benchmarks/data/formats/``; ``--mb`` MiB per format in
``--files`` files; remade when an option changes):

* **tar**: WebDataset shards written by ``webdataset.TarWriter`` (its default float mtime, so a pax
  header before every member, as shards written with it have); a sample is ``bin`` (random bytes,
  1-15 KiB, uniform: a small image's size), ``cls`` (a label) and ``json`` (a small object);
* **tfrecord**: raw records of 1-7 KiB random bytes, framed with the length and data CRCs of
  ``tfrecord.TFRecordWriter`` (``TFRecordWriter.masked_crc``);
* **jsonl**: one ``{"id", "label", "text"}`` object per line (``json.dumps``), the text 256-1,792 ASCII
  characters.

What is measured (page cache warm; every quern source gets ``index_cache=`` a fresh temporary folder,
and ``QUERN_CACHE_DIR`` points into one, so nothing goes to ``~/.cache``):

**1. Records/s**, each format on its own files, its cases taking turns (``common.interleaved``,
``--runs`` rounds, every second one in reverse order) for at least ``--seconds`` each; reported: the
median, the lowest and highest, and the ratio to the format's own sequential reader:

* the format's own reader: ``webdataset.WebDataset(urls, shardshuffle=False)`` (streaming, file
  order: it cannot read shuffled; also ``shardshuffle=100`` with ``.shuffle(1000)``, its buffer
  shuffle); with ``--wids-python``, ``wids.ShardListDataset`` in shuffled order (indexed access;
  wids imports torch, which quern's venv lacks: the figure comes from a child process of that
  interpreter); ``tfrecord.reader.tfrecord_iterator`` in file order (it checks no CRC; quern checks
  both), and record by record in shuffled order through the package's only way to start at a record:
  ``tfrecord_iterator(path, index_path, shard=(k, n))`` with the index of ``tfrecord2idx``; for JSON
  lines a plain loop, ``for line in f: json.loads(line)``, in file order;
* quern ``src.read_many(ids)``, 256 ids a call, shuffled (a permutation) and in file order;
* quern ``Pipeline.from_source(src).shuffle().map(fn).batch(256)``, a fresh ``iterator()`` per run with
  ``num_workers`` 0 and 2 (workers started, then 0.5 s, or ``--warmup`` s with 2 workers, untimed,
  and at least the 31 or 126 steps the iterator takes to reach its largest bulk reads: chunks of 1,
  2, ..., 16 steps without workers, tasks of 1, 2, ..., 64 steps per worker, whose batches come
  together when the task's one bulk read is done; their records/s are printed too; the timed part
  starts and ends right after a ``next()`` that waited, so that bursts count whole, and holds at
  least 64 or 512 steps), ``fn`` a module-level function making ``{"x": (1024,) uint8, "label":
  int32}`` from a record (its first 1,024 bytes, zero-padded).

**2. Index build**: seconds to open each source with an empty index cache (the scan of every file,
``index_threads`` by default), as s/GB and records/s; the median of ``--runs``. Then
``python -m quern index FILES...`` (a fresh process: interpreter and imports included; the time it
prints is the scan and the write of the sidecars), the sidecars removed after. Besides them: the
``tfrecord`` package's ``tfrecord2idx.create_index``, and wids's index of every shard (with
``--wids-python``; wids keeps no index file: it scans each shard whenever it opens one).

**3. First batch**: seconds from nothing (imports done) to the first batch: the source constructed,
the pipeline of part 1 defined, ``iterator(num_workers=0)`` and ``next(it)``, with an empty index cache
(cold: the indexes are built), the cache filled (warm) and the sidecars of ``quern index`` (no cache);
the median of ``--runs``. For wids: the dataset made and the first 256 samples of a shuffled order.

Nothing is asserted. Run (about 3-4 minutes on 2 cores, once the data are made):

    .venv/bin/python benchmarks/formats.py [--mb 256] [--files 4] [--runs 3] [--seconds 1.5]
        [--warmup 3] [--only tar] [--skip rates|index|first] [--wids-python PYTHON] [--json FILE]

``--wids-python`` names the Python of a throwaway venv with ``torch`` (a CPU build), ``numpy``,
``webdataset`` and ``wids`` (see ``docs/benchmarks/formats.md``); never quern's own venv.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from typing import Any

import common
import numpy as np

import quern
from quern.pipeline.sources import JsonlSource, TFRecordSource, WebDatasetSource
from quern.pipeline.sources.offsets import sidecar_path

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "formats")
BATCH = 256
ROW = 1024  # bytes of a record in fn's fixed-shape row
PIPE = f".shuffle().map(fn).batch({BATCH})"
FORMATS = ("tar", "tfrecord", "jsonl")
SOURCES: dict[str, type] = {"tar": WebDatasetSource, "tfrecord": TFRecordSource, "jsonl": JsonlSource}
SUFFIX = {"tar": ".tar", "tfrecord": ".tfrecord", "jsonl": ".jsonl"}


# --------------------------------------------------------------------------- data


def _row(data: bytes) -> np.ndarray:
    """The first ``ROW`` bytes of ``data`` as uint8, zero-padded."""
    out = np.zeros(ROW, dtype=np.uint8)
    head = np.frombuffer(data[:ROW], dtype=np.uint8)
    out[: head.size] = head
    return out


def row_tar(sample: dict[str, Any]) -> dict[str, Any]:
    """A WebDataset sample -> ``{"x": (1024,) uint8, "label": int32}`` (``bin``'s first bytes, ``cls``)."""
    return {"x": _row(sample["bin"]), "label": np.int32(int(sample["cls"]))}


def row_tfrecord(record: bytes) -> dict[str, Any]:
    """A TFRecord record -> ``{"x": (1024,) uint8, "label": int32}`` (its first bytes, its length)."""
    return {"x": _row(record), "label": np.int32(len(record))}


def row_jsonl(obj: dict[str, Any]) -> dict[str, Any]:
    """A JSON-lines object -> ``{"x": (1024,) uint8, "label": int32}`` (the text's first bytes, ``label``)."""
    return {"x": _row(obj["text"].encode()), "label": np.int32(obj["label"])}


ROW_FN: dict[str, Callable[[Any], dict[str, Any]]] = {"tar": row_tar, "tfrecord": row_tfrecord, "jsonl": row_jsonl}


def _tfrecord_frame(data: bytes) -> bytes:
    """A record framed as ``tfrecord.TFRecordWriter.write`` frames one (length, its CRC, data, its CRC)."""
    from tfrecord.writer import TFRecordWriter

    length = len(data).to_bytes(8, "little")
    return length + TFRecordWriter.masked_crc(length) + data + TFRecordWriter.masked_crc(data)


def _write_tar(path: str, rng: np.random.Generator, target: int, first: int) -> int:
    import webdataset

    n, written = 0, 0
    with webdataset.TarWriter(path) as writer:
        while written < target:
            size = int(rng.integers(1 << 10, (15 << 10) + 1))
            label = int(rng.integers(1000))
            i = first + n
            meta = json.dumps({"id": i, "label": label, "size": size})
            writer.write({"__key__": f"{i:08d}", "bin": rng.bytes(size), "cls": str(label), "json": meta})
            written += size + 3 * 1536  # each member: a pax header, its data block and the member's header
            n += 1
    return n


def _write_tfrecord(path: str, rng: np.random.Generator, target: int, first: int) -> int:
    n, written = 0, 0
    with open(path, "wb") as f:
        while written < target:
            frame = _tfrecord_frame(rng.bytes(int(rng.integers(1 << 10, (7 << 10) + 1))))
            f.write(frame)
            written += len(frame)
            n += 1
    return n


_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)  # about one space in 6


def _write_jsonl(path: str, rng: np.random.Generator, target: int, first: int) -> int:
    n, written = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            chunk = []
            for _ in range(1000):
                text = _LETTERS[rng.integers(0, len(_LETTERS), int(rng.integers(256, 1793)))].tobytes().decode()
                line = json.dumps({"id": first + n, "label": int(rng.integers(1000)), "text": text}) + "\n"
                chunk.append(line)
                written += len(line)
                n += 1
                if written >= target:
                    break
            f.write("".join(chunk))
    return n


WRITERS: dict[str, Callable[[str, np.random.Generator, int, int], int]] = {
    "tar": _write_tar,
    "tfrecord": _write_tfrecord,
    "jsonl": _write_jsonl,
}


def make_data(fmt: str, mb: int, files: int, seed: int = 0) -> list[str]:
    """The files of one format (``files`` of ``mb / files`` MiB each), written unless they are there already.

    Args:
        fmt: ``"tar"``, ``"tfrecord"`` or ``"jsonl"``.
        mb: MiB in all.
        files: how many files.
        seed: the generator's seed.

    Returns:
        Their paths, in order.
    """
    folder = os.path.join(DATA, fmt)
    paths = [os.path.join(folder, f"part-{k:03d}{SUFFIX[fmt]}") for k in range(files)]
    meta = {"format": fmt, "mb": mb, "files": files, "seed": seed, "version": 2}
    meta["writer"] = {"tar": version("webdataset"), "tfrecord": version("tfrecord"), "jsonl": "json"}[fmt]
    marker = os.path.join(folder, "meta.json")
    if common.read_marker(marker, meta, *paths) is not None:
        return paths
    print(f"making the {fmt} data ({mb} MiB in {files} files) under {folder} ...", flush=True)
    t0 = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    for old in glob.glob(os.path.join(folder, "*")):
        os.remove(old)
    rng = np.random.default_rng([seed, FORMATS.index(fmt)])
    first = 0
    for path in paths:
        first += WRITERS[fmt](path + ".tmp", rng, (mb << 20) // files, first)
        os.replace(path + ".tmp", path)
    with open(marker, "w") as f:
        json.dump({**meta, "records": first}, f)
    print(f"  done in {time.perf_counter() - t0:.1f}s ({first:,} records)", flush=True)
    return paths


def remove_sidecars(paths: list[str]) -> None:
    """Remove the sidecars ``quern index`` wrote beside ``paths`` (one wins over the cache: the cold figures need none)."""
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(sidecar_path(p))


# --------------------------------------------------------------------------- the formats' own readers


def webdataset_records(paths: list[str], shuffled: bool = False) -> Iterator[dict[str, Any]]:
    """``webdataset.WebDataset`` over ``paths``, epoch after epoch (file order, or its shard and buffer shuffle)."""
    import webdataset

    for epoch in itertools.count():
        if shuffled:
            ds = webdataset.WebDataset(paths, shardshuffle=100, seed=epoch).shuffle(1000)
        else:
            ds = webdataset.WebDataset(paths, shardshuffle=False)
        yield from ds


def tfrecord_records(paths: list[str]) -> Iterator[bytes]:
    """``tfrecord.reader.tfrecord_iterator`` over ``paths`` in file order, epoch after epoch (records copied)."""
    from tfrecord.reader import tfrecord_iterator

    while True:
        for path in paths:
            for view in tfrecord_iterator(path):
                yield bytes(view)


def tfrecord_index_paths(paths: list[str]) -> list[str]:
    """Where the ``tfrecord`` package's index of each file goes (``tfrecord2idx``'s ``.tfindex``)."""
    return [os.path.splitext(p)[0] + ".tfindex" for p in paths]


def tfrecord_random(paths: list[str], counts: list[int], seed: int = 0) -> Callable[[], bytes]:
    """One record at a time in shuffled order, read the only way the ``tfrecord`` package starts at a record.

    ``tfrecord_iterator(path, index_path, shard=(k, n))`` with ``n`` the file's records reads records
    ``[k, k + 1)``; it loads the whole index file (``np.loadtxt``) at every call.
    """
    from tfrecord.reader import tfrecord_iterator

    index = tfrecord_index_paths(paths)
    starts = np.concatenate([[0], np.cumsum(counts)])
    order = itertools.cycle(np.random.default_rng(seed).permutation(int(starts[-1])).tolist())

    def one() -> bytes:
        i = next(order)
        f = int(np.searchsorted(starts, i, side="right")) - 1
        it = tfrecord_iterator(paths[f], index[f], shard=(i - int(starts[f]), counts[f]))
        return bytes(next(it))

    return one


def jsonl_records(paths: list[str]) -> Iterator[Any]:
    """``for line in f: json.loads(line)`` over ``paths``, epoch after epoch."""
    while True:
        for path in paths:
            with open(path, "rb") as f:
                for line in f:
                    yield json.loads(line)


# The wids child: run with --wids-python (an interpreter with torch and wids), it imports neither
# quern nor this folder. argv[1]: JSON {"paths", "counts", "seconds", "batch", "seed", "mode"}.
WIDS_CHILD = r"""
import json, os, sys, time
args = json.loads(sys.argv[1])
existed = os.path.exists("/tmp/_wids_cache")  # wids makes it when imported (a default argument)
t0 = time.perf_counter()
import numpy as np
import wids
imports = time.perf_counter() - t0
paths, counts, batch = args["paths"], args["counts"], args["batch"]
shards = [{"url": p, "nsamples": n} for p, n in zip(paths, counts)]
def dataset():
    return wids.ShardListDataset(shards, localname=lambda url: url, transformations=[])
out = {"imports_s": imports, "wids": getattr(wids, "__version__", "?")}
try:
    import importlib.metadata as md
    out["wids"] = md.version("wids")
    out["torch"] = md.version("torch")
except Exception:
    pass
order = np.random.default_rng(args["seed"]).permutation(int(sum(counts))).tolist()
t0 = time.perf_counter()
ds = dataset()
for i in order[:batch]:
    ds[i][".bin"].getvalue()
out["first_batch_s"] = time.perf_counter() - t0
ds.close()
t0 = time.perf_counter()
ds = dataset()
first = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
for i in first:
    ds[int(i)]
out["index_s"] = time.perf_counter() - t0
out["samples"] = sum(len(ds.cache.get_shard(p)) for p in paths)  # what wids found in the shards
for rows, name in ((order, "shuffled_rps"), (list(range(len(order))), "ordered_rps")):
    for i in rows[:batch]:
        ds[i][".bin"].getvalue()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args["seconds"]:
        for i in rows[n % len(rows): n % len(rows) + batch]:
            ds[i][".bin"].getvalue()
        n += batch
    out[name] = n / (time.perf_counter() - t0)
ds.close()
for p in paths:
    try:
        os.remove(p + ".lock")  # download_and_open's lock file, beside the shard
    except FileNotFoundError:
        pass
if not existed:
    try:
        os.rmdir("/tmp/_wids_cache")
    except OSError:
        pass
print(json.dumps(out))
"""


def run_wids(python: str, paths: list[str], counts: list[int], seconds: float) -> dict[str, Any]:
    """One run of :data:`WIDS_CHILD` in ``python``; its figures."""
    args = {"paths": paths, "counts": counts, "seconds": seconds, "batch": BATCH, "seed": 0}
    out = subprocess.run(
        [python, "-c", WIDS_CHILD, json.dumps(args)], capture_output=True, text=True, check=False, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"the wids child failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- 1. records/s


def _cycle_batches(n: int, order: np.ndarray | None) -> Callable[[], np.ndarray]:
    """The next 256 ids of ``order`` (or of ``0..n-1``), over and over."""
    ids = np.arange(n, dtype=np.int64) if order is None else order
    pos = [0]

    def next_ids() -> np.ndarray:
        a = pos[0]
        pos[0] = (a + BATCH) % (n - BATCH)
        return ids[a : a + BATCH]

    return next_ids


def _records_case(next_record: Callable[[], Any], seconds: float) -> Callable[[], float]:
    def run() -> float:
        for _ in range(BATCH):  # untimed
            next_record()
        return common.rate(next_record, seconds)

    return run


def _read_many_case(src: Any, order: np.ndarray | None, seconds: float) -> Callable[[], float]:
    next_ids = _cycle_batches(len(src), order)

    def run() -> float:
        src.read_many(next_ids())  # untimed
        return common.rate(lambda: src.read_many(next_ids()), seconds, size=len)

    return run


WAITED = 1e-3  # a next() slower than this waited for a bulk read: nothing computed was left


def _until_waited(it: Any, most: int) -> int:
    """Take batches until one of them had to be waited for (at most ``most``); the records taken."""
    rows = 0
    for _ in range(most):
        t0 = time.perf_counter()
        rows += len(next(it)["label"])
        if time.perf_counter() - t0 > WAITED:
            break
    return rows


def _pipeline_case(
    pipe: Any, workers: int, seconds: float, warmup: float, start_rates: list[float]
) -> Callable[[], float]:
    """A fresh iterator per run: ``warmup`` seconds untimed (their records/s go to ``start_rates``), then timed.

    The untimed start takes at least the steps the iterator needs to reach its largest bulk reads
    (0 workers: chunks of 1, 2, 4, 8, 16 steps; 2 workers: tasks of 1, 2, ..., 64 steps each, a
    task's batches coming together once its one bulk read is done). The timed part starts and ends
    right after a ``next()`` that had to wait (nothing computed left over: a burst of ready batches
    counts in full or not at all) and holds at least 4 such bulk reads (64 or 512 steps).
    """
    ramp, full = (31, 64) if workers == 0 else (2 * 63, 2 * 4 * 64)

    def run() -> float:
        it = common.started(pipe.iterator(num_workers=workers))
        try:
            start_rates.append(common.rate(it.__next__, warmup, min_items=ramp, size=lambda b: len(b["label"])))
            _until_waited(it, 4 * full)
            rows, t0 = 0, time.perf_counter()
            while rows < full * BATCH or time.perf_counter() - t0 < seconds:
                rows += len(next(it)["label"])
            rows += _until_waited(it, 4 * full)
            return rows / (time.perf_counter() - t0)
        finally:
            it.close()

    return run


def records_per_second(
    fmt: str, paths: list[str], cache: str, runs: int, seconds: float, warmup: float, wids_python: str | None
) -> dict[str, Any]:
    """Part 1 for one format: the cases taking turns; the table printed."""
    common.warm_page_cache(paths)
    src = SOURCES[fmt](paths, index_cache=cache)
    n = len(src)
    order = np.random.default_rng(0).permutation(n)
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle().map(ROW_FN[fmt]).batch(BATCH)
    own: list[tuple[str, Callable[[], float]]]
    wids: dict[str, list[float]] = {}
    starts: dict[int, list[float]] = {0: [], 2: []}  # records/s of the untimed start of each pipeline run
    if fmt == "tar":
        seq, buf = webdataset_records(paths), webdataset_records(paths, shuffled=True)
        own = [
            ("webdataset.WebDataset, file order (streaming)", _records_case(seq.__next__, seconds)),
            ("webdataset.WebDataset, shardshuffle + .shuffle(1000) buffer", _records_case(buf.__next__, seconds)),
        ]
        if wids_python:

            def wids_run() -> float:
                got = run_wids(wids_python, paths, [int(c) for c in src.counts], seconds)
                if got["samples"] != n:
                    raise RuntimeError(f"wids found {got['samples']:,} samples in the shards, quern {n:,}")
                for k, v in got.items():
                    if isinstance(v, float):
                        wids.setdefault(k, []).append(v)
                wids.setdefault("versions", []).append(f"wids {got.get('wids')}, torch {got.get('torch')}")
                return got["shuffled_rps"]

            own.append(("wids.ShardListDataset, shuffled (indexed)", wids_run))
    elif fmt == "tfrecord":
        from tfrecord.tools.tfrecord2idx import create_index

        for p, q in zip(paths, tfrecord_index_paths(paths)):
            if not os.path.exists(q):
                create_index(p, q)
        one = tfrecord_random(paths, [int(c) for c in src.counts])
        own = [
            ("tfrecord_iterator, file order (no CRC check)", _records_case(tfrecord_records(paths).__next__, seconds)),
            (
                "tfrecord_iterator(index, shard=(k, n)), shuffled, one record a call",
                lambda: common.rate(one, seconds, min_items=5),
            ),
        ]
    else:
        own = [("for line in f: json.loads(line), file order", _records_case(jsonl_records(paths).__next__, seconds))]
    cases = own + [
        (f"quern read_many({BATCH} ids), shuffled", _read_many_case(src, order, seconds)),
        (f"quern read_many({BATCH} ids), file order", _read_many_case(src, None, seconds)),
        (f"quern {PIPE}, 0 workers", _pipeline_case(pipe, 0, seconds, min(warmup, 0.5), starts[0])),
        (f"quern {PIPE}, 2 workers", _pipeline_case(pipe, 2, seconds, warmup, starts[2])),
    ]
    errors: dict[str, str] = {}
    got = common.interleaved(cases, runs, alternate=True, errors=errors)
    size = sum(src.sizes)
    print(f"\n### {fmt}: {len(paths)} files, {size / 1e6:,.0f} MB, {n:,} records ({size / n / 1024:.1f} KiB each)\n")
    print(common.markdown_header(["reader", "records/s (median)", "lowest", "highest", "MB/s", "vs the first row"]))
    base = statistics.median(got[own[0][0]]) if got[own[0][0]] else None
    out: dict[str, Any] = {"files": len(paths), "bytes": size, "records": n, "cases": {}}
    for name, _ in cases:
        rates = got[name]
        if not rates:
            print(common.markdown_row([name, f"FAILED: {errors.get(name, '?')}"]))
            continue
        med = statistics.median(rates)
        out["cases"][name] = rates
        cells = [name, f"{med:,.0f}", f"{min(rates):,.0f}", f"{max(rates):,.0f}", f"{med * size / n / 1e6:,.0f}"]
        print(common.markdown_row([*cells, common.ratio(med, base)]))
    line = "; ".join(
        f"{w} workers (at least {min(warmup, 0.5) if w == 0 else warmup:g} s, {31 if w == 0 else 126} steps): "
        f"{common.join_runs(r)}"
        for w, r in starts.items()
    )
    print(f"\n(the untimed start of each pipeline run, records/s: {line})")
    out["pipeline_start"] = {f"w{w}": r for w, r in starts.items()}
    if wids:
        out["wids"] = wids
    return out


# --------------------------------------------------------------------------- 2. index build


def _open_seconds(fmt: str, paths: list[str], cache: str) -> tuple[float, Any]:
    t0 = time.perf_counter()
    src = SOURCES[fmt](paths, index_cache=cache)
    return time.perf_counter() - t0, src


def index_build(all_paths: dict[str, list[str]], root: str, runs: int, wids_runs: list[float] | None) -> dict[str, Any]:
    """Part 2: opening with an empty index cache; ``quern index``; the libraries' own indexes."""
    print("\n## 2. Index build (page cache warm)\n")
    built: dict[str, list[float]] = {fmt: [] for fmt in all_paths}
    records: dict[str, int] = {}
    for _ in range(runs):
        for fmt, paths in all_paths.items():
            seconds, src = _open_seconds(fmt, paths, tempfile.mkdtemp(dir=root, prefix=f"cold-{fmt}-"))
            assert set(src.index_sources) == {"built"}, src.index_sources
            built[fmt].append(seconds)
            records[fmt] = len(src)
    cli: dict[str, tuple[float, float]] = {}
    for fmt, paths in all_paths.items():
        remove_sidecars(paths)
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "quern", "index", *paths], capture_output=True, text=True, check=True, timeout=600
        )
        wall = time.perf_counter() - t0
        m = re.search(r"GB in ([0-9.]+) s", out.stdout)
        cli[fmt] = (wall, float(m.group(1)) if m else float("nan"))
        remove_sidecars(paths)
    own: dict[str, tuple[str, float]] = {}
    if "tfrecord" in all_paths:
        from tfrecord.tools.tfrecord2idx import create_index

        paths = all_paths["tfrecord"]
        t0 = time.perf_counter()
        for p, q in zip(paths, tfrecord_index_paths(paths)):
            create_index(p, q)
        own["tfrecord"] = ("tfrecord2idx.create_index, one file after another", time.perf_counter() - t0)
    if "tar" in all_paths and wids_runs:
        own["tar"] = ("wids: each shard scanned when first opened (every open)", statistics.median(wids_runs))
    header = ["format", "GB", "records", "open, empty cache: s", "s/GB", "records/s", "runs"]
    print(common.markdown_header([*header, "`quern index`: s (scan + write)", "its own index: s/GB"]))
    out: dict[str, Any] = {}
    for fmt, paths in all_paths.items():
        gb = sum(os.path.getsize(p) for p in paths) / 1e9
        med = statistics.median(built[fmt])
        wall, inner = cli[fmt]
        lib = own.get(fmt)
        out[fmt] = {"gb": gb, "open_s": built[fmt], "cli_wall_s": wall, "cli_s": inner, "records": records[fmt]}
        if lib:
            out[fmt]["own"] = {"what": lib[0], "s": lib[1]}
        cells = [fmt, f"{gb:.3f}", f"{records[fmt]:,}", f"{med:.3f}", f"{med / gb:.2f}", f"{records[fmt] / med:,.0f}"]
        cells += [common.join_runs(built[fmt], ".3f"), f"{wall:.2f} ({inner:.2f})"]
        print(common.markdown_row([*cells, f"{lib[1] / gb:.2f} ({lib[0]})" if lib else "-"]))
    return out


# --------------------------------------------------------------------------- 3. first batch


def first_batch(fmt: str, paths: list[str], cache: str) -> tuple[float, str]:
    """Seconds to construct the source, define the pipeline, make ``iterator()`` and take its first batch."""
    t0 = time.perf_counter()
    src = SOURCES[fmt](paths, index_cache=cache)
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle().map(ROW_FN[fmt]).batch(BATCH)
    with pipe.iterator(num_workers=0) as it:
        next(it)
        seconds = time.perf_counter() - t0
    return seconds, ",".join(sorted(set(src.index_sources)))


def first_batches(
    all_paths: dict[str, list[str]], root: str, runs: int, wids_first: list[float] | None
) -> dict[str, Any]:
    """Part 3: cold, warm and sidecar first batches, the formats and modes taking turns."""
    print("\n## 3. Time to the first batch (source + pipeline + iterator + next, 0 workers)\n")
    warm_dirs = {fmt: tempfile.mkdtemp(dir=root, prefix=f"warm-{fmt}-") for fmt in all_paths}
    for fmt, paths in all_paths.items():
        first_batch(fmt, paths, warm_dirs[fmt])  # fills the warm cache (and warms the code paths)
    times: dict[tuple[str, str], list[float]] = {}
    seen: dict[tuple[str, str], str] = {}

    def measure(fmt: str, mode: str, paths: list[str]) -> None:
        cache = tempfile.mkdtemp(dir=root, prefix=f"fb-{fmt}-") if mode != "warm" else warm_dirs[fmt]
        seconds, where = first_batch(fmt, paths, cache)
        times.setdefault((fmt, mode), []).append(seconds)
        seen[fmt, mode] = where

    for _ in range(runs):
        for fmt, paths in all_paths.items():
            measure(fmt, "cold", paths)
            measure(fmt, "warm", paths)
    for paths in all_paths.values():
        subprocess.run([sys.executable, "-m", "quern", "index", *paths], capture_output=True, check=True, timeout=600)
    try:
        for _ in range(runs):
            for fmt, paths in all_paths.items():
                measure(fmt, "sidecar", paths)
    finally:
        for paths in all_paths.values():
            remove_sidecars(paths)
    print(common.markdown_header(["format", "cold: s (index built)", "warm: s (index cached)", "sidecar: s", "runs"]))
    out: dict[str, Any] = {}
    for fmt in all_paths:
        cells = [fmt]
        for mode in ("cold", "warm", "sidecar"):
            cells.append(f"{statistics.median(times[fmt, mode]):.3f} ({seen[fmt, mode]})")
        runs_cell = "; ".join(common.join_runs(times[fmt, m], ".3f") for m in ("cold", "warm", "sidecar"))
        print(common.markdown_row([*cells, runs_cell]))
        out[fmt] = {mode: times[fmt, mode] for mode in ("cold", "warm", "sidecar")}
    if wids_first:
        med = statistics.median(wids_first)
        print(
            f"\nwids (tar): the dataset made and the first {BATCH} samples of a shuffled order: {med:.3f} s "
            f"(runs {common.join_runs(wids_first, '.3f')}; it keeps no index: every open scans the shards it reads)"
        )
        out["wids_tar_first_batch_s"] = wids_first
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="MiB of data per format (default 256)")
    ap.add_argument("--files", type=int, default=4, help="files per format (default 4)")
    ap.add_argument("--runs", type=int, default=3, help="rounds of each figure (default 3)")
    ap.add_argument("--seconds", type=float, default=1.5, help="timed seconds per records/s run (default 1.5)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="untimed seconds of a 2-worker pipeline run (default 3; 0 workers: 0.5)",
    )
    ap.add_argument("--only", action="append", choices=FORMATS, help="only this format (repeatable)")
    ap.add_argument("--wids-python", help="the Python of a venv with torch and wids, for wids's figures")
    ap.add_argument(
        "--skip", action="append", default=[], choices=["rates", "index", "first"], help="skip a part (repeatable)"
    )
    args = common.parse_args(ap)
    assert args is not None
    print("# File formats: WebDataset tar, TFRecord, JSON lines\n")
    t_start = common.begin(webdataset=version("webdataset"), tfrecord=version("tfrecord"))
    formats = [f for f in FORMATS if not args.only or f in args.only]
    all_paths = {fmt: make_data(fmt, args.mb, args.files) for fmt in formats}
    for paths in all_paths.values():
        remove_sidecars(paths)  # left by an interrupted run: they would win over the cold caches
    figures: dict[str, Any] = {"mb": args.mb, "files": args.files}
    with tempfile.TemporaryDirectory(prefix="quern-bench-formats-") as root:
        os.environ["QUERN_CACHE_DIR"] = os.path.join(root, "quern-cache")  # nothing goes to ~/.cache
        wids: dict[str, list[float]] = {}
        if "rates" not in args.skip:
            print(f"\n## 1. Records/s ({args.runs} interleaved runs of at least {args.seconds:g} s, page cache warm)")
            figures["rates"] = {}
            for fmt, paths in all_paths.items():
                got = records_per_second(
                    fmt, paths, tempfile.mkdtemp(dir=root), args.runs, args.seconds, args.warmup, args.wids_python
                )
                figures["rates"][fmt] = got
                wids = got.get("wids", wids)
            if wids:
                print(f"\nwids figures from {wids['versions'][0]} (another venv), median of {args.runs} runs:", end=" ")
                print(
                    f"shuffled {statistics.median(wids['shuffled_rps']):,.0f} samples/s, file order "
                    f"{statistics.median(wids['ordered_rps']):,.0f}; its import (torch) "
                    f"{statistics.median(wids['imports_s']):.2f} s"
                )
        if "index" not in args.skip:
            figures["index"] = index_build(all_paths, root, args.runs, wids.get("index_s"))
        if "first" not in args.skip:
            figures["first_batch"] = first_batches(all_paths, root, args.runs, wids.get("first_batch_s"))
    for p in itertools.chain.from_iterable(tfrecord_index_paths(v) for k, v in all_paths.items() if k == "tfrecord"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s")
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
