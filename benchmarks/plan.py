"""``quern plan`` at scale, and the plan against a measured run.

What is measured
----------------
1. **The plan at scale.** A prepared folder of ``--records`` (365 million, C4's
   documents) records in ``--shards`` (8,192) shards of about 256 MiB, behind a
   ``file://`` URL. Only its ``manifest.json`` is written (a plan reads nothing
   else; the shards are never opened). The pipeline is
   ``Pipeline.from_source(src, seed=0).shuffle(MODE).batch(HOSTS * ROWS)``,
   ``--hosts`` (4,096) hosts of ``--rows`` (1) rows per step, over ``--steps``
   (10,000) steps; the wall time of ``quern.plan_io`` on this machine: without a
   cache, then with a ``--cache`` (64 GiB) disk cache per host replayed under Belady's
   rule, for a global and a block shuffle. numba compiles the cache's replay in the
   first call (about 1-2 s, included).
2. **The plan is the truth.** A prepared folder of 48 documents in 12 shards served by
   Python's ``http.server`` on 127.0.0.1, read through a disk cache of 3.5 shards
   (so that files are evicted and fetched again): host 1 of 2 runs every step
   (``read_ahead=3, lookahead=0``) for a global shuffle, a block shuffle and a
   mixture of two folders; the cache's own counters and the server's GET lines
   against the plan's figures.

Run:  python benchmarks/plan.py  [--hosts 4096] [--steps 10000] [--rows 1]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import begin, command_line, machine_line, markdown_header, markdown_row, print_table

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare

HERE = Path(__file__).resolve().parent


def fake_folder(root: Path, records: int, shards: int, shard_bytes: int) -> str:
    """A prepared folder's manifest alone (no shard written): ``file://`` URL of the folder."""
    counts = np.full(shards, records // shards, dtype=np.int64)
    counts[: records % shards] += 1
    digest = hashlib.sha256(b"plan").hexdigest()
    manifest = {
        "format": "quern-prepared",
        "version": 1,
        "job": "0" * 32,
        "input": {"inputs": [], "order": "", "sha256": digest},
        "map": None,
        "options": {},
        "records": {"count": int(records), "type": "bytes"},
        "metadata": {},
        "skipped": [],
        "shards": [
            {
                "file": f"shard-{i:05d}-of-{shards:05d}.array_record",
                "records": int(c),
                "bytes": shard_bytes,
                "sha256": digest,
            }
            for i, c in enumerate(counts)
        ],
    }
    folder = root / "c4"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return f"file://{folder}"


def at_scale(args: argparse.Namespace, tmp: Path) -> list[list[Any]]:
    url = fake_folder(tmp, args.records, args.shards, args.shard_bytes)
    rows = []
    for mode in ("global", "block"):
        src = quern.sources.ArrayRecordSource(url, cache=ShardCache(tmp / "cache"))
        pipe = quern.Pipeline.from_source(src, seed=0).shuffle(mode).batch(args.hosts * args.rows)
        for cache in (None, args.cache):
            t0 = time.perf_counter()
            plan = quern.plan_io(pipe, hosts=args.hosts, steps=(0, args.steps), cache_bytes=cache)
            seconds = time.perf_counter() - t0
            reads = int(plan.per_host["file_reads"].sum())
            keep = plan.spread("no_refetch_cache")
            fetched = plan.spread("bytes_fetched") if cache else None
            rows.append(
                [
                    mode,
                    "-" if cache is None else f"{cache >> 30} GiB, belady",
                    f"{seconds:.1f}",
                    f"{reads:,}",
                    f"{plan.spread('files_per_step')['p50']:.1f}",
                    f"{keep['p50'] / 2**30:.1f} / {keep['max'] / 2**30:.1f} GiB",
                    "-" if fetched is None else f"{fetched['p50'] / 2**30:,.0f} / {fetched['max'] / 2**30:,.0f} GiB",
                    f"{plan.egress_per_epoch.sum() / 2**50:.2f} PiB",
                ]
            )
            print(plan.text(), "\n", flush=True)
    return rows


@contextlib.contextmanager
def http_server(root: Path):
    """Python's ``http.server`` serving ``root`` on a free port of 127.0.0.1: ``(url, log path)``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = root.parent / "http.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)],
            stderr=out,
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}", log
        finally:
            proc.terminate()
            proc.wait(10)


def folder(root: Path, name: str, n: int, size: int, seed: int) -> None:
    docs = root / f"{name}-docs"
    docs.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(n):
        (docs / f"{i:03d}.bin").write_bytes(rng.bytes(size))
    prepare(docs, root / "www" / name, shard_size=f"{4 * size}B", num_workers=0, progress=False)


def against_a_run(tmp: Path) -> list[list[Any]]:
    folder(tmp, "a", 48, 3000, 1)
    folder(tmp, "b", 32, 2000, 2)
    rows = []
    with http_server(tmp / "www") as (url, log):

        def build(kind: str, cache: ShardCache) -> quern.Pipeline:
            a = quern.sources.ArrayRecordSource(f"{url}/a", cache=cache)
            if kind == "global":
                return quern.Pipeline.from_source(a, seed=3, num_epochs=2).shuffle("global").batch(4)
            if kind == "block":
                return quern.Pipeline.from_source(a, seed=3, num_epochs=2).shuffle("block", block_size=4).batch(4)
            b = quern.sources.ArrayRecordSource(f"{url}/b", cache=cache)
            pa = quern.Pipeline.from_source(a, seed=1, num_epochs=2).shuffle("global")
            pb = quern.Pipeline.from_source(b, seed=2, num_epochs=2).shuffle("block", block_size=4)
            return quern.mix({"a": pa, "b": pb}, weights=[0.7, 0.3], seed=4).batch(4)

        for kind in ("global", "block", "mixture"):
            probe = build(kind, ShardCache(tmp / f"probe-{kind}"))
            shard = max(s["bytes"] for src in probe.sources for s in src.manifest["shards"])
            capacity = 3 * shard + shard // 2
            plan = quern.plan_io(probe, hosts=2, cache_bytes=capacity, policy="lru", read_ahead=3)
            cache = ShardCache(tmp / f"cache-{kind}", capacity=capacity)
            start = len(log.read_text().splitlines())
            with build(kind, cache).iterator(process_index=1, process_count=2, read_ahead=3, lookahead=0) as it:
                for _ in it:
                    pass
            time.sleep(0.2)
            gets = [x for x in log.read_text().splitlines()[start:] if re.search(r'"GET \S+\.array_record ', x)]
            h = 1
            for name, planned, measured in (
                ("file reads (opens)", plan.per_host["file_reads"][h], cache.stats["hits"] + cache.stats["misses"]),
                ("cache hits", plan.per_host["hits"][h], cache.stats["hits"]),
                ("cache misses", plan.per_host["misses"][h], cache.stats["misses"]),
                ("shard GETs at the server", plan.per_host["misses"][h], len(gets)),
                ("bytes fetched", plan.per_host["bytes_fetched"][h], cache.stats["bytes_fetched"]),
            ):
                rows.append([kind, name, int(planned), int(measured), "yes" if int(planned) == int(measured) else "NO"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=1, help="rows per host per step")
    ap.add_argument("--records", type=int, default=365_000_000)
    ap.add_argument("--shards", type=int, default=8192)
    ap.add_argument("--shard-bytes", type=int, default=256 << 20)
    ap.add_argument("--cache", type=int, default=64 << 30)
    ap.add_argument("--out", default=str(HERE / "results" / "plan.md"))
    args = ap.parse_args()
    begin()
    with tempfile.TemporaryDirectory() as d:
        scale = at_scale(args, Path(d))
        truth = against_a_run(Path(d))
    head1 = [
        "shuffle",
        "cache per host",
        "seconds",
        "file reads",
        "files/step p50",
        "no-refetch cache p50 / max",
        "fetched per host p50 / max",
        "job egress",
    ]
    head2 = ["pipeline", "figure (host 1 of 2)", "planned", "measured", "equal"]
    print(f"\nthe plan at {args.hosts:,} hosts x {args.steps:,} steps ({args.rows} row(s) per host per step):")
    print_table(head1, scale)
    print("\nthe plan against a run (http.server on 127.0.0.1, a disk cache of 3.5 shards, LRU):")
    print_table(head2, truth)
    lines = [
        "# quern plan: at scale, and against a run",
        "",
        f"`python benchmarks/plan.py` ({args.hosts:,} hosts x {args.steps:,} steps, {args.rows} row(s) per host "
        f"per step, {args.records:,} records in {args.shards:,} shards)",
        "",
        f"`{command_line()}`; {machine_line()}",
        "",
        markdown_header(head1),
        *[markdown_row(r) for r in scale],
        "",
        markdown_header(head2, left=(0, 1)),
        *[markdown_row(r) for r in truth],
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
