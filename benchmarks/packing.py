"""Packing: how full quern's packed rows are, how fast they come against grain's packers, the planner, and
the first batch at a step in a later epoch.

What is measured
----------------
**Fill** (document tokens / row slots, ``seq_len`` 2048) of quern's plan
(``quern.pipeline.order.packing.plan_epoch``, epoch 0, which is what the rows
hold) for ``best_fit`` and ``concat`` on

* **stdlib**: the ``.py`` files of the Python standard library on this
  machine (walked as ``examples/quickstart.py`` does: no ``test``/``tests``,
  ``site-packages``, ``__pycache__``), each file one document, its bytes the
  tokens (int32); empty files left out;
* **lognormal**: ``N = 10**5`` documents of ``clip(lognormal(5.5, 1.0), 1,
  16384)`` tokens (fixed NumPy seed).

``concat`` is full but for the epoch's last row, whose fill is printed too.

**Side by side with grain** (``grain.experimental.FirstFitPackIterDataset`` and
``BestFitPackIterDataset``, ``num_packing_bins`` 8 and 64, ``shuffle_bins``
on, ``MapDataset.source(records).to_iter_dataset(ReadOptions(num_threads=0))``:
reads in the calling thread, grain's faster setting on this machine; one
config also with grain's default ``ReadOptions``) and quern
(``Pipeline.from_source(records).pack(2048, mode, key="tokens",
lengths=...).batch(8)``, ``pipe.iterator()``, ``num_workers=0``), on the same
records, dicts ``{"tokens": int32 array}`` in memory: the stdlib files and the
first ``--sample`` (10**4) documents of the lognormal set, each cut into
pieces of at most 2048 tokens first (grain's packers refuse longer
sequences; it is the cut quern's ``best_fit`` makes itself, so its fill is
the same as on the uncut documents). Every config batches 8 rows.

* fill: one full pass over the records (quern: ``num_epochs=1``,
  ``drop_remainder=False``; grain: no repeat), counted on the rows delivered
  (non-zero ``segment_ids``); every token is checked to come out once;
* throughput: an endless stream (grain: ``MapDataset.repeat()``), a fresh
  iterator per run, 1 batch untimed, then at least ``--min-seconds`` (2 s);
  ``--runs`` (3) runs, configs in turn; the median of rows/s, and records/s =
  rows/s x (records / rows of the full pass: the records each row consumes on
  average; a record ``concat`` cuts across rows counts once). grain's packers
  are stateful iterators over the records in order (a window of
  ``num_packing_bins`` rows, all of an epoch's records go through it); quern's
  rows come from the step number (a plan of the whole epoch, made on the first
  step that needs it, the rows read and laid per step).

The lognormal side by side takes a sample because grain packs a few
thousand records/s here: a full pass over the 10**5 documents would take
20-40 s per grain config.

**Length bucketing** (section 5): the stdlib documents as ``{"tokens"}``
records, padded (or truncated) to 2048 in batches of 8 over one epoch, against
``.bucket([256, 512, 1024, 2048], [64, 32, 16, 8])`` over one block of 1,024
steps (the buckets' exact shares): the padding fraction (1 - real tokens /
token slots) of each, and the steps per shape.

**Planner**: ``plan_epoch`` on lognormal lengths at ``N = 10**6`` and
``10**7`` (``best_fit`` and ``concat``), seconds.

**First batch at step 0 vs a step in epoch 3**, ``N = 10**6`` lognormal
documents from an in-memory source that makes each record from its length
(``Docs`` below: tokens ``(arange(L) + i) % 32000``), ``.shuffle()``, ``pack
(2048, mode, cache_dir=tmp)``, ``batch(8)``. The length index is a **cached
scan**: scanned once here (timed, 1 process) into a temporary cache folder;
the measured processes find it there (load + verification). *Cold*: a fresh
Python process (quern and numpy imported before the clock) builds the source
and pipeline (timed: build), makes ``pipe.iterator(start_step=s)`` and takes
one batch (timed: first batch). Every epoch holds the same documents, so it
has the same number of rows, which locates a step's epoch: ``concat`` counts
them in closed form (``ceil(tokens / seq_len)``), ``best_fit`` by one
best-fit decreasing over the lengths (the count does not depend on their
order), kept in memory and on disk under ``cache_dir/packing/`` with a check;
then only the step's own epoch is planned (the last two plans are kept). So
``best_fit`` is timed twice: with that count cached (any earlier run wrote
it) and without (``cache_dir/packing/`` deleted before each process: the
first start ever). *Warm*: the same process, after that batch, a new
iterator at ``s + 1``; and, from the epoch-3 step, a new iterator at step 0
(epoch 0's plan is made again if it is not among the two kept). ``--runs``
cold processes per config, median. The count and the plan of one epoch are
also timed in this process (warm imports), for reference.

It prints figures and ratios only; no target is asserted.

Run: .venv/bin/python benchmarks/packing.py [--runs 3] [--min-seconds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import common
import numpy as np

import quern
from quern.pipeline.order.packing import plan_epoch

SEQ_LEN = 2048
BATCH = 8
VOCAB = common.VOCAB
MU, SIGMA, MAX_LEN = 5.5, 1.0, 16384
DATA_SEED = 20260112
FILL_N = 10**5
PLANNER_NS = (10**6, 10**7)
FIRST_N = 10**6
BINS = (8, 64)


# --------------------------------------------------------------------------- data


def lognormal_lengths(n: int, seed: int = DATA_SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(MU, SIGMA, n), 1, MAX_LEN).astype(np.int64)


def stdlib_docs() -> list[np.ndarray]:
    """The standard library's ``.py`` files (``common.stdlib_py_files``), bytes as int32 tokens."""
    docs = []
    for path in common.stdlib_py_files():
        with open(path, "rb") as f:
            data = f.read()
        if data:
            docs.append(np.frombuffer(data, np.uint8).astype(np.int32))
    return docs


def synthetic_docs(lengths: np.ndarray) -> list[np.ndarray]:
    return [(np.arange(n, dtype=np.int32) + i) % VOCAB for i, n in enumerate(lengths.tolist())]


def cut(docs: list[np.ndarray], seq_len: int = SEQ_LEN) -> list[dict[str, np.ndarray]]:
    """Each document cut into pieces of at most ``seq_len`` tokens, as ``{"tokens": piece}`` records."""
    return [{"tokens": d[a : a + seq_len]} for d in docs for a in range(0, len(d), seq_len)]


class Docs:
    """``n`` documents of lognormal lengths, record ``i`` made from its length on demand
    (tokens ``(arange(L) + i) % VOCAB``): a 10**6-document source without 1.6 GB of tokens."""

    def __init__(self, n: int, seed: int = DATA_SEED) -> None:
        self.n, self.seed = n, seed
        self.lengths = lognormal_lengths(n, seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return (np.arange(int(self.lengths[i]), dtype=np.int32) + i) % VOCAB

    def identity(self) -> dict:
        return {"kind": "lognormal", "mu": MU, "sigma": SIGMA, "max": MAX_LEN, "n": self.n, "seed": self.seed}


# --------------------------------------------------------------------------- 1. fill of the plan


def plan_fill(lengths: np.ndarray, mode: str) -> dict[str, Any]:
    lengths = np.asarray(lengths, dtype=np.int64)
    t0 = time.perf_counter()
    plan = plan_epoch(lengths, SEQ_LEN, mode, 0, 0)
    seconds = time.perf_counter() - t0
    tokens = int(lengths.sum())
    out = {
        "rows": plan.rows,
        "tokens": tokens,
        "fill": tokens / (plan.rows * SEQ_LEN),
        "seconds": seconds,
        "docs": int(np.count_nonzero(lengths)),
    }
    last = plan.length[plan.row_ptr[-2] : plan.row_ptr[-1]].sum()
    out["last_row_fill"] = int(last) / SEQ_LEN
    if mode == "concat":
        out["fill_without_last_row"] = (tokens - int(last)) / ((plan.rows - 1) * SEQ_LEN) if plan.rows > 1 else 1.0
    else:
        whole = int((lengths // SEQ_LEN).sum())
        out["full_piece_rows"] = whole
        out["fill_of_packed_rows"] = (tokens - whole * SEQ_LEN) / ((plan.rows - whole) * SEQ_LEN)
    return out


def fill_section(stdlib: list[np.ndarray], lognormal: np.ndarray) -> dict[str, Any]:
    print(f"\n1. fill of quern's plan (epoch 0), seq_len {SEQ_LEN}: document tokens / row slots")
    sets = {
        "stdlib": np.asarray([len(d) for d in stdlib], dtype=np.int64),
        f"lognormal N={len(lognormal):,}": lognormal,
    }
    out: dict[str, Any] = {}
    for name, lens in sets.items():
        print(
            f"  {name}: {len(lens):,} documents, {int(lens.sum()):,} tokens, mean {lens.mean():,.0f}, "
            f"median {np.median(lens):,.0f}, {np.mean(lens > SEQ_LEN):.1%} longer than {SEQ_LEN}"
        )
        out[name] = {}
        for mode in ("best_fit", "concat"):
            f = plan_fill(lens, mode)
            out[name][mode] = f
            if mode == "best_fit":
                extra = (
                    f"{f['full_piece_rows']:,} rows are full {SEQ_LEN}-token pieces of long documents; the other "
                    f"{f['rows'] - f['full_piece_rows']:,} (best-fit decreasing) are {f['fill_of_packed_rows']:.3%} "
                    f"full; >= 97%: {'yes' if f['fill'] >= 0.97 else 'NO'}"
                )
            else:
                extra = f"last row {f['last_row_fill']:.1%} full, the others {f['fill_without_last_row']:.4%}"
            print(
                f"    {mode:<9s} {f['rows']:>9,} rows, fill {f['fill']:.4%} ({extra}); planned in {f['seconds']:.3f} s"
            )
    return out


# --------------------------------------------------------------------------- 2. side by side with grain


def grain_dataset(records: list, packer: str, bins: int, repeat: bool, default_read: bool = False):
    import grain

    cls = getattr(grain.experimental, f"{packer}PackIterDataset")
    ds = grain.MapDataset.source(records)
    if repeat:
        ds = ds.repeat()
    it = ds.to_iter_dataset() if default_read else ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    it = cls(it, length_struct={"tokens": SEQ_LEN}, num_packing_bins=bins, seed=0)
    return it.batch(BATCH, drop_remainder=repeat)


def quern_pipeline(records: list, lengths: np.ndarray, mode: str, epochs: int | None, cache: str) -> quern.Pipeline:
    pipe = quern.Pipeline.from_source(records, seed=0, num_epochs=epochs)
    pipe = pipe.pack(SEQ_LEN, mode=mode, key="tokens", lengths=lengths, cache_dir=cache)
    return pipe.batch(BATCH, drop_remainder=epochs is None)


class Config:
    """One packer on one record set: a full pass (for the fill) and an endless iterator (for the rate)."""

    def __init__(self, name: str, seg_key: str, one_pass: Callable[[], Any], endless: Callable[[], Iterator]):
        self.name, self.seg_key, self.one_pass, self.endless = name, seg_key, one_pass, endless


def configs(records: list, lengths: np.ndarray, with_default_read: bool, cache: str) -> list[Config]:
    out = []
    for mode in ("best_fit", "concat"):
        out.append(
            Config(
                f"quern {mode}",
                "segment_ids",
                lambda m=mode: quern_pipeline(records, lengths, m, 1, cache).iterator(),
                lambda m=mode: quern_pipeline(records, lengths, m, None, cache).iterator(),
            )
        )
    for packer in ("FirstFit", "BestFit"):
        for bins in BINS:
            out.append(
                Config(
                    f"grain {packer} bins={bins}",
                    "tokens_segment_ids",
                    lambda p=packer, b=bins: iter(grain_dataset(records, p, b, False)),
                    lambda p=packer, b=bins: iter(grain_dataset(records, p, b, True)),
                )
            )
    if with_default_read:
        out.append(
            Config(
                DEFAULT_READ,
                "tokens_segment_ids",
                lambda: iter(grain_dataset(records, "FirstFit", 8, False, True)),
                lambda: iter(grain_dataset(records, "FirstFit", 8, True, True)),
            )
        )
    return out


DEFAULT_READ = "grain FirstFit bins=8, default ReadOptions"


def full_pass(cfg: Config, total_tokens: int, n_records: int) -> dict[str, Any]:
    """One pass over the records: rows, fill and the pieces per row, counted on the rows delivered."""
    rows = tokens = pieces = 0
    t0 = time.perf_counter()
    it = cfg.one_pass()
    for b in it:
        seg = np.asarray(b[cfg.seg_key])
        rows += seg.shape[0]
        tokens += int(np.count_nonzero(seg))
        pieces += int(seg.max(axis=1).sum())
    seconds = time.perf_counter() - t0
    common.close(it)
    assert tokens == total_tokens, (cfg.name, tokens, total_tokens)  # every token once
    return {
        "rows": rows,
        "fill": tokens / (rows * SEQ_LEN),
        "pieces_per_row": pieces / rows,
        "records_per_row": n_records / rows,
        "seconds": seconds,
    }


def timed_run(cfg: Config, min_seconds: float) -> dict[str, float]:
    it = cfg.endless()
    next(it)  # untimed: the iterator's start (quern: the plan of epoch 0)
    t0 = time.perf_counter()
    rows_per_s = common.rate(it.__next__, min_seconds, size=lambda b: np.asarray(b[cfg.seg_key]).shape[0])
    seconds = time.perf_counter() - t0
    common.close(it)
    return {"rows_per_s": rows_per_s, "seconds": seconds}


def side_by_side(name: str, docs: list[np.ndarray], args: argparse.Namespace, with_default_read: bool) -> dict:
    records = cut(docs)
    lengths = np.asarray([len(r["tokens"]) for r in records], dtype=np.int64)
    total = int(lengths.sum())
    print(
        f"\n  {name}: {len(docs):,} documents -> {len(records):,} records of <= {SEQ_LEN} tokens, {total:,} tokens; "
        f"quern's best_fit plan of these records: fill {plan_fill(lengths, 'best_fit')['fill']:.4%}, "
        f"of the uncut documents: {plan_fill(np.asarray([len(d) for d in docs]), 'best_fit')['fill']:.4%}"
    )
    with tempfile.TemporaryDirectory(prefix="quern-packing-bench-") as cache:  # quern's rows-per-epoch count
        cfgs = configs(records, lengths, with_default_read, cache)
        fills = {}
        for cfg in cfgs:
            if cfg.name != DEFAULT_READ:  # that one makes the same rows as the config with num_threads=0
                fills[cfg.name] = full_pass(cfg, total, len(records))
        fills[DEFAULT_READ] = fills["grain FirstFit bins=8"]
        timed = [(c.name, lambda c=c: timed_run(c, args.min_seconds)) for c in cfgs]
        runs = common.interleaved(timed, args.runs)
    med = {}
    for k, v in runs.items():
        rate = statistics.median(r["rows_per_s"] for r in v)
        med[k] = {"rows_per_s": rate, "records_per_s": rate * fills[k]["records_per_row"]}
    ref = med["quern best_fit"]
    rows = []
    for cfg in cfgs:
        f, m = fills[cfg.name], med[cfg.name]
        fill = (
            ["(same)", "", ""]
            if cfg.name == DEFAULT_READ
            else [f"{f['fill']:.3%}", f"{f['rows']:,}", f"{f['pieces_per_row']:.2f}"]
        )
        vs = [
            "-" if cfg.name == "quern best_fit" else common.ratio(ref[k], m[k]) for k in ("rows_per_s", "records_per_s")
        ]
        each = common.join_runs(r["rows_per_s"] for r in runs[cfg.name])
        rows.append([cfg.name, *fill, f"{m['rows_per_s']:,.0f}", f"{m['records_per_s']:,.0f}", *vs, each])
    header = ["config", "fill", "rows", "pcs/row", "rows/s", "records/s"]
    header += ["best_fit/this rows/s", "best_fit/this records/s", "rows/s of the runs"]
    common.print_table(header, rows, left=(0, 8), indent="    ")
    return {"records": len(records), "tokens": total, "fill": fills, "median": med, "runs": runs}


# --------------------------------------------------------------------------- 3. planner


def planner_section(ns: tuple[int, ...]) -> dict[str, Any]:
    print(f"\n3. planner: plan_epoch(lengths, {SEQ_LEN}, mode, seed 0, epoch 0) on lognormal lengths, one run each")
    out: dict[str, Any] = {}
    for n in ns:
        lens = lognormal_lengths(n, DATA_SEED + 1)
        for mode in ("best_fit", "concat"):
            f = plan_fill(lens, mode)
            out[f"{n} {mode}"] = {k: f[k] for k in ("seconds", "rows", "fill")}
            print(
                f"  N = {n:>10,}  {mode:<9s} {f['seconds']:7.2f} s  ({n / f['seconds']:>11,.0f} documents/s)  "
                f"{f['rows']:>9,} rows, fill {f['fill']:.4%}"
            )
        del lens
    return out


# --------------------------------------------------------------------------- 4. first batch across epochs


FIRST_CONFIGS = ("concat", "best_fit", "best_fit, count not cached")


def first_pipeline(config: str, cache_dir: str, workers: int | None = None) -> quern.Pipeline:
    mode = config.split(",")[0]
    pipe = quern.Pipeline.from_source(Docs(FIRST_N), seed=0).shuffle()
    return pipe.pack(SEQ_LEN, mode=mode, cache_dir=cache_dir, workers=workers).batch(BATCH)


def _first_batch(pipe: quern.Pipeline, step: int) -> float:
    t0 = time.perf_counter()
    it = pipe.iterator(start_step=step)
    b = next(it)
    dt = time.perf_counter() - t0
    it.close()
    assert b["tokens"].shape == (BATCH, SEQ_LEN)
    return dt


def child_first(config: str, step: int, cache_dir: str) -> dict[str, float]:
    """In a fresh process (quern and numpy imported): build, first batch at ``step``, then warm ones."""
    t0 = time.perf_counter()
    pipe = first_pipeline(config, cache_dir)
    out = {"build": time.perf_counter() - t0}
    out["first"] = _first_batch(pipe, step)
    out["warm_next"] = _first_batch(pipe, step + 1)
    if step:
        out["warm_step0"] = _first_batch(pipe, 0)
    out["total"] = out["build"] + out["first"]
    return out


def run_child(config: str, step: int, cache_dir: str) -> dict[str, float]:
    if "not cached" in config:  # the first start ever: no rows-per-epoch count on disk yet
        shutil.rmtree(os.path.join(cache_dir, "packing"), ignore_errors=True)
    t0 = time.perf_counter()
    out = common.run_child(__file__, [config, step, cache_dir])
    out["process"] = time.perf_counter() - t0
    return out


def first_batch_section(runs: int) -> dict[str, Any]:
    print(
        f"\n4. time to the first batch at step 0 vs a step in epoch 3: N = {FIRST_N:,} lognormal documents "
        f"(in-memory, each made from its length), .shuffle().pack({SEQ_LEN}, mode, cache_dir).batch({BATCH}); "
        f"the length index is a cached scan; cold: a fresh process, median of {runs}"
    )
    out: dict[str, Any] = {"n": FIRST_N, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="quern-packing-bench-") as cache:
        t0 = time.perf_counter()
        first_pipeline("best_fit", cache, workers=1)
        out["scan_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        first_pipeline("best_fit", cache)
        out["cached_build_seconds"] = time.perf_counter() - t0
        print(
            f"  length index: scanned once here, {out['scan_seconds']:.1f} s ({FIRST_N / out['scan_seconds']:,.0f} "
            f"records/s, 1 process), cached in a temporary folder; a build with it cached: "
            f"{out['cached_build_seconds'] * 1e3:,.0f} ms"
        )
        for config in FIRST_CONFIGS:
            shutil.rmtree(os.path.join(cache, "packing"), ignore_errors=True)
            p = first_pipeline(config, cache).stream
            assert p is not None
            t0 = time.perf_counter()
            per_epoch = p.rows_before(1)  # best_fit: counted and written to cache/packing/
            count_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            p.epoch(3)
            plan_seconds = time.perf_counter() - t0
            target = (p.rows_before(3) + p.rows_before(4)) // 2 // BATCH  # a step in the middle of epoch 3
            how = "closed form" if config == "concat" else "best-fit decreasing over the lengths"
            print(
                f"  {config}: {per_epoch:,} rows per epoch ({how}: {count_seconds * 1e3:,.0f} ms), the plan of one "
                f"epoch {plan_seconds * 1e3:,.0f} ms (both measured here, warm imports); step in epoch 3: {target:,}"
            )
            res: dict[str, list[dict[str, float]]] = {}
            for step in (0, target):
                res[str(step)] = [run_child(config, step, cache) for _ in range(runs)]
            out[config] = {
                "rows_per_epoch": per_epoch,
                "count_seconds": count_seconds,
                "plan_seconds": plan_seconds,
                "target_step": target,
                "runs": res,
            }
            for step in (0, target):
                rr = res[str(step)]

                def med(k: str, rr: list[dict[str, float]] = rr) -> float:
                    return statistics.median(r[k] for r in rr)

                firsts = ", ".join(f"{r['first'] * 1e3:,.0f}" for r in rr)
                where = "step 0" if step == 0 else f"step {step:,} (epoch 3)"
                warm = f"warm: next step {med('warm_next') * 1e3:,.0f} ms"
                if step:
                    warm += f", back to step 0 {med('warm_step0') * 1e3:,.0f} ms"
                print(
                    f"    {where:<22s} cold: build {med('build') * 1e3:5,.0f} ms + first batch {med('first') * 1e3:5,.0f}"
                    f" ms = {med('total') * 1e3:5,.0f} ms (runs of the first batch: {firsts} ms; whole process "
                    f"{med('process'):.1f} s); {warm}"
                )
            c0 = statistics.median(r["first"] for r in res["0"])
            c3 = statistics.median(r["first"] for r in res[str(target)])
            out[config]["epoch3_over_step0_cold"] = c3 / c0
            print(f"    cold first batch, epoch 3 / step 0: {c3 / c0:.2f}x")
    print(
        "  how a step in a later epoch is found: every epoch holds the same documents, so it has the same number "
        "of rows: concat in closed form (ceil(tokens / seq_len)); best_fit by one best-fit decreasing over the "
        "lengths (its row count does not depend on their order), kept in memory and on disk (cache_dir/packing/, "
        "with a check); a cold start in any epoch then plans only its own epoch (the last two plans are kept)"
    )
    return out


# --------------------------------------------------------------------------- main


BUCKETS = (256, 512, 1024, 2048)
BUCKET_ROWS = (64, 32, 16, 8)  # the same tokens per batch in every bucket


def bucketing_section(stdlib: list[np.ndarray], cache_dir: str) -> dict[str, Any]:
    """Padding with length bucketing vs one padded length, on the stdlib corpus: one
    epoch's worth of steps of each, through the real pipelines (``length`` per row)."""
    print(
        f"\n5. length bucketing on the stdlib corpus ({len(stdlib)} documents): padding = 1 - real tokens / "
        f"token slots, over one epoch (one padded length) or one block of 1,024 steps (buckets, about 12 epochs); records longer than {BUCKETS[-1]} are truncated to it "
        "in both"
    )
    records = [{"tokens": d} for d in stdlib]
    base = quern.Pipeline.from_source(records, seed=0).shuffle()
    out: dict[str, Any] = {}
    unb = base.map(quern.transforms.pad(BUCKETS[-1], key="tokens")).batch(BATCH)
    real = slots = 0
    steps = -(-len(stdlib) // BATCH)
    for s in range(steps):
        b = unb.batch_at(s)
        real += int(b["length"].sum())
        slots += b["tokens"].size
    out["unbucketed"] = 1 - real / slots
    print(f"  one length ({BUCKETS[-1]}), batch {BATCH}: padding {out['unbucketed']:.1%}")
    buck = base.bucket(BUCKETS, BUCKET_ROWS, key="tokens", cache_dir=cache_dir)
    real = slots = 0
    shapes: dict[tuple, int] = {}
    s = buck.stream.block  # one block of steps: the buckets' shares exactly
    for b in (buck.batch_at(k) for k in range(s)):
        real += int(b["length"].sum())
        slots += b["tokens"].size
        shapes[b["tokens"].shape] = shapes.get(b["tokens"].shape, 0) + 1
    out["bucketed"] = 1 - real / slots
    out["shapes"] = {str(k): v for k, v in shapes.items()}
    print(
        f"  buckets {list(BUCKETS)} with {list(BUCKET_ROWS)} rows: padding {out['bucketed']:.1%} over {s} steps; "
        f"shapes (rows, length): {', '.join(f'{k}: {v} steps' for k, v in sorted(shapes.items()))}"
    )
    share = np.bincount(
        np.minimum(np.searchsorted(BUCKETS, [len(d) for d in stdlib], side="left"), len(BUCKETS) - 1),
        minlength=len(BUCKETS),
    )
    print(f"  documents per bucket: {dict(zip(BUCKETS, share.tolist()))}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="timed runs / cold processes per config (default 3)")
    ap.add_argument("--min-seconds", type=float, default=2.0, help="at least this long per timed run (default 2)")
    ap.add_argument("--sample", type=int, default=10**4, help="lognormal documents in the side by side (10**4)")
    ap.add_argument("--skip", default="", help="sections to skip, comma-separated: fill,grain,planner,first,bucketing")
    args = common.parse_args(ap, child=child_first)
    if args is None:
        return

    grain_version = importlib.metadata.version("grain")
    t_start = common.begin(grain=grain_version)
    skip = set(filter(None, args.skip.split(",")))
    figures: dict[str, Any] = {
        "grain": grain_version,
        "quern": quern.__version__,
        "cpus": os.cpu_count(),
        "seq_len": SEQ_LEN,
        "batch": BATCH,
    }
    stdlib = stdlib_docs()
    lognormal = lognormal_lengths(FILL_N)
    if "fill" not in skip:
        figures["fill"] = fill_section(stdlib, lognormal)

    if "grain" not in skip:
        print(
            f"\n2. side by side with grain's packers, the same records (documents cut to <= {SEQ_LEN} tokens), "
            f"{BATCH} rows per batch, one process each (quern num_workers=0; grain ReadOptions(num_threads=0)). "
            f"fill: one full pass; rates: {args.runs} runs of >= {args.min_seconds:g} s on an endless stream, "
            "configs in turn, median; records/s = rows/s x records per row of the full pass; pcs/row: pieces "
            "(segments) per row"
        )
        sample = synthetic_docs(lognormal[: args.sample])
        figures["side_by_side"] = {
            "stdlib": side_by_side("stdlib", stdlib, args, False),
            f"lognormal first {args.sample}": side_by_side(
                f"lognormal, first {args.sample:,} of the N={FILL_N:,} documents", sample, args, True
            ),
        }

    if "planner" not in skip:
        figures["planner"] = planner_section(PLANNER_NS)

    if "first" not in skip:
        figures["first_batch"] = first_batch_section(args.runs)

    if "bucketing" not in skip:
        with tempfile.TemporaryDirectory(prefix="quern-bench-bucket-") as tmp:
            figures["bucketing"] = bucketing_section(stdlib, tmp)

    figures["total_seconds"] = time.perf_counter() - t_start
    print(f"\ntotal time {figures['total_seconds']:.0f} s")
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
