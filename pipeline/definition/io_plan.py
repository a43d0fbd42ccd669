"""``quern plan``: what every host of a job will read, from the definition and the files' sizes alone.

A step's rows, their records and the files those lie in are pure index
arithmetic over the definition and the sources' manifests or file metadata, so
the whole read trace of a job (any host count, any steps) is known before it
runs, without reading a record. :func:`plan_io` computes it, vectorised over
blocks of steps, and sums it up per host: records, bytes and distinct files
read per step and per epoch; file reads (each bulk read of a file in a chunk of
steps, which opens it); the working set over the iterator's lookahead window;
the smallest disk cache under which no file is fetched twice in an epoch; and,
for a given cache, the hits, misses and bytes fetched that
:class:`~quern.pipeline.remote.cache.ShardCache` will count (the replay of its
rules: :mod:`quern.pipeline.remote.cache_model`). Percentiles over hosts show
skew, and the host furthest from the median is named.

The trace follows the iterator's threads exactly: steps are read in chunks
(1, 2, 4, ... steps, then ``read_ahead``), each chunk one bulk ``read_many`` per
source read, which reads each of its files once, files in ascending order. An
iterator given the same ``read_ahead``, ``lookahead=0`` (an LRU cache) and one
thread, with an empty cache folder of its own and ending where the plan ends,
counts exactly the planned hits, misses and bytes; the guide
(``docs/guides/plan.md``) says what differs otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..core.batching import need_batch
from ..execute.stages import steps_per_read
from ..iterate.threads import THREAD_READ_RECORDS, THREAD_READ_STEPS
from ..order.index import check_int, host_rows
from ..remote import cache_model
from ..remote.lookahead import LOOKAHEAD
from ..streams.forwarding import ForwardingStream
from ..streams.protocol import Stream
from ..streams.source import SourceStream

if TYPE_CHECKING:
    from ..sources.base import Source
    from .dataset import Pipeline

__all__ = ["BLOCK_ROWS", "FIGURES", "LABELS", "IOPlan", "chunk_starts", "plan_io"]

BLOCK_ROWS = 1 << 21  # rows planned at once (memory: about 100 bytes a row)
LABELS = {  # the per-host figures' names in the report
    "records": "records",
    "bytes": "bytes of the records",
    "files_per_step": "files per step",
    "files_per_epoch": "files per epoch",
    "file_reads": "file reads (opens)",
    "working_set": "working set (lookahead)",
    "no_refetch_cache": "cache with no refetch",
    "hits": "cache hits",
    "misses": "cache misses",
    "bytes_fetched": "bytes fetched",
}
FIGURES = {  # the per-host figures of a plan, and what each one is
    "records": "records read",
    "bytes": "bytes of those records (from their files' sizes)",
    "files_per_step": "distinct files read per step (mean)",
    "files_per_epoch": "distinct files read per epoch (mean over the epochs the steps reach, partly or whole)",
    "file_reads": "reads of a file in one bulk call (each opens it)",
    "working_set": "most bytes of distinct files read by the chunks that start in one window of lookahead steps "
    "(fixed windows from the first step)",
    "no_refetch_cache": "the smallest disk cache with no file fetched twice in an epoch (Belady's rule)",
    "hits": "reads of a file the disk cache held",
    "misses": "reads that fetched their file",
    "bytes_fetched": "bytes fetched from the server",
}


@dataclasses.dataclass(frozen=True)
class _Files:
    """The files of one source: record ``i`` lies in file ``searchsorted(starts, i, "right") - 1``."""

    source: Source
    starts: np.ndarray  # int64, files + 1
    sizes: np.ndarray | None  # bytes per file, or None: not known
    remote: bool  # fetched whole into the disk cache when first read
    note: str | None  # what the plan cannot see of this source


def _files_of(src: Source) -> _Files:
    """The file layout of ``src``, from its manifest or its files' metadata (nothing is read)."""
    starts = getattr(src, "starts", None)
    name = getattr(src, "name", type(src).__name__)
    if starts is None:
        if hasattr(src, "file_rows"):  # Parquet
            starts = np.concatenate([[0], np.cumsum(src.file_rows)])
        else:
            n = len(src)
            why = f"source {name!r} ({type(src).__name__}) has no files: planned in records only (no bytes)"
            return _Files(src, np.asarray([0, n], dtype=np.int64), None, False, why)
    starts = np.asarray(starts, dtype=np.int64)
    manifest = getattr(src, "manifest", None)
    urls = getattr(src, "urls", None)
    sizes: Any = getattr(src, "sizes", None)
    if manifest is not None and len(manifest.get("shards", ())) == len(starts) - 1:
        sizes = [s["bytes"] for s in manifest["shards"]]
    elif sizes is None:
        sizes = [os.path.getsize(p) for p in getattr(src, "paths", ())]
    if len(sizes) != len(starts) - 1:
        why = f"source {name!r}: its file sizes are not known: planned in records only (no bytes)"
        return _Files(src, starts, None, False, why)
    remote = urls is not None and bool(getattr(src, "fetches_ahead", False))
    note = None
    if urls is not None and not remote:
        note = (
            f"source {name!r}: its files are fetched whole when it opens, on every host (not planned through the cache)"
        )
    return _Files(src, starts, np.asarray(sizes, dtype=np.int64), remote, note)


def _contiguous(stream: Stream) -> bool:
    """Whether host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)`` of every step (computed without a call per host)."""
    while isinstance(stream, ForwardingStream) and type(stream).positions is ForwardingStream.positions:
        stream = stream.parent
    method = type(stream).positions
    if method is Stream.positions:
        return True
    return isinstance(stream, SourceStream) and method is SourceStream.positions and stream.host_lengths is None


def chunk_starts(start: int, stop: int, read_ahead: int) -> np.ndarray:
    """The first step of each chunk the iterator's threads compute: 1, 2, 4, ... steps, then ``read_ahead``.

    Args:
        start: the first step.
        stop: the step after the last.
        read_ahead: the most steps in a chunk.

    Returns:
        An int64 array of first steps, ``start`` first.

    Example:
        >>> chunk_starts(10, 30, 4).tolist()
        [10, 11, 13, 17, 21, 25, 29]
    """
    out, at, size = [], start, 1
    while at < stop:
        out.append(at)
        at += min(size, read_ahead)
        size = min(read_ahead, size * 2)
        if size == read_ahead:
            rest = np.arange(at, stop, read_ahead, dtype=np.int64)
            return np.concatenate([np.asarray(out, dtype=np.int64), rest])
    return np.asarray(out, dtype=np.int64)


def _rows(
    pipe: Pipeline, steps: np.ndarray, hosts: int, contiguous: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every host's stream positions of ``steps``: ``(positions, step, host, probe)`` per row.

    A host with no row in a step (the partial last batch) reads the step's row 0 for its empty batch's
    structure, as the step runner does: that row is in, marked ``probe`` (not one of the host's records).
    """
    b = need_batch(pipe, "plan")
    if contiguous:
        total = pipe.stream.length()
        pos = (steps[:, None] * b + np.arange(b)[None, :]).ravel()
        step = np.repeat(steps, b)
        host = np.tile(np.arange(b) // (b // hosts), len(steps))
        if total is not None:
            keep = pos < total
            pos, step, host = pos[keep], step[keep], host[keep]
    else:
        parts = [(pipe.positions(int(s), h, hosts), int(s), h) for s in steps for h in range(hosts)]
        pos = np.concatenate([p for p, _, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        step = np.concatenate([np.full(len(p), s) for p, s, _ in parts]) if parts else pos
        host = np.concatenate([np.full(len(p), h) for p, _, h in parts]) if parts else pos
    pos, step, host = (np.asarray(x, dtype=np.int64) for x in (pos, step, host))
    seen = np.zeros((len(steps), hosts), dtype=bool)
    seen[step - steps[0], host] = True
    s_empty, h_empty = np.nonzero(~seen)
    if not len(s_empty):
        return pos, step, host, np.zeros(len(pos), dtype=bool)
    s_empty = steps[s_empty]
    probe = np.concatenate([np.zeros(len(pos), dtype=bool), np.ones(len(s_empty), dtype=bool)])
    return np.concatenate([pos, s_empty * b]), np.concatenate([step, s_empty]), np.concatenate([host, h_empty]), probe


@dataclasses.dataclass(frozen=True)
class IOPlan:
    """The read plan of a job (see the module docstring); made by :func:`plan_io`.

    Attributes:
        hosts: the host count planned.
        steps: the steps planned.
        read_ahead: steps per chunk (one bulk read per source).
        lookahead: the working set's window, in steps.
        epoch_steps: steps per epoch (``None``: the pipeline has no epochs of its own; the
            planned steps count as one).
        cache_bytes: the disk cache replayed, or ``None``.
        policy: its eviction rule.
        per_host: each figure of :data:`FIGURES` planned, one value per host (bytes
            figures absent where no source has sizes; cache figures absent without a
            cache or a remote source).
        egress_per_epoch: bytes fetched by all hosts in each epoch the steps reach, from
            :attr:`first_epoch` on: with the cache given, its misses; without, each file
            once per epoch a host reads it in.
        first_epoch: the epoch of the first planned step.
        file_count: the files of the sources read.
        limits: what the plan cannot see, in sentences.
        seconds: how long planning took.
        trace: ``(bounds, files)``: the reads the cache sees, host-major (host ``h``'s are
            ``files[bounds[h]:bounds[h + 1]]``, in the order it reads them; files numbered
            across the sources, in :attr:`file_names` order).
        file_names: each file's path or URL.
        file_sizes: each file's bytes (0: not known).
    """

    hosts: int
    steps: range
    read_ahead: int
    lookahead: int
    epoch_steps: int | None
    cache_bytes: int | None
    policy: str
    per_host: dict[str, np.ndarray]
    egress_per_epoch: np.ndarray
    first_epoch: int
    file_count: int
    limits: tuple[str, ...]
    seconds: float
    trace: tuple[np.ndarray, np.ndarray] = dataclasses.field(repr=False, compare=False)
    file_names: tuple[str, ...] = dataclasses.field(repr=False, compare=False)
    file_sizes: np.ndarray = dataclasses.field(repr=False, compare=False)

    def spread(self, name: str) -> dict[str, float]:
        """The figure ``name`` over hosts: ``p50``, ``p99``, ``max``, ``mean`` and ``host_max`` (the host of the max)."""
        v = self.per_host[name].astype(np.float64)
        return {
            "p50": float(np.percentile(v, 50)),
            "p99": float(np.percentile(v, 99)),
            "max": float(v.max()),
            "mean": float(v.mean()),
            "host_max": int(np.argmax(v)),
        }

    def outlier(self, name: str | None = None, ratio: float = 1.25) -> tuple[int, str, float] | None:
        """The host furthest from the median of a figure, if more than ``ratio`` times off it.

        Args:
            name: the figure (default: ``bytes_fetched`` when planned, else ``bytes``, else ``records``).
            ratio: how far from the median (either way) counts.

        Returns:
            ``(host, figure, value / median)``, or ``None``.
        """
        name = name or next(n for n in ("bytes_fetched", "bytes", "records") if n in self.per_host)
        v = self.per_host[name].astype(np.float64)
        med = float(np.median(v))
        if med <= 0 or len(v) < 2:
            return None
        off = np.abs(np.log(np.maximum(v, 1e-9) / med))
        h = int(np.argmax(off))
        r = float(v[h] / med)
        return (h, name, r) if r > ratio or r < 1 / ratio else None

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain values (``quern plan --json``): settings, each figure's spread, egress, limits."""
        return {
            "hosts": self.hosts,
            "steps": [self.steps.start, self.steps.stop],
            "read_ahead": self.read_ahead,
            "lookahead": self.lookahead,
            "epoch_steps": self.epoch_steps,
            "cache_bytes": self.cache_bytes,
            "policy": self.policy,
            "files": self.file_count,
            "figures": {n: self.spread(n) for n in self.per_host},
            "egress_per_epoch": self.egress_per_epoch.tolist(),
            "first_epoch": self.first_epoch,
            "outlier": self.outlier(),
            "limits": list(self.limits),
            "seconds": self.seconds,
        }

    def text(self) -> str:
        """The plan as the report ``quern plan`` prints."""
        steps = len(self.steps)
        lines = [
            f"plan: {self.hosts} host(s), steps {self.steps.start}..{self.steps.stop - 1} ({steps} steps), "
            f"{self.file_count} files, chunks of {self.read_ahead} step(s), lookahead {self.lookahead} steps"
            + (f", {self.epoch_steps} steps per epoch" if self.epoch_steps else ""),
            f"{'per host':<26}{'p50':>12}{'p99':>12}{'max':>12}  host of max",
        ]
        for n in self.per_host:
            s = self.spread(n)
            cells = "".join(f"{_num(s[k], n):>12}" for k in ("p50", "p99", "max"))
            lines.append(f"{LABELS[n]:<26}{cells}  {s['host_max']}")
        if self.cache_bytes is not None:
            lines.append(f"disk cache replayed: {_bytes(self.cache_bytes)} per host, {self.policy}")
        if len(self.egress_per_epoch):
            per = ", ".join(
                f"epoch {self.first_epoch + k}: {_bytes(int(x))}" for k, x in enumerate(self.egress_per_epoch[:8])
            )
            more = ", ..." if len(self.egress_per_epoch) > 8 else ""
            lines.append(f"egress of the whole job: {per}{more}")
        off = self.outlier()
        if off is not None:
            h, n, r = off
            lines.append(f"host {h} is far from the median: {FIGURES[n]} {r:.2f}x the median")
        lines += [f"limit: {why}" for why in self.limits]
        lines.append(f"planned in {self.seconds:.2f} s, no record read")
        return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, k in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: float, name: str) -> str:
    if name in ("bytes", "working_set", "no_refetch_cache", "bytes_fetched"):
        return _bytes(x)
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def plan_io(
    pipe: Pipeline,
    *,
    hosts: int = 1,
    steps: range | tuple[int, int] | None = None,
    cache_bytes: int | None = None,
    policy: Literal["belady", "lru"] = "belady",
    read_ahead: int | None = None,
    lookahead: int = LOOKAHEAD,
    compile: bool = True,
) -> IOPlan:
    """The read plan of ``pipe`` on ``hosts`` hosts over ``steps`` (see the module docstring).

    It depends on the definition, the host count, the steps, the files' sizes
    and record counts, ``read_ahead``, ``lookahead`` and the cache given; it reads
    no record (a packed pipeline whose lengths are measured as it reads measures
    the documents its plan reaches, as iterating would).

    Args:
        pipe: a batched pipeline.
        hosts: the number of hosts (it must divide the batch size).
        steps: the steps, ``range`` or ``(start, stop)`` (default: every step of a finite
            pipeline, else its first epoch).
        cache_bytes: replay a disk cache of this many bytes per host (``None``: none).
        policy: its eviction rule: ``"belady"`` (the iterator's lookahead) or ``"lru"``.
        read_ahead: steps per chunk, as the iterator's (``None``: the iterator's default).
        lookahead: the window of the working set, in steps (the iterator's lookahead).
        compile: replay the cache with numba when it is installed.

    Returns:
        An :class:`IOPlan`.

    Raises:
        ValueError: ``hosts`` does not divide the batch size, the steps are empty or past
            the end, the cache is smaller than the largest remote file, an unknown policy.
        TypeError: the pipeline is a live stream (its entries are not written yet).
    """
    t0 = time.perf_counter()
    b = need_batch(pipe, "plan_io")
    if not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
    try:
        lo, hi = host_rows(b, 0, hosts)
    except ValueError as e:
        raise ValueError(f"--hosts {hosts}: {e}") from None
    if policy not in cache_model.POLICIES:
        raise ValueError(f"policy must be one of {', '.join(cache_model.POLICIES)}, got {policy!r}")
    if pipe.stream.wait_timeout() is not None:
        raise TypeError("plan_io: a live stream's entries are not written yet: it has no read plan")
    end = pipe.num_steps
    epoch_len = pipe.stream.epoch_length
    if steps is None:
        if end is not None:
            steps = range(0, end)
        elif epoch_len:
            steps = range(0, max(1, math.ceil(epoch_len / b)))
        else:
            raise ValueError("plan_io: an endless pipeline without epochs: give the steps (--steps A:B)")
    steps = steps if isinstance(steps, range) else range(int(steps[0]), int(steps[1]))
    if len(steps) < 1 or steps.step != 1 or steps.start < 0:
        raise ValueError(
            f"the steps must be consecutive and not empty, from step 0 on, got {steps.start}..{steps.stop - 1}"
        )
    if end is not None and steps.stop > end:
        raise ValueError(f"steps {steps.start}..{steps.stop - 1}: the pipeline has {end} steps (0..{end - 1})")
    if read_ahead is None:
        c = len(pipe.leaves)
        read_ahead = steps_per_read(hi - lo, THREAD_READ_RECORDS * c, THREAD_READ_STEPS * c)
    read_ahead = check_int(read_ahead, "read_ahead", 1)
    if int(lookahead) < 1:
        raise ValueError(f"lookahead must be at least 1 step, got {lookahead}")

    layouts: dict[int, _Files] = {}
    for src in pipe.sources:
        layouts.setdefault(id(src), _files_of(src))
    offset, at = {}, 0
    for k, f in layouts.items():
        offset[k], at = at, at + len(f.starts) - 1
    n_files = at
    sizes = np.zeros(n_files, dtype=np.int64)
    remote = np.zeros(n_files, dtype=bool)
    per_record = np.zeros(n_files, dtype=np.float64)
    sized = all(f.sizes is not None for f in layouts.values())
    for k, f in layouts.items():
        o, n = offset[k], len(f.starts) - 1
        counts = np.maximum(np.diff(f.starts), 1)
        if f.sizes is not None:
            sizes[o : o + n], per_record[o : o + n] = f.sizes, f.sizes / counts
        remote[o : o + n] = f.remote
    if cache_bytes is not None:
        cache_bytes = int(cache_bytes)
        biggest = int((sizes[remote] if remote.any() else sizes).max(initial=0))
        if cache_bytes < max(1, biggest):
            raise ValueError(
                f"a cache of {cache_bytes} bytes is smaller than one shard: the largest {'remote ' if remote.any() else ''}"
                f"file is {biggest} bytes"
            )

    contiguous = _contiguous(pipe.stream)
    first = chunk_starts(steps.start, steps.stop, read_ahead)
    n_steps, n_chunks = len(steps), len(first)
    chunk_of = np.searchsorted(first, np.arange(steps.start, steps.stop), side="right") - 1
    window_of = (np.arange(steps.start, steps.stop) - steps.start) // int(lookahead)
    n_windows = int(window_of[-1]) + 1
    n_epochs = (steps.stop * b - 1) // epoch_len + 1 if epoch_len else 1
    first_epoch = steps.start * b // epoch_len if epoch_len else 0

    def block_figures(block: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """One block's per-host sums, its file reads ``(host, file, epoch)`` sorted by host, its distinct keys."""
        pos, step, host, probe = _rows(pipe, block, hosts, contiguous)
        reads = pipe.stream.reads(pos)
        if not reads:
            if len(pos):
                raise ValueError(
                    f"plan_io: a {type(pipe.stream).__name__} does not say which records its rows read: it cannot be "
                    "planned (a bucketed pipeline reads each bucket's records on its own)"
                )
            return None
        epoch = pos // epoch_len if epoch_len else np.zeros(len(pos), dtype=np.int64)
        parts = [
            (
                host[rows],
                step[rows] - steps.start,
                np.searchsorted(layouts[id(src)].starts, ids, side="right") - 1 + offset[id(src)],
                np.full(len(ids), call),
                epoch[rows],
                probe[rows],
            )
            for call, (src, ids, rows) in enumerate(reads)
        ]
        h, s, f, call, e, pr = (np.concatenate(x) for x in zip(*parts))
        counts = np.bincount(h[~pr], minlength=hosts)  # a probe row is read, not one of the host's records
        nbytes = np.bincount(h[~pr], weights=per_record[f[~pr]], minlength=hosts)
        step_files = np.bincount(_distinct((h * n_steps + s) * n_files + f) // n_files // n_steps, minlength=hosts)
        key = ((h * n_chunks + chunk_of[s]) * len(reads) + call) * n_files + f
        order = np.argsort(key)
        key = key[order]
        new = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
        acc_e = np.minimum.reduceat(e[order], new)
        key = key[new]
        acc_h, acc_c = key // n_files // len(reads) // n_chunks, key // n_files // len(reads) % n_chunks
        return counts, nbytes, step_files, acc_h, key % n_files, acc_e, window_of[first[acc_c] - steps.start]

    import concurrent.futures

    blocks = _blocks(first, steps.stop, max(1, BLOCK_ROWS // b))
    with concurrent.futures.ThreadPoolExecutor(min(len(blocks), os.cpu_count() or 1, 4)) as pool:  # NumPy frees the GIL
        done = [r for r in pool.map(block_figures, blocks) if r is not None]
    records = sum((r[0] for r in done), np.zeros(hosts, dtype=np.int64))
    nbytes = sum((r[1] for r in done), np.zeros(hosts, dtype=np.float64))
    step_files = sum((r[2] for r in done), np.zeros(hosts, dtype=np.int64))
    # the file reads host-major: each block's reads (sorted by host) placed after the earlier blocks' of each host
    per_block = np.stack([np.bincount(r[3], minlength=hosts) for r in done]) if done else np.zeros((1, hosts), int)
    at = np.concatenate([[0], np.cumsum(per_block.sum(0))])[:-1] + np.cumsum(per_block, 0) - per_block
    total = int(per_block.sum())
    acc_h, acc_f, acc_e, acc_w = (np.empty(total, dtype=np.int64) for _ in range(4))
    for k, r in enumerate(done):
        hs = r[3]
        where = at[k][hs] + np.arange(len(hs)) - np.searchsorted(hs, np.arange(hosts))[hs]
        acc_h[where], acc_f[where], acc_e[where], acc_w[where] = hs, r[4], r[5], r[6]
    bounds = np.concatenate([[0], np.cumsum(per_block.sum(0))])
    per_host: dict[str, np.ndarray] = {"records": records}
    limits = [f.note for f in layouts.values() if f.note]
    egress = np.zeros(0, dtype=np.int64)
    trace = (np.zeros(hosts + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    if sized:
        per_host["bytes"] = np.rint(nbytes).astype(np.int64)
        per_host["files_per_step"] = step_files / n_steps
        nxt = cache_model.next_reads(acc_f, bounds, n_files, compile=compile)
        first_e = cache_model.first_reads(nxt, acc_e)[0]
        per_epoch = np.bincount(acc_h * n_epochs + acc_e, weights=first_e, minlength=hosts * n_epochs)
        per_epoch = per_epoch.reshape(hosts, n_epochs)
        per_host["files_per_epoch"] = per_epoch.sum(1) / np.maximum((per_epoch > 0).sum(1), 1)
        per_host["file_reads"] = np.bincount(acc_h, minlength=hosts)
        first_w = cache_model.first_reads(nxt, acc_w)[0]
        ws = np.bincount(acc_h * n_windows + acc_w, weights=first_w * sizes[acc_f], minlength=hosts * n_windows)
        per_host["working_set"] = ws.reshape(hosts, n_windows).max(1).astype(np.int64)
        if remote.any():
            cached = remote[acc_f]
            c_h, c_f, c_e = acc_h[cached], acc_f[cached], acc_e[cached]
            c_bounds = np.concatenate([[0], np.cumsum(np.bincount(c_h, minlength=hosts))])
            c_nxt = nxt if cached.all() else None
        else:
            limits.append("no source is remote: the cache figures are those of the same files behind a URL")
            c_f, c_e, c_bounds, c_nxt = acc_f, acc_e, bounds, nxt
        trace = (c_bounds, c_f)
        per_host["no_refetch_cache"] = cache_model.no_refetch_bytes(
            c_f, sizes, c_bounds, c_e, nxt=c_nxt, compile=compile
        )
        if cache_bytes is not None:
            fig = cache_model.simulate(c_f, sizes, c_bounds, cache_bytes, policy, compile=compile)
            per_host["hits"], per_host["misses"], per_host["bytes_fetched"] = fig.hits, fig.misses, fig.bytes_fetched
            fetched = fig.missed
        else:
            fetched = (
                first_e
                if c_nxt is not None
                else cache_model.first_reads(cache_model.next_reads(c_f, c_bounds, n_files, compile=compile), c_e)[0]
            )
        egress = np.bincount(c_e[fetched], weights=sizes[c_f[fetched]], minlength=n_epochs).astype(np.int64)
        egress = egress[first_epoch:]  # the epochs the steps reach
    names = [str(p) for f in layouts.values() for p in (getattr(f.source, "paths", None) or [f.source.name])]
    return IOPlan(
        hosts=hosts,
        steps=steps,
        read_ahead=read_ahead,
        lookahead=int(lookahead),
        epoch_steps=math.ceil(epoch_len / b) if epoch_len else None,
        cache_bytes=cache_bytes,
        policy=policy,
        per_host=per_host,
        egress_per_epoch=egress,
        first_epoch=first_epoch,
        file_count=n_files,
        limits=tuple(limits),
        seconds=time.perf_counter() - t0,
        trace=trace,
        file_names=tuple(names) if len(names) == n_files else (),
        file_sizes=sizes,
    )


def _distinct(keys: np.ndarray) -> np.ndarray:
    """The distinct values of ``keys``, sorted (a sort: NumPy's hashing ``unique`` is slower on int64 keys)."""
    s = np.sort(keys)
    return s[np.concatenate([[True], s[1:] != s[:-1]])] if len(s) else s


def _blocks(first: np.ndarray, stop: int, most: int) -> list[np.ndarray]:
    """The planned steps in blocks of whole chunks, each of at most ``most`` steps (or one chunk)."""
    edges = [*first.tolist(), stop]
    out, k = [], 0
    while k < len(first):
        j = k + 1
        while j < len(first) and edges[j + 1] - edges[k] <= most:
            j += 1
        out.append(np.arange(edges[k], edges[j], dtype=np.int64))
        k = j
    return out
