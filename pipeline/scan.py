"""The one-time scan of a filter: which records its predicate keeps.

``survivors(prefix, candidates, ...)`` returns the sorted ids of the records of
``prefix.source`` among ``candidates`` (all records, or the survivors of an
earlier filter) for which the predicate (``prefix.record_ops[-1]``, a
``filter`` op) is true, after the record transforms before it
(``prefix.record_ops[:-1]``). The result depends only on the source's records,
those transforms and the predicate, so it is cached on disk keyed by the
fingerprint of ``prefix`` (see :mod:`quern.pipeline.plan.survivors`): a verified
cache file is used as is, a missing, partial or damaged one is rebuilt.

Records are read in bulk chunks of :data:`CHUNK` ids. With at least
:data:`PROCESS_MIN` candidates the scan runs in ``workers`` fresh interpreter
processes (default: the CPU count), each over a contiguous range of candidates;
a progress bar is drawn on a terminal.
"""

from __future__ import annotations

import os
import pickle
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from . import execute
from .errors import ScanError, StepError
from .ops import OpKind
from .plan import survivors as _survivors

__all__ = ["CHUNK", "PROCESS_MIN", "keep_mask", "survivors"]

CHUNK = 4096  # records per bulk read
PROCESS_MIN = 200_000  # candidates from which the scan runs in worker processes


def _keep(pred: Any, records: Any, ids: np.ndarray, source_name: str, label: str) -> np.ndarray:
    many = getattr(pred, "keep_many", None)
    if many is not None:
        try:
            out = np.asarray(many(records))
        except Exception as e:
            raise ScanError(
                f"filter scan, stage {label} (records {source_name} {ids[:8].tolist()}...): {type(e).__name__}: {e}"
            ) from e
        if out.shape != (len(records),) or out.dtype != np.bool_:
            raise ScanError(
                f"filter scan, stage {label}: keep_many returned an array of shape {out.shape} and dtype "
                f"{out.dtype}; it must return {len(records)} booleans"
            )
        return out
    keep = np.empty(len(records), dtype=np.bool_)
    for i, rec in enumerate(records):
        try:
            v = pred(rec)
        except Exception as e:
            raise ScanError(
                f"filter scan, stage {label}, record {int(ids[i])} of source {source_name!r}: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(v, (bool, np.bool_)):
            raise ScanError(
                f"filter scan, stage {label}, record {int(ids[i])} of source {source_name!r}: the predicate "
                f"returned {type(v).__name__} {v!r:.80}; it must return True or False"
            )
        keep[i] = bool(v)
    return keep


def keep_mask(prefix: Any, ids: np.ndarray, progress: Any = None) -> np.ndarray:
    """One boolean per id of ``ids``: does the filter at the end of ``prefix`` keep it.
    ``progress(n)`` is called after each chunk with the ids done in it."""
    ops = prefix.record_ops
    k = len(ops) - 1
    pred = ops[k]
    label = pred.label(k)
    out = np.empty(len(ids), dtype=np.bool_)
    for lo in range(0, len(ids), CHUNK):
        chunk = np.asarray(ids[lo : lo + CHUNK], dtype=np.int64)
        where = f"filter scan of records {int(chunk[0])}..{int(chunk[-1])}"
        try:
            records: Any = execute.read(prefix, chunk, where)
            for j in range(k):
                if ops[j].kind is not OpKind.FILTER:  # an earlier filter keeps every candidate
                    records = execute.apply_record_op(prefix, j, records, chunk, chunk, where)
        except StepError as e:
            raise ScanError(str(e)) from e.__cause__
        out[lo : lo + len(chunk)] = _keep(pred.fn, records, chunk, prefix.source.name, label)
        if progress is not None:
            progress(len(chunk))
    return out


class _Bar:
    """``quern filter scan: done/total records`` on stderr when it is a terminal."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.on = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.on and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            pct = 100.0 * self.done / max(1, self.total)
            sys.stderr.write(f"\rquern filter scan: {self.done:,}/{self.total:,} records ({pct:5.1f}%)")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _scan_in_processes(prefix: Any, candidates: np.ndarray, workers: int, bar: _Bar) -> np.ndarray:
    """``keep_mask`` over ``candidates`` in ``workers`` fresh interpreters (never a fork
    of this process), each over a contiguous range; progress comes back on stdout."""
    import cloudpickle

    bounds = np.linspace(0, len(candidates), workers + 1).astype(np.int64)
    with tempfile.TemporaryDirectory(prefix="quern-scan-") as tmp:
        ids_path = os.path.join(tmp, "ids.npy")
        np.save(ids_path, np.asarray(candidates, dtype=np.int64))
        job = os.path.join(tmp, "job.pkl")
        with open(job, "wb") as f:
            f.write(cloudpickle.dumps(prefix))
        procs = []
        code = f"import sys; sys.path[:] = {sys.path!r}; from quern.pipeline.scan import _child; _child()"
        sel = selectors.DefaultSelector()
        try:
            for w in range(workers):
                out = os.path.join(tmp, f"mask-{w}.npy")
                p = subprocess.Popen(
                    [sys.executable, "-c", code, job, ids_path, str(bounds[w]), str(bounds[w + 1]), out],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=dict(os.environ, JAX_PLATFORMS="cpu"),
                )
                procs.append((p, out))
                assert p.stdout is not None
                sel.register(p.stdout, selectors.EVENT_READ)
            open_pipes = workers
            while open_pipes:
                for key, _ in sel.select():
                    line = key.fileobj.readline()  # type: ignore[union-attr]
                    if not line:
                        sel.unregister(key.fileobj)
                        open_pipes -= 1
                    elif line.strip().isdigit():
                        bar(int(line))
            masks = []
            for p, out in procs:
                err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                if p.wait() != 0:
                    last = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
                    raise ScanError(f"filter scan: a scan process failed: {last}")
                masks.append(np.load(out))
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            sel.close()
        return np.concatenate(masks) if masks else np.zeros(0, dtype=np.bool_)


def _child() -> None:
    """Entry point of a scan process: ``job ids lo hi out`` on the command line."""
    job, ids_path, lo, hi, out = sys.argv[1:6]
    with open(job, "rb") as f:
        prefix = pickle.load(f)
    ids = np.load(ids_path, mmap_mode="r")[int(lo) : int(hi)]

    def report(n: int) -> None:
        sys.stdout.write(f"{n}\n")
        sys.stdout.flush()

    try:
        mask = keep_mask(prefix, ids, report)
    except ScanError as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(1)
    np.save(out, mask)


def survivors(
    prefix: Any,
    key: str,
    candidates: np.ndarray | None,
    n: int,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> np.ndarray:
    """The sorted ids kept by the filter ending ``prefix`` among ``candidates``
    (``None``: all ``n`` records), from the verified cache file of ``key`` or a scan
    (which then writes it). ``ValueError`` if it keeps nothing."""
    path = _survivors.path_for(key, cache_dir)
    ids, why = _survivors.load(path, n)
    if ids is not None:
        return ids
    if why != "not built yet":
        print(f"quern: the filter cache {path} is not usable ({why}); scanning again", file=sys.stderr)
    cand = np.arange(n, dtype=np.int64) if candidates is None else np.asarray(candidates, dtype=np.int64)
    bar = _Bar(len(cand))
    workers = os.cpu_count() or 1 if workers is None else int(workers)
    if workers > 1 and len(cand) >= PROCESS_MIN:
        mask = _scan_in_processes(prefix, cand, workers, bar)
    else:
        mask = keep_mask(prefix, cand, bar)
    kept = cand[mask]
    if not kept.size:
        label = prefix.record_ops[-1].label(len(prefix.record_ops) - 1)
        raise ValueError(
            f"filter {label} keeps none of the {len(cand)} records of source {prefix.source.name!r}: "
            "the stream would be empty"
        )
    try:
        _survivors.store(path, kept, n)
    except OSError as e:  # a read-only cache folder: the scan's result is still right
        print(f"quern: cannot write the filter cache {path} ({e}); it is kept in memory only", file=sys.stderr)
        return kept
    ids, why = _survivors.load(path, n)
    return ids if ids is not None else kept
