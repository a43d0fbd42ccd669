"""Remote reads: a prepared folder read over a slow HTTP link through a disk cache of a quarter of the data, with
the exact lookahead and with a plain LRU cache, against the same folder read from local files.

What is measured
----------------
**Data** (made once, kept under ``benchmarks/data/remote/``, with ``remote.json`` beside it saying what it
holds): ``--shards`` x ``--shard-mib`` MiB of records of ``--record-kib`` KiB of random bytes (one file per
record, ``np.random.default_rng(0)``), prepared by ``quern.prepare.prepare(docs, www/prep,
shard_size="<shard-mib>MB", workers=0)`` (the default compression, zstd:1, which random bytes do not shrink):
every shard holds the same number of records R (checked). The folder ``www/`` is served by a private nginx on
127.0.0.1 (``tests/servers.py``) with ``limit_rate`` ``--rate`` (default ``"50m"``: 50 MiB/s), measured once
at the start (one shard, one connection). nginx's rate is *per connection* and it hands over its first write (up
to 2 MiB, its ``sendfile_max_chunk``) unpaced, so a shard of S MiB takes about (S - 2) / 50 s: the shards are
16 MiB by default (not 4) so that the link is mostly paced; the measured rate is printed.

**Pipeline** (the one step trace of every run): ``Pipeline.from_source(src, seed=0, num_epochs=--epochs)
.shuffle("block", block_size=R, window=2).batch(--batch)``: blocks are whole shards, two shards read at a time, a
new order of the shards each epoch. ``pipe.iterator()`` with its defaults (one thread, 2 chunks computed ahead)
and ``lookahead`` as below; every step's ``next()`` is timed. Runs, each over the whole stream (``--epochs``
epochs), each with a fresh, empty cache folder and a new source:

* **local files**: ``ArrayRecordSource(www/prep)``, no cache, no network (the reference);
* **lookahead**: ``ArrayRecordSource(URL, cache=ShardCache(folder, capacity=data // 4))``, ``lookahead=64``
  (the default): the next 64 steps' shards fetched ahead on the source's 4 fetch threads, Belady eviction.
  As nginx limits each connection, 4 fetches at once may take up to 4x the rate;
* **lookahead, 1 thread**: the same, the source's ``prefetch`` called with ``threads=1`` (set on the
  instance): never more than one fetch ahead at once, i.e. a link of the rate, shared;
* **LRU, no lookahead**: ``lookahead=0``: a shard is fetched when a read needs it (on the iterator's
  thread), the least recently used one evicted.

Two passes of all four: **as fast as possible** (``next()`` in a loop: records/s is the loader's throughput)
and **with a training step** of ``--step-ms`` ms (``time.sleep`` after each ``next()``, the CPU free for the
loader's threads, as a GPU step leaves it; the default 25 ms consumes 1 MiB per step at 40 MiB/s, below the
link's rate: a loader that fetches ahead can then hide every fetch).

Per run: wall seconds and records/s (and their ratio to local files); **bytes fetched per epoch / data size**
(``cache.stats["bytes_fetched"]`` over the run / epochs / the shards' bytes; 1.0 is ideal, each shard once per
epoch; nginx's body bytes sent are printed too, as a check); **steps that waited**: steps whose ``next()``
took more than the local run's median ``next()`` of the same pass + 5 ms (the local run counts its own by the
same rule: the loader's own compute), with the seconds those steps spent in ``next()``; **reads that waited
for the link**: ``ShardCache.get`` calls made by the iterator's thread (not the fetch-ahead threads) that took
over 5 ms (a fetch on demand, or waiting for a fetch ahead still under way), with their seconds; the cache's
misses and evictions and its largest size seen (every 16 steps); and whether every batch equals the local
run's (a digest of each record's length and first and last 16 bytes). Then the ratios LRU / lookahead.

**Time to first batch**: seconds from ``pipe.iterator()`` to its first batch (the source and the pipeline
made before the clock starts, their manifest read), median of ``--repeats``: **cold** (an empty cache folder:
the first window's two shards fetched) with lookahead and without, **warm** (a cache folder that already holds
the first window's shards: filled by one step of another iterator with another ``ShardCache`` object on the
same folder, then a new source and ``ShardCache``), and local files.

Nothing is asserted; it prints figures and ratios. Closing the iterator stops the source's fetch-ahead
threads (``stop_prefetch``), so no run's fetches leak into the next one.

Run: .venv/bin/python benchmarks/remote.py [--shards 32] [--shard-mib 16] [--record-kib 32] [--batch 32]
[--epochs 2] [--rate 50m] [--step-ms 25] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

import common
import numpy as np

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(HERE, "data", "remote")
DOCS = os.path.join(DATA, "docs")
WWW = os.path.join(DATA, "www")
PREP = os.path.join(WWW, "prep")
CACHES = os.path.join(DATA, "caches")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from servers import NGINX, nginx  # noqa: E402  (tests/servers.py: the private nginx the tests use)

MiB = 1 << 20
WAIT_MS = 5.0  # a step waited: its next() took this much more than the local median; a read: its get() took this
SIZE_EVERY = 16  # steps between two looks at the cache's size


# --------------------------------------------------------------------------- data


def build_data(shards: int, shard_mib: int, record_kib: int) -> dict[str, Any]:
    """The prepared folder (made unless ``remote.json`` says it holds this data); its description."""
    marker = DATA + ".json"
    want = {"shards": shards, "shard_mib": shard_mib, "record_kib": record_kib}
    desc = common.read_marker(marker, want, PREP)
    if desc is not None:
        desc["built_seconds"] = None
        return desc
    t0 = time.perf_counter()
    shutil.rmtree(DATA, ignore_errors=True)
    if os.path.exists(marker):
        os.remove(marker)
    os.makedirs(DOCS)
    per_shard = shard_mib * 1024 // record_kib
    n = shards * per_shard
    rng = np.random.default_rng(0)
    for i in range(n):
        with open(os.path.join(DOCS, f"{i:06d}.bin"), "wb") as f:
            f.write(rng.bytes(record_kib * 1024))
    manifest = prepare(DOCS, PREP, shard_size=f"{shard_mib}MB", num_workers=0, progress=False)
    shutil.rmtree(DOCS)  # the shards hold them
    counts = [s["records"] for s in manifest["shards"]]
    if len(set(counts)) != 1:
        raise SystemExit(f"the shards hold different numbers of records: {counts}; choose other sizes")
    desc = {
        **want,
        "records": n,
        "records_per_shard": counts[0],
        "shard_count": len(counts),
        "bytes": sum(s["bytes"] for s in manifest["shards"]),
        "record_bytes": n * record_kib * 1024,
    }
    with open(marker, "w") as f:
        json.dump(desc, f, indent=1)
    desc["built_seconds"] = time.perf_counter() - t0
    return desc


# --------------------------------------------------------------------------- runs


class WatchedCache(ShardCache):
    """A ShardCache that notes the ``get`` calls of threads other than the source's fetch-ahead ones that took over
    WAIT_MS: the reads that waited for the link."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits: list[float] = []

    def get(self, url: str, *, size: int | None = None, sha256: str | None = None) -> str:
        t0 = time.perf_counter()
        try:
            return super().get(url, size=size, sha256=sha256)
        finally:
            dt = time.perf_counter() - t0
            if dt * 1000 > WAIT_MS and not threading.current_thread().name.startswith("quern-fetch"):
                self.waits.append(dt)


def make_pipe(src: Any, records_per_shard: int, batch: int, epochs: int) -> Any:
    return (
        quern.Pipeline.from_source(src, seed=0, num_epochs=epochs)
        .shuffle("block", block_size=records_per_shard, window=2)
        .batch(batch)
    )


def digest(batch: Any) -> bytes:
    """A short digest of a batch of ``bytes`` records: their lengths, first and last 16 bytes."""
    h = hashlib.blake2b(digest_size=16)
    for r in batch:
        r = bytes(r)
        h.update(len(r).to_bytes(8, "little") + r[:16] + r[-16:])
    return h.digest()


def stop_fetching(src: Any) -> None:
    """Shut the source's fetch-ahead threads down (closing the iterator does it too; kept for safety)."""
    stop = getattr(src, "stop_prefetch", None)
    if stop is not None:
        stop()


def one_run(
    mode: str, url: str, desc: dict[str, Any], args: argparse.Namespace, step_s: float, srv: Any
) -> dict[str, Any]:
    cache = None
    if mode == "local":
        src = quern.sources.ArrayRecordSource(PREP)
    else:
        folder = os.path.join(CACHES, "run")
        shutil.rmtree(folder, ignore_errors=True)
        cache = WatchedCache(folder, capacity=desc["bytes"] // 4)
        src = quern.sources.ArrayRecordSource(url, cache=cache)
        if mode == "lookahead-1":
            src.prefetch = functools.partial(src.prefetch, threads=1)  # one fetch ahead at a time
    pipe = make_pipe(src, desc["records_per_shard"], args.batch, args.epochs)
    steps = pipe.num_steps
    per_epoch = steps // args.epochs
    lookahead = 0 if mode == "lru" else 64
    lat = np.empty(steps)
    digests = []
    biggest = 0
    epoch_bytes = []
    served_before = len(srv.requests())
    t0 = time.perf_counter()
    with pipe.iterator(lookahead=lookahead) as it:
        for s in range(steps):
            a = time.perf_counter()
            batch = next(it)
            lat[s] = time.perf_counter() - a
            digests.append(digest(batch))
            if cache is not None:
                if s % SIZE_EVERY == 0:
                    biggest = max(biggest, cache.size())
                if (s + 1) % per_epoch == 0:
                    epoch_bytes.append(cache.stats["bytes_fetched"])
            if step_s:
                time.sleep(step_s)
    wall = time.perf_counter() - t0
    stop_fetching(src)
    r: dict[str, Any] = {"mode": mode, "wall": wall, "lat": lat, "digests": digests, "steps": steps}
    r["records"] = steps * args.batch
    if cache is not None:
        biggest = max(biggest, cache.size())
        served = srv.requests()[served_before:]
        r.update(
            stats=dict(cache.stats),
            waits=list(cache.waits),
            biggest=biggest,
            epoch_bytes=np.diff([0, *epoch_bytes]).tolist(),
            nginx_bytes=sum(q.sent for q in served if q.path.endswith(".array_record")),
            gets=[q.path for q in served if q.method == "GET" and q.path.endswith(".array_record")],
        )
        shutil.rmtree(cache.folder, ignore_errors=True)
    return r


MODES = [
    ("local", "local files"),
    ("lookahead", "lookahead 64, 4 fetch threads"),
    ("lookahead-1", "lookahead 64, 1 fetch thread"),
    ("lru", "LRU, no lookahead"),
]


def print_pass(title: str, runs: dict[str, dict[str, Any]], desc: dict[str, Any], args: argparse.Namespace) -> None:
    local = runs["local"]
    med = float(np.median(local["lat"]))
    thr = med + WAIT_MS / 1000
    print(f"\n{title}")
    print(
        f"  a step waited: next() > {thr * 1000:.1f} ms (local median {med * 1000:.2f} ms + {WAIT_MS:g} ms); "
        f"a read waited: a get() off the fetch threads > {WAIT_MS:g} ms"
    )
    rows = []
    for key, label in MODES:
        r = runs[key]
        waited = r["lat"] > thr
        rps = r["records"] / r["wall"]
        same = "= local" if r["digests"] == local["digests"] else "DIFFER"
        if key == "local":
            fetched = per = reads = biggest = evict = "-"
        else:
            st = r["stats"]
            fetched = f"{st['bytes_fetched'] / args.epochs / desc['bytes']:.3f}"
            per = "/".join(f"{b / desc['bytes']:.2f}" for b in r["epoch_bytes"])
            reads = f"{len(r['waits'])} {sum(r['waits']):.1f}s"
            biggest = f"{r['biggest'] / desc['bytes']:.2f}"
            evict = str(st["evictions"])
        rows.append(
            [label, f"{r['wall']:.1f}", f"{rps:,.0f}", common.ratio(rps, local["records"] / local["wall"])]
            + [fetched, per, f"{int(waited.sum())} / {r['steps']}", f"{r['lat'][waited].sum():.1f}"]
            + [reads, biggest, evict, same]
        )
    header = ["run", "wall s", "rec/s", "/local", "fetched/epoch", "per epoch", "steps waited", "in them s"]
    header += ["reads waited", "max cache", "evict", "batches"]
    common.print_table(header, rows, left=(0, 11), indent="  ")
    for key, label in MODES[1:]:
        r = runs[key]
        st = r["stats"]
        per_shard: dict[str, int] = {}
        for g in r["gets"]:
            per_shard[g] = per_shard.get(g, 0) + 1
        print(
            f"  {label}: nginx sent {r['nginx_bytes'] / MiB:,.0f} MiB ({r['nginx_bytes'] / args.epochs / desc['bytes']:.3f} "
            f"of the data per epoch) in {len(r['gets'])} shard GETs (most for one shard: "
            f"{max(per_shard.values(), default=0)}); cache misses {st['misses']}, hits {st['hits']}, retries "
            f"{st['retries']}; first batch {r['lat'][0]:.2f} s; slowest next() {r['lat'].max():.2f} s"
        )
    a, b = runs["lookahead"], runs["lru"]

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}" if y else ("1.00" if x == y else "inf")

    thr_steps = [int((r["lat"] > thr).sum()) for r in (b, a)]
    print(
        f"  LRU / lookahead (4 threads): bytes fetched {ratio(b['stats']['bytes_fetched'], a['stats']['bytes_fetched'])}, "
        f"wall {ratio(b['wall'], a['wall'])}, steps waited {thr_steps[0]} / {thr_steps[1]} = "
        f"{ratio(*thr_steps)}, seconds in waited steps {ratio(b['lat'][b['lat'] > thr].sum(), a['lat'][a['lat'] > thr].sum())}"
    )
    c = runs["lookahead-1"]
    thr_c = int((c["lat"] > thr).sum())
    print(
        f"  LRU / lookahead (1 thread):  bytes fetched {ratio(b['stats']['bytes_fetched'], c['stats']['bytes_fetched'])}, "
        f"wall {ratio(b['wall'], c['wall'])}, steps waited {thr_steps[0]} / {thr_c} = {ratio(thr_steps[0], thr_c)}, "
        f"seconds in waited steps {ratio(b['lat'][b['lat'] > thr].sum(), c['lat'][c['lat'] > thr].sum())}"
    )


# --------------------------------------------------------------------------- first batch


def first_batch(url: str | None, folder: str | None, desc: dict[str, Any], args: argparse.Namespace, la: int) -> float:
    """Seconds from ``pipe.iterator(lookahead=la)`` to its first batch (source and pipeline made before)."""
    if url is None:
        src = quern.sources.ArrayRecordSource(PREP)
    else:
        src = quern.sources.ArrayRecordSource(url, cache=ShardCache(folder, capacity=desc["bytes"] // 4))
    pipe = make_pipe(src, desc["records_per_shard"], args.batch, args.epochs)
    t0 = time.perf_counter()
    with pipe.iterator(lookahead=la) as it:
        next(it)
        dt = time.perf_counter() - t0
    stop_fetching(src)
    return dt


def first_batches(url: str, desc: dict[str, Any], args: argparse.Namespace) -> None:
    folder = os.path.join(CACHES, "first")
    rows = []
    for label, la, warm in [
        ("cold, lookahead 64", 64, False),
        ("cold, LRU (lookahead=0)", 0, False),
        ("warm, lookahead 64", 64, True),
        ("warm, LRU (lookahead=0)", 0, True),
    ]:
        times = []
        for _ in range(args.repeats):
            shutil.rmtree(folder, ignore_errors=True)
            if warm:  # another iterator, another ShardCache object on the folder, fetched the first window
                first_batch(url, folder, desc, args, 0)
            times.append(first_batch(url, folder, desc, args, la))
        rows.append((label, times))
    rows.append(("local files", [first_batch(None, None, desc, args, 64) for _ in range(args.repeats)]))
    shutil.rmtree(folder, ignore_errors=True)
    print(
        f"\ntime to first batch: pipe.iterator() to its first batch (source and pipeline made before), median of "
        f"{args.repeats}"
    )
    for label, times in rows:
        print(f"  {label:<26s} {statistics.median(times):7.3f} s   ({common.join_runs(times, '.3f')})")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=32, help="shards in the data (default 32)")
    ap.add_argument("--shard-mib", type=int, default=16, help="MiB of records per shard (default 16)")
    ap.add_argument("--record-kib", type=int, default=32, help="KiB per record (default 32)")
    ap.add_argument("--batch", type=int, default=32, help="records per step (default 32)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")
    ap.add_argument("--rate", default="50m", help="nginx limit_rate per connection (default 50m = 50 MiB/s)")
    ap.add_argument("--step-ms", type=float, default=25.0, help="training step of the second pass (default 25)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each time-to-first-batch case (default 3)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    print(common.command_line())
    import fsspec

    print(
        common.machine_line(fsspec=fsspec.__version__, nginx=str(NGINX))
        + "; nginx and this process on one machine (loopback)"
    )
    if NGINX is None:
        raise SystemExit("nginx is not installed (make services installs it)")
    desc = build_data(args.shards, args.shard_mib, args.record_kib)
    built = "" if desc["built_seconds"] is None else f", built in {desc['built_seconds']:.0f} s"
    print(
        f"\ndata: {PREP}: {desc['records']:,} records of {args.record_kib} KiB random bytes in {desc['shard_count']} "
        f"shards of {desc['records_per_shard']} records, {desc['bytes']:,} bytes ({desc['bytes'] / MiB:,.0f} MiB){built}"
    )
    steps = desc["records"] * args.epochs // args.batch
    print(
        f"pipeline: from_source(src, seed=0, num_epochs={args.epochs}).shuffle('block', block_size="
        f"{desc['records_per_shard']}, window=2).batch({args.batch}): {steps} steps, "
        f"{desc['records_per_shard'] // args.batch} per shard; cache capacity {desc['bytes'] // 4:,} bytes "
        f"(a quarter, {desc['bytes'] // 4 // (desc['bytes'] // desc['shard_count'])} shards)"
    )
    os.makedirs(CACHES, exist_ok=True)
    with nginx(WWW, limit_rate=args.rate) as srv:
        url = f"{srv.url}/prep"
        name = json.load(open(os.path.join(PREP, "manifest.json")))["shards"][0]["file"]
        t0 = time.perf_counter()
        n = len(urllib.request.urlopen(f"{url}/{name}").read())
        dt = time.perf_counter() - t0
        print(
            f"link: nginx limit_rate {args.rate!r} per connection; one shard ({n / MiB:.1f} MiB) over one connection "
            f"in {dt:.2f} s = {n / MiB / dt:.1f} MiB/s"
        )
        for title, step_ms in [
            ("as fast as possible", 0.0),
            (f"with a training step of {args.step_ms:g} ms", args.step_ms),
        ]:
            runs = {key: one_run(key, url, desc, args, step_ms / 1000, srv) for key, _ in MODES}
            print_pass(
                f"{'1' if not step_ms else '2'}. {title}: {args.epochs} epochs, fresh cache each run", runs, desc, args
            )
        first_batches(url, desc, args)
    shutil.rmtree(CACHES, ignore_errors=True)
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s (the data stays in {DATA})")


if __name__ == "__main__":
    main()
