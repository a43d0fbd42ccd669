"""``quern prepare``: how fast 100k small files become shards (1 and 2 worker processes, Ray), and what the shards
gain on the read side.

What is measured
----------------
**Input** (made by the script once, kept under ``benchmarks/data/prepare-input/``, with
``prepare-input.json`` beside it saying what it holds): ``--files`` (100,000) small files, the ``.py`` files
of the Python standard library on this machine (walked as ``benchmarks/packing.py`` walks them: no
``test``/``tests``, ``site-packages``, ``__pycache__``) copied again and again into ``copy-000/``,
``copy-001/``, ... (the last copy partial) until there are ``--files``; files of 64 KiB and more are left
out when all of them would make more than 1.5 GB. Each file is one record (its bytes, no map); record ``i``
of the shards is file ``i`` of the input in the documented order (relative paths sorted).

**Prepare**: ``quern.prepare.prepare(input, --out, num_workers=W, shard_size="128MB", progress=False)``, each
run into a fresh, empty output folder (removed before the run): ``workers=0`` (in this process, for
reference), ``workers=1`` and ``workers=2`` (spawned processes: the time includes starting them), and
``ray=True, workers=2`` (Ray tasks on a new local Ray cluster of 2 CPUs: ``ray.init`` is called here
before ``prepare`` and timed apart, as is ``ray.shutdown`` after it; the prepare includes Ray starting its
worker processes). One run each: wall seconds of the ``prepare`` call, records/s, input MiB/s (the input
files' bytes), the ratio to ``workers=1`` and the CPU seconds (user + system) of this process and its
worker processes (not known for Ray, whose workers are not its children). The input files are in the page cache (read once before the
first run: that pass is printed as the plain sequential read), so the figures are CPU and syscalls, not
the disk. The outputs are compared: ``manifest.json``'s bytes and the SHA-256 of every file the folder
holds (shards and metadata, computed from the files; each shard's also checked against its manifest).

**Read side**: one shuffled pass, the same permutation (``np.random.default_rng(0).permutation``) over
(a) the small files: ``open`` + ``read`` of each file in permuted order, and (b) the shards of the last
prepare: ``quern.sources.ArrayRecordSource(out).read_many(ids)`` with 256 permuted ids per call (the source
opened outside the clock), and (c) the same records prepared again with ``compression="uncompressed"``
(decoding is most of a shard record's cost); records/s side by side, the ratios, and the bytes read (which
must agree). The
same in record order is printed for reference. A sample of 1,000 records is then checked against its
files. Page cache warm on both sides: this is the cost per record of the reads (a file: open, fstat, read,
close; a shard record: a random-access read of one chunk and its decompression), not the IOPS a cold
disk or a network file system would add on top for the small files. Where this process may drop the page
cache (root), the shuffled pass is run once more cold: the cache dropped before each of the three reads,
so every file and every shard block comes from the disk.

It prints figures and ratios only; no target is asserted.

Run: .venv/bin/python benchmarks/prepare.py [--files 100000] [--out DIR] [--skip-ray]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sysconfig
import time
from typing import Any

import common
import numpy as np

import quern
from quern.prepare import prepare

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
INPUT = os.path.join(DATA, "prepare-input")
MAX_TOTAL = 1_500_000_000  # input bytes above which files of SMALL bytes and more are left out
SMALL = 64 << 10
SHARD_SIZE = "128MB"
READ_BATCH = 256
SEED = 0
MiB = 1 << 20


# --------------------------------------------------------------------------- input


def stdlib_files() -> list[tuple[str, int]]:
    """``(relative path, size)`` of the standard library's ``.py`` files (``common.stdlib_py_files``)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return [(os.path.relpath(full, stdlib), os.path.getsize(full)) for full in common.stdlib_py_files()]


def build_input(n_files: int) -> dict[str, Any]:
    """The input folder of ``n_files`` files (made unless ``prepare-input.json`` says it holds them); its description."""
    marker = INPUT + ".json"
    desc = common.read_marker(marker, {"files": n_files}, INPUT)
    if desc is not None:
        desc["built_seconds"] = None
        return desc
    t0 = time.perf_counter()
    stdlib = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    whole = sum(s for _, s in files)
    limit = None
    if whole * n_files / len(files) > MAX_TOTAL:
        limit = SMALL
        files = [(p, s) for p, s in files if s < SMALL]
    copies = -(-n_files // len(files))
    for path in (INPUT, INPUT + ".tmp", marker):
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    tmp = INPUT + ".tmp"
    count = total = 0
    for c in range(copies):
        for rel, size in files:
            if count == n_files:
                break
            dst = os.path.join(tmp, f"copy-{c:03d}", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(os.path.join(stdlib, rel), dst)
            count += 1
            total += size
    os.replace(tmp, INPUT)
    desc = {
        "files": count,
        "bytes": total,
        "stdlib_files": len(files),
        "copies": copies,
        "size_limit": limit,
        "stdlib": stdlib,
    }
    with open(marker, "w") as f:
        json.dump(desc, f, indent=1)
    desc["built_seconds"] = time.perf_counter() - t0
    return desc


def input_paths(root: str) -> list[str]:
    """The input files in prepare's record order (relative POSIX paths, sorted as strings)."""
    rels = []
    for d, _, names in os.walk(root):
        rels += [os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/") for n in names]
    return [os.path.join(root, r) for r in sorted(rels)]


# --------------------------------------------------------------------------- prepare runs


def tree_digest(folder: str) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            full = os.path.join(d, n)
            h = hashlib.sha256()
            with open(full, "rb") as f:
                while block := f.read(8 << 20):
                    h.update(block)
            out[os.path.relpath(full, folder).replace(os.sep, "/")] = h.hexdigest()
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (the pool's workers)."""
    return sum(
        u.ru_utime + u.ru_stime
        for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def one_prepare(label: str, out: str, workers: int, use_ray: bool) -> dict[str, Any]:
    if os.path.exists(out):
        shutil.rmtree(out)
    r: dict[str, Any] = {"label": label, "workers": workers, "ray": use_ray}
    if use_ray:
        import ray

        t0 = time.perf_counter()
        ray.init(
            address="local",
            num_cpus=workers,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=128 << 20,
        )
        r["ray_init"] = time.perf_counter() - t0
    try:
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        manifest = prepare(INPUT, out, num_workers=workers, ray=use_ray, shard_size=SHARD_SIZE, progress=False)
        r["seconds"] = time.perf_counter() - t0
        r["cpu"] = None if use_ray else cpu_seconds() - cpu0  # Ray's workers are not this process's children
    finally:
        if use_ray:
            t0 = time.perf_counter()
            ray.shutdown()
            r["ray_shutdown"] = time.perf_counter() - t0
    r["records"] = manifest["records"]["count"]
    r["shards"] = len(manifest["shards"])
    r["shard_bytes"] = sum(s["bytes"] for s in manifest["shards"])
    with open(os.path.join(out, "manifest.json"), "rb") as f:
        r["manifest_sha256"] = hashlib.sha256(f.read()).hexdigest()
    r["files"] = tree_digest(out)
    r["shards_match_manifest"] = all(r["files"].get(s["file"]) == s["sha256"] for s in manifest["shards"])
    return r


# --------------------------------------------------------------------------- read side


def can_drop_caches() -> bool:
    """Whether this process may drop the page cache (root, with a writable /proc/sys/vm/drop_caches)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """Write back and drop the page cache, so the next reads come from the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_files(paths: list[str], order: np.ndarray, cold: bool = False) -> tuple[float, int]:
    if cold:
        drop_caches()
    nbytes = 0
    t0 = time.perf_counter()
    for i in order.tolist():
        with open(paths[i], "rb") as f:
            nbytes += len(f.read())
    return time.perf_counter() - t0, nbytes


def read_shards(src: Any, order: np.ndarray, cold: bool = False) -> tuple[float, int]:
    if cold:
        drop_caches()
    nbytes = 0
    t0 = time.perf_counter()
    for a in range(0, len(order), READ_BATCH):
        nbytes += sum(len(r) for r in src.read_many(order[a : a + READ_BATCH]))
    return time.perf_counter() - t0, nbytes


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=100_000, help="small files in the input (default 100,000)")
    ap.add_argument(
        "--out",
        default=os.path.join(DATA, "prepare-out"),
        help="the output folder of the prepares (removed before each run and at the end; default "
        "benchmarks/data/prepare-out)",
    )
    ap.add_argument("--skip-ray", action="store_true", help="leave out the prepare on Ray")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    t_start = time.perf_counter()
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = "not installed"
    common.begin(ray=ray_version)

    desc = build_input(args.files)
    built = "" if desc["built_seconds"] is None else f", built in {desc['built_seconds']:.0f} s"
    limit = f", files < {desc['size_limit'] // 1024} KiB only" if desc["size_limit"] else ""
    print(
        f"\ninput: {INPUT}: {desc['files']:,} files, {desc['bytes']:,} bytes ({desc['bytes'] / MiB:,.0f} MiB, mean "
        f"{desc['bytes'] / desc['files'] / 1024:.1f} KiB), {desc['stdlib_files']:,} .py files of {desc['stdlib']} "
        f"copied {desc['copies']} times{limit}{built}"
    )
    paths = input_paths(INPUT)
    n = len(paths)
    seconds, in_bytes = read_files(paths, np.arange(n))
    print(
        f"page cache: every input file read once in order ({seconds:.1f} s, {n / seconds:,.0f} files/s, "
        f"{in_bytes / MiB / seconds:,.0f} MiB/s); the input is in the page cache for what follows"
    )

    # ----------------------------------------------------------------- 1. prepare
    runs = [("workers=0 (in-process)", 0, False), ("workers=1", 1, False), ("workers=2", 2, False)]
    if not args.skip_ray:
        runs.append(("ray=True, 2 CPUs", 2, True))
    print(
        f"\n1. prepare({os.path.relpath(INPUT)}, {os.path.relpath(out)}, num_workers=W, shard_size={SHARD_SIZE!r}): "
        f"one run each into a fresh folder, input in the page cache, no map"
    )
    results = []
    for label, workers, use_ray in runs:
        results.append(one_prepare(label, out, workers, use_ray))
    base = next(r for r in results if r["label"] == "workers=1")
    common.print_table(
        ["run", "seconds", "records/s", "in MiB/s", "vs 1 worker", "CPU s", "shards, output"],
        [
            [
                r["label"],
                f"{r['seconds']:.1f}",
                f"{r['records'] / r['seconds']:,.0f}",
                f"{in_bytes / MiB / r['seconds']:.1f}",
                common.ratio(base["seconds"], r["seconds"]),
                "-" if r["cpu"] is None else f"{r['cpu']:.1f}",
                f"{r['shards']} shards, {r['shard_bytes'] / MiB:,.0f} MiB ({r['shard_bytes'] / in_bytes:.2f} of the input)",
            ]
            for r in results
        ],
        left=(0, 6),
        indent="  ",
    )
    for r in results:
        if r["ray"]:
            total = r["ray_init"] + r["seconds"] + r["ray_shutdown"]
            print(
                f"  Ray cluster: ray.init {r['ray_init']:.1f} s and ray.shutdown {r['ray_shutdown']:.1f} s, outside the "
                f"figures above; with them: {total:.1f} s, {r['records'] / total:,.0f} records/s, "
                f"{base['seconds'] / total:.2f}x workers=1"
            )
    first = results[0]
    same_manifest = all(r["manifest_sha256"] == first["manifest_sha256"] for r in results)
    same_files = all(r["files"] == first["files"] for r in results)
    all_records = all(r["records"] == n for r in results)
    print(
        f"  outputs: manifest.json byte-identical in all {len(results)} runs: {'yes' if same_manifest else 'NO'}; "
        f"every file (of {len(first['files'])}: shards, metadata, manifest) identical by SHA-256: "
        f"{'yes' if same_files else 'NO'}; shard checksums match the manifest: "
        f"{'yes' if all(r['shards_match_manifest'] for r in results) else 'NO'}; "
        f"records = input files ({n:,}): {'yes' if all_records else 'NO'}"
    )
    if not same_files:
        for r in results[1:]:
            diff = sorted(
                k for k in set(r["files"]) | set(first["files"]) if r["files"].get(k) != first["files"].get(k)
            )
            if diff:
                print(f"    {r['label']} differs from {first['label']} in: {diff}")

    # ----------------------------------------------------------------- 2. read side
    print(
        f"\n2. read side: one pass over the {n:,} records, page cache warm; files: open + read each; "
        f"shards: ArrayRecordSource(out).read_many({READ_BATCH} ids per call)"
    )
    src = quern.sources.ArrayRecordSource(out)
    raw_out = out + "-uncompressed"  # the same records without compression: what the read costs without decoding
    if os.path.exists(raw_out):
        shutil.rmtree(raw_out)
    t0 = time.perf_counter()
    prepare(INPUT, raw_out, num_workers=0, shard_size=SHARD_SIZE, compression="uncompressed", progress=False)
    raw_seconds = time.perf_counter() - t0
    raw = quern.sources.ArrayRecordSource(raw_out)
    perm = np.random.default_rng(SEED).permutation(n)
    rows = []
    passes = [("shuffled", perm, False), ("in order", np.arange(n), False)]
    if can_drop_caches():
        passes.append(("shuf. cold", perm, True))
    for order_name, order, cold in passes:
        fs, fb = read_files(paths, order, cold)
        ss, sb = read_shards(src, order, cold)
        us, ub = read_shards(raw, order, cold)
        rows.append((order_name, fs, fb, ss, sb, us, ub))
    comp = src.manifest["options"]["writer_options"].rsplit(",", 1)[-1] if src.manifest else "?"
    print(
        f"  shards: {comp} (the default) and uncompressed (prepared with workers=0 in {raw_seconds:.1f} s, "
        f"{n / raw_seconds:,.0f} records/s, {sum(s['bytes'] for s in raw.manifest['shards']) / MiB:,.0f} MiB)"
        if raw.manifest
        else ""
    )
    cells = []
    for order_name, fs, fb, ss, sb, us, ub in rows:
        agree = "bytes agree" if fb == sb == ub == in_bytes else f"BYTES DIFFER: {fb:,}, {sb:,}, {ub:,}"
        speeds = [f"{n / fs:,.0f}", f"{n / ss:,.0f}", common.ratio(fs, ss), f"{n / us:,.0f}", common.ratio(fs, us)]
        cells.append([order_name, *speeds, f"{fb:,} bytes ({agree})"])
    header = ["pass", "files rec/s", comp + " rec/s", "/files", "uncompr. rec/s", "/files", "bytes"]
    common.print_table(header, cells, left=(0, 6), indent="  ")
    if not can_drop_caches():
        print("  (no cold pass: dropping the page cache needs root, /proc/sys/vm/drop_caches)")
    else:
        print("  shuf. cold: the page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each of the three")
    del raw
    shutil.rmtree(raw_out)
    sample = np.sort(np.random.default_rng(SEED + 1).choice(n, size=min(1000, n), replace=False))
    records = src.read_many(sample)
    wrong = 0
    for i, rec in zip(sample.tolist(), records):
        with open(paths[i], "rb") as f:
            wrong += f.read() != rec
    print(f"  {len(sample):,} sampled records equal to their files: {'yes' if wrong == 0 else f'NO ({wrong} differ)'}")

    shutil.rmtree(out, ignore_errors=True)
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s (the input stays in {INPUT}; {out} removed)")


if __name__ == "__main__":
    main()
