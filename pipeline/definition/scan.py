"""The one-time scans: which records a filter keeps, how many tokens each record holds, how many outputs a flat map makes.

:func:`survivors` returns the sorted ids of the records a filter keeps,
:func:`lengths` the length index of a pipeline and :func:`counts` the outputs of a
flat map per record. Each result depends only on the
source's records and the record transforms, so it is cached on disk under the
fingerprint of the pipeline prefix (:mod:`quern.pipeline.order.survivors`,
:mod:`quern.pipeline.order.indexfile`): a verified cache file made for that key
is used as is, a missing, partial or damaged one, or one made for another key,
is rebuilt.

Records are read in bulk chunks of :data:`CHUNK` ids. With at least
:data:`PROCESS_MIN` candidates a scan runs in ``num_workers`` fresh interpreter
processes, each over a contiguous range of candidates; each first checks that
the definition it loaded is the parent's (:mod:`quern.pipeline.identity.samedef`), and
the parent raises :class:`~quern.pipeline.core.errors.ScanError` naming what
differs, caching nothing.
"""

from __future__ import annotations

import os
import pickle
import selectors
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from ..core.errors import FingerprintError, ScanError, StepError
from ..core.ops import OpKind
from ..core.progress import Bar
from ..execute import stages
from ..identity import samedef
from ..order import indexfile
from ..order import survivors as _survivors

__all__ = [
    "CHUNK",
    "PROCESS_MIN",
    "keep_mask",
    "record_lengths",
    "survivors",
    "metadata_survivors",
    "lengths",
    "counts",
    "outputs_count",
    "column_lengths",
]

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


def _lengths(records: Any, ids: np.ndarray, source_name: str, key: str | None) -> np.ndarray:
    """Tokens per record: ``len`` of the record (``record[key]``), which must be 1-D."""
    out = np.empty(len(records), dtype=np.int64)
    for i, rec in enumerate(records):
        what = rec
        if key is not None:
            if not isinstance(rec, dict) or key not in rec:
                keys = list(rec) if isinstance(rec, dict) else None
                raise ScanError(
                    f"length scan, record {int(ids[i])} of source {source_name!r}: no key {key!r} in the record "
                    f"({'its keys: ' + repr(keys) if keys is not None else type(rec).__name__})"
                )
            what = rec[key]
        if isinstance(what, dict):
            raise ScanError(
                f"length scan, record {int(ids[i])} of source {source_name!r}: the record is a dict (keys "
                f"{list(what)[:8]}); pass key= to say which of its values holds the tokens"
            )
        arr = np.asarray(what) if not isinstance(what, (bytes, str)) else None
        if arr is None or arr.ndim != 1:
            shape = "bytes or str" if arr is None else f"shape {arr.shape}"
            raise ScanError(
                f"length scan, record {int(ids[i])} of source {source_name!r}"
                f"{'' if key is None else f', key {key!r}'}: expected a 1-D array of tokens, got {shape}"
            )
        out[i] = arr.shape[0]
    return out


def _counts(fn: Any, records: Any, ids: np.ndarray, source_name: str, label: str) -> np.ndarray:
    """Outputs per record of the flat map ``fn``: the length of the list it returns."""
    out = np.empty(len(records), dtype=np.int64)
    for i, rec in enumerate(records):
        try:
            got = fn(rec)
        except Exception as e:
            raise ScanError(
                f"flat_map scan, stage {label}, record {int(ids[i])} of source {source_name!r}: {type(e).__name__}: {e}"
            ) from e
        out[i] = outputs_count(got, label, f"record {int(ids[i])} of source {source_name!r}", ScanError)
    return out


def outputs_count(got: Any, label: str, record: str, error: type[Exception]) -> int:
    """The number of outputs of a flat map's result ``got`` for ``record``, which must be a list or tuple.

    Raises:
        ScanError: (or ``SourceError``, whichever ``error`` is) ``got`` is not a list or tuple, naming the stage
            and the record.
    """
    if not isinstance(got, (list, tuple)):
        raise error(
            f"flat_map stage {label}, {record}: it returned {type(got).__name__}; a flat map returns a list "
            "(or tuple) of records, empty for none"
        )
    return len(got)


Measure = Literal["filter", "lengths", "counts"]
_SCAN_NAMES = {"filter": "filter", "lengths": "length", "counts": "flat_map"}


def _measure(prefix: Any, ids: np.ndarray, what: Measure, key: str | None, progress: Any = None) -> np.ndarray:
    """Read ``ids`` of ``prefix.source`` in chunks, run the record transforms, and measure each record.

    ``what="filter"``: does the filter ending ``prefix`` keep it (bool; the
    transforms before it); ``what="lengths"``: its tokens (int64; all the transforms);
    ``what="counts"``: the outputs of the flat map ending ``prefix`` (int64; the transforms before it).
    """
    ops = prefix.record_ops
    upto = len(ops) if what == "lengths" else len(ops) - 1
    out: np.ndarray = np.empty(len(ids), dtype=np.bool_ if what == "filter" else np.int64)
    for lo in range(0, len(ids), CHUNK):
        chunk = np.asarray(ids[lo : lo + CHUNK], dtype=np.int64)
        where = f"{_SCAN_NAMES[what]} scan of records {int(chunk[0])}..{int(chunk[-1])}"
        try:
            records: Any = stages.read(prefix, chunk, where)
            for j in range(upto):
                if ops[j].kind is not OpKind.FILTER:  # a filter keeps every candidate
                    records = stages.apply_record_op(prefix, j, records, chunk, chunk, where)
        except StepError as e:
            raise ScanError(str(e)) from e.__cause__
        if what == "filter":
            out[lo : lo + len(chunk)] = _keep(ops[upto].fn, records, chunk, prefix.source.name, ops[upto].label(upto))
        elif what == "counts":
            out[lo : lo + len(chunk)] = _counts(ops[upto].fn, records, chunk, prefix.source.name, ops[upto].label(upto))
        else:
            out[lo : lo + len(chunk)] = _lengths(records, chunk, prefix.source.name, key)
        if progress is not None:
            progress(len(chunk))
    return out


def keep_mask(prefix: Any, ids: np.ndarray, *, progress: Callable[[int], Any] | None = None) -> np.ndarray:
    """Whether the filter at the end of ``prefix`` keeps each record of ``ids``, in this process.

    Args:
        prefix: a pipeline whose last record stage is the filter.
        ids: the source's record ids to judge.
        progress: called after each chunk with the number of ids done in it.

    Returns:
        One boolean per id; it depends only on the records, the record
        transforms before the filter and its predicate.

    Raises:
        ScanError: reading, a transform or the predicate failed, or the predicate
            returned something else than a boolean (naming the record).
    """
    return _measure(prefix, ids, "filter", None, progress)


def record_lengths(
    prefix: Any, ids: np.ndarray, *, key: str | None = None, progress: Callable[[int], Any] | None = None
) -> np.ndarray:
    """The tokens of each record of ``ids`` after all of ``prefix``'s record transforms, in this process.

    Args:
        prefix: the pipeline.
        ids: the source's record ids to measure.
        key: measure ``record[key]`` (``None``: the record itself).
        progress: called after each chunk with the number of ids done in it.

    Returns:
        One ``int64`` length per id.

    Raises:
        ScanError: reading or a transform failed, or a record (``record[key]``)
            is not a 1-D array (naming the record).
    """
    return _measure(prefix, ids, "lengths", key, progress)


def column_lengths(prefix: Any, ids: np.ndarray, keys: Sequence[str | None]) -> np.ndarray:
    """The tokens of each record of ``ids`` in each of ``keys``, after all of ``prefix``'s record transforms.

    One bulk read and one pass of the transforms per chunk, however many keys.

    Returns:
        An ``int64`` array of shape ``(len(ids), len(keys))``.

    Raises:
        ScanError: reading or a transform failed, or a record (``record[key]``) is not a 1-D array.
    """
    ops = prefix.record_ops
    ids = np.asarray(ids, dtype=np.int64)
    out = np.empty((len(ids), len(keys)), dtype=np.int64)
    for lo in range(0, len(ids), CHUNK):
        chunk = ids[lo : lo + CHUNK]
        where = f"length scan of records {int(chunk[0])}..{int(chunk[-1])}"
        try:
            records: Any = stages.read(prefix, chunk, where)
            for j in range(len(ops)):
                if ops[j].kind is not OpKind.FILTER:
                    records = stages.apply_record_op(prefix, j, records, chunk, chunk, where)
        except StepError as e:
            raise ScanError(str(e)) from e.__cause__
        for c, key in enumerate(keys):
            out[lo : lo + len(chunk), c] = _lengths(records, chunk, prefix.source.name, key)
    return out


def _scan_in_processes(
    prefix: Any, candidates: np.ndarray, workers: int, bar: Bar, what: Measure = "filter", key: str | None = None
) -> np.ndarray:
    """:func:`_measure` over ``candidates`` in ``workers`` fresh interpreters (never a fork of this process).

    Each process takes a contiguous range; progress comes back on stdout.
    """
    import cloudpickle

    bounds = np.linspace(0, len(candidates), workers + 1).astype(np.int64)
    with tempfile.TemporaryDirectory(prefix="quern-scan-") as tmp:
        ids_path = os.path.join(tmp, "ids.npy")
        np.save(ids_path, np.asarray(candidates, dtype=np.int64))
        job = os.path.join(tmp, "job.pkl")
        with open(job, "wb") as f:
            f.write(cloudpickle.dumps((prefix, what, key)))
        procs = []
        code = f"import sys; sys.path[:] = {sys.path!r}; from quern.pipeline.definition.scan import _child; _child()"
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
                for ready, _ in sel.select():
                    line = ready.fileobj.readline()  # type: ignore[union-attr]
                    if not line:
                        sel.unregister(ready.fileobj)
                        open_pipes -= 1
                    elif line.strip().isdigit():
                        bar.update(int(line))
            masks = []
            for p, out in procs:
                err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                if p.wait() != 0:
                    last = err.strip().splitlines()[-1] if err.strip() else f"exit status {p.returncode}"
                    raise ScanError(f"{what} scan: a scan process failed: {last}")
                masks.append(np.load(out))
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            sel.close()
        return np.concatenate(masks) if masks else np.zeros(0, dtype=np.bool_ if what == "filter" else np.int64)


def _child() -> None:
    """Entry point of a scan process: ``job ids lo hi out`` on the command line."""
    job, ids_path, lo, hi, out = sys.argv[1:6]
    with open(job, "rb") as f:
        prefix, what, key = pickle.load(f)
    try:  # the pipeline carries the parent's definition: refuse to scan another
        samedef.check_sent(prefix, f"a {_SCAN_NAMES[what]} scan process")
    except FingerprintError as e:
        sys.stderr.write(" ".join(str(e).split()) + "\n")  # one line: the parent shows the last one
        sys.exit(1)
    ids = np.load(ids_path, mmap_mode="r")[int(lo) : int(hi)]

    def report(n: int) -> None:
        sys.stdout.write(f"{n}\n")
        sys.stdout.flush()

    try:
        mask = _measure(prefix, ids, what, key, report)
    except ScanError as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(1)
    np.save(out, mask)


def survivors(
    prefix: Any,
    key: str,
    *,
    candidates: np.ndarray | None,
    n: int,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> np.ndarray:
    """The sorted ids kept by the filter ending ``prefix``, from its cache file or a scan.

    A scan (a progress bar on a terminal) writes the cache file; a cache folder
    that cannot be written keeps the result in memory only.

    Args:
        prefix: a pipeline whose last record stage is the filter.
        key: the cache key (the fingerprint of ``prefix``).
        candidates: the ids to judge, sorted (``None``: all ``n`` records).
        n: the number of records of the source.
        cache_dir: the cache folder (default: quern's cache folder).
        num_workers: scan processes with at least :data:`PROCESS_MIN` candidates
            (default: the CPU count; 0 or 1: this process).

    Returns:
        An ``int64`` array; it depends only on the records, the record
        transforms and the predicate, never on ``num_workers``.

    Raises:
        ScanError: the scan failed (naming the record), or a scan process loaded
            another definition than this one.
        ValueError: the filter keeps nothing.
    """
    path = _survivors.path_for(key, cache_dir)
    ids, why = _survivors.load(path, n, key=key)
    if ids is not None:
        return ids
    if why != "not built yet":
        print(f"quern: the filter cache {path} is not usable ({why}); scanning again", file=sys.stderr)
    cand = np.arange(n, dtype=np.int64) if candidates is None else np.asarray(candidates, dtype=np.int64)
    workers = (os.cpu_count() or 1) if num_workers is None else int(num_workers)
    with Bar(len(cand), "quern filter scan", unit="record") as bar:
        if workers > 1 and len(cand) >= PROCESS_MIN:
            mask = _scan_in_processes(prefix, cand, workers, bar)
        else:
            mask = keep_mask(prefix, cand, progress=bar.update)
    kept = cand[mask]
    if not kept.size:
        label = prefix.record_ops[-1].label(len(prefix.record_ops) - 1)
        raise ValueError(
            f"filter {label} keeps none of the {len(cand)} records of source {prefix.source.name!r}: "
            "the stream would be empty"
        )
    try:
        _survivors.store(path, kept, n, key=key)
    except OSError as e:  # a read-only cache folder: the scan's result is still right
        print(f"quern: cannot write the filter cache {path} ({e}); it is kept in memory only", file=sys.stderr)
        return kept
    ids, why = _survivors.load(path, n, key=key)
    return ids if ids is not None else kept


def metadata_survivors(source: Any, pred: Any, *, candidates: np.ndarray | None, label: str) -> np.ndarray:
    """The sorted ids whose metadata ``pred.keep_metadata`` keeps: one vectorised call, no record read.

    Nothing is cached: it costs one pass over the source's metadata index.

    Args:
        source: a source with a metadata index (``has_metadata``).
        pred: a predicate with ``keep_metadata`` (e.g. :func:`quern.transforms.metadata_range`).
        candidates: the ids to judge, sorted (``None``: all the source's records).
        label: the filter stage's label, for messages.

    Returns:
        A read-only ``int64`` array; it depends only on the metadata and the predicate.

    Raises:
        ValueError: the source has no metadata index, the predicate names a
            field it lacks or returns something else than one boolean per
            record, or it keeps nothing.
    """
    if not getattr(source, "has_metadata", False):
        raise ValueError(
            f"filter {label} reads a metadata index; source {source.name!r} has none (open a folder written by "
            "quern prepare with ArrayRecordSource)"
        )
    n = len(source)
    try:
        mask = np.asarray(pred.keep_metadata(source.metadata))
    except KeyError as e:
        raise ValueError(f"filter {label} on source {source.name!r}: {e.args[0]}") from None
    if mask.shape != (n,) or mask.dtype != np.bool_:
        raise ValueError(
            f"filter {label}: keep_metadata returned shape {mask.shape} and dtype {mask.dtype}; it must return "
            f"{n} booleans, one per record of source {source.name!r}"
        )
    cand = np.arange(n, dtype=np.int64) if candidates is None else np.asarray(candidates, dtype=np.int64)
    kept = cand[mask[cand]]
    if not kept.size:
        raise ValueError(
            f"filter {label} keeps none of the {len(cand)} records of source {source.name!r}: the stream would be empty"
        )
    kept.setflags(write=False)
    return kept


def lengths(
    prefix: Any,
    key: str,
    *,
    candidates: np.ndarray | None,
    n: int,
    length_key: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> np.ndarray:
    """The length index of ``prefix``, from its cache file or a scan.

    A scan (a progress bar on a terminal) writes the cache file; a cache folder
    that cannot be written keeps the result in memory only.

    Args:
        prefix: the pipeline.
        key: the cache key (the fingerprint of the index).
        candidates: the ids to measure, sorted (``None``: all ``n`` records).
        n: the number of records of the source.
        length_key: measure ``record[length_key]`` (``None``: the record itself).
        cache_dir: the cache folder (default: quern's cache folder).
        num_workers: scan processes with at least :data:`PROCESS_MIN` candidates
            (default: the CPU count; 0 or 1: this process).

    Returns:
        A read-only ``int64`` array of ``n`` values: the tokens of each record
        after ``prefix``'s record transforms, ``-1`` for records not among
        ``candidates``. It depends only on the records and the transforms.

    Raises:
        ScanError: the scan failed (naming the record), or a scan process loaded
            another definition than this one.
    """
    return _indexed(prefix, key, candidates, n, "lengths", length_key, cache_dir, num_workers)


def counts(
    prefix: Any,
    key: str,
    *,
    candidates: np.ndarray | None,
    n: int,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> np.ndarray:
    """The outputs per record of the flat map ending ``prefix``, from its cache file or a scan.

    As :func:`lengths` (the same cache folder and file format, under ``key``), with ``0`` for
    records not among ``candidates``.

    Returns:
        A read-only ``int64`` array of ``n`` values; it depends only on the records, the
        transforms before the flat map and its function.

    Raises:
        ScanError: the scan failed, or the function returned something else than a list
            (naming the record), or a scan process loaded another definition than this one.
    """
    return _indexed(prefix, key, candidates, n, "counts", None, cache_dir, num_workers)


def cached_index(key: str, n: int, cache_dir: str | os.PathLike | None = None) -> np.ndarray | None:
    """The per-record index cached under ``key`` (as :func:`lengths` writes it), if built and verified; else ``None``."""
    return indexfile.load(
        indexfile.path_for(key, cache_dir, kind=indexfile.LENGTHS), n, kind=indexfile.LENGTHS, key=key
    )[0]


def _indexed(
    prefix: Any,
    key: str,
    candidates: np.ndarray | None,
    n: int,
    what: Measure,
    length_key: str | None,
    cache_dir: str | os.PathLike | None,
    num_workers: int | None,
) -> np.ndarray:
    """A per-record integer index (``lengths`` or ``counts``) from its cache file, or scanned and cached."""
    name = {"lengths": "length index", "counts": "flat_map counts"}[what]
    path = indexfile.path_for(key, cache_dir, kind=indexfile.LENGTHS)
    found, why = indexfile.load(path, n, kind=indexfile.LENGTHS, key=key)
    if found is not None:
        return found
    if why != "not built yet":
        print(f"quern: the {name} {path} is not usable ({why}); scanning again", file=sys.stderr)
    cand = np.arange(n, dtype=np.int64) if candidates is None else np.asarray(candidates, dtype=np.int64)
    workers = (os.cpu_count() or 1) if num_workers is None else int(num_workers)
    with Bar(len(cand), f"quern {_SCAN_NAMES[what]} scan", unit="record") as bar:
        if workers > 1 and len(cand) >= PROCESS_MIN:
            got = _scan_in_processes(prefix, cand, workers, bar, what, length_key)
        else:
            got = _measure(prefix, cand, what, length_key, bar.update)
    out = np.full(n, -1 if what == "lengths" else 0, dtype=np.int64)
    out[cand] = got
    try:
        indexfile.store(path, out, n, kind=indexfile.LENGTHS, key=key)
    except OSError as e:
        print(f"quern: cannot write the {name} {path} ({e}); it is kept in memory only", file=sys.stderr)
        out.setflags(write=False)
        return out
    found, why = indexfile.load(path, n, kind=indexfile.LENGTHS, key=key)
    return found if found is not None else out
