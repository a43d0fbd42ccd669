"""The shards of a prepare: which items each holds (the plan), and writing one.

The plan is a pure function of the items' sizes, ``shard_size`` and the map's
expansion ratio (measured on a fixed sample of records): the same for any
worker count, for local and Ray runs. A shard's bytes depend only on its items
and the map, so any process may write any shard, in any order (see
``docs/design/prepare.md``).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..pipeline.core.errors import PrepareError, RecordError
from ..pipeline.sources import prepared
from .inputs import Item
from .records import Rec, as_record, read_item, where_of

__all__ = [
    "Job",
    "disk_full",
    "expansion",
    "plan_shards",
    "write_shard",
    "shard_names",
    "sidecar_path",
    "tmp_dir",
]

WRITER_OPTIONS = "group_size:1,max_parallelism:1"  # one record per chunk: random access reads one record
COMPRESSION = "zstd:1"  # measured on stdlib text: 2.4x zstd:3's writes, 1.1x its reads, 1.07x its size
_COMPRESSION = re.compile(r"uncompressed|snappy|zstd(:(-?[0-9]|1[0-9]|2[0-2]))?|brotli(:([0-9]|1[01]))?")


def writer_options(compression: str) -> str:
    """The ArrayRecord writer's options for a compression.

    Args:
        compression: ``zstd:N``, ``brotli:N``, ``snappy`` or ``uncompressed``.

    Returns:
        The options text: one record per chunk, and ``compression``.

    Raises:
        ValueError: ``compression`` is none of these.

    Example:
        >>> writer_options("snappy")
        'group_size:1,max_parallelism:1,snappy'
    """
    if not isinstance(compression, str) or not _COMPRESSION.fullmatch(compression):
        raise ValueError(
            f"prepare: compression must be zstd[:LEVEL], brotli[:LEVEL], snappy or uncompressed, got {compression!r}"
        )
    return f"{WRITER_OPTIONS},{compression}"


_SAMPLE_ITEMS, _SAMPLE_RECORDS = 16, 8


@dataclasses.dataclass
class Job:
    """Everything a shard writer needs (picklable; sent once to each worker).

    Attributes:
        items: the input items, in record order.
        shards: the item range ``[a, b)`` of each shard.
        names: the shards' file names.
        output: the output folder (absolute).
        map_fn: the map, or ``None``.
        fields: the metadata fields kept beside ``length``.
        jsonl_field: the JSON field holding the record (``None``: the line).
        columns: the Parquet columns to read.
        skip_errors: skip records that cannot be read or mapped.
        writer_options: the ArrayRecord writer's options (:func:`writer_options`).
        map_definition: the parent's :func:`quern.pipeline.identity.samedef.definition` of
            ``map_fn`` (``None``: not compared).
        member: WebDataset: the extension of the member that is the record (``None``: the sample).
        images: image files: what is stored of each (:class:`~quern.prepare.images.ImageRecords`), or ``None``.
    """

    items: list[Item]
    shards: list[tuple[int, int]]
    names: list[str]
    output: str
    map_fn: Any
    fields: tuple[str, ...]
    jsonl_field: str | None
    columns: tuple[str, ...]
    skip_errors: bool
    writer_options: str = f"{WRITER_OPTIONS},{COMPRESSION}"
    map_definition: Any = None
    member: str | None = None
    images: Any = None


_CHECKED: set[int] = set()  # the jobs whose map this process has checked (by id: a worker holds one job)


def check_map(job: Job, where: str) -> None:
    """Refuse to write shards in this process with a map that differs from the parent's.

    A module global changed at run time is lost where the module is imported
    again (:func:`quern.pipeline.identity.samedef.check`). Checked once per job and process.

    Args:
        job: the job, with its map and the parent's definition of it.
        where: names this process in the message (``"a quern prepare Ray task"``).

    Raises:
        PrepareError: naming the first difference (the global, closure variable, default...).
    """
    if job.map_fn is None or job.map_definition is None or id(job) in _CHECKED:
        return
    from ..pipeline.core.errors import FingerprintError
    from ..pipeline.identity import samedef

    try:
        samedef.check(job.map_definition, job.map_fn, where=where)
    except FingerprintError as e:
        raise PrepareError(f"prepare: {e}") from e
    _CHECKED.add(id(job))


def shard_names(count: int) -> list[str]:
    """The shards' file names.

    Args:
        count: the number of shards.

    Returns:
        ``shard-00000-of-00012.array_record`` ... in shard order.

    Example:
        >>> shard_names(2)
        ['shard-00000-of-00002.array_record', 'shard-00001-of-00002.array_record']
    """
    return [f"shard-{i:05d}-of-{count:05d}.array_record" for i in range(count)]


def tmp_dir(output: str) -> str:
    """The folder of the files being written, inside the staging folder of ``output``.

    Args:
        output: the output folder.

    Returns:
        Its path.
    """
    return os.path.join(output, prepared.STAGING, "tmp")


def sidecar_path(output: str, name: str) -> str:
    """Where a finished shard's record is kept until the manifest is written.

    The record (the sidecar) holds the shard's counts, checksum, lengths and fields.

    Args:
        output: the output folder.
        name: the shard's file name.

    Returns:
        The sidecar's path.
    """
    return os.path.join(output, prepared.STAGING, "done", name + ".json")


_FULL = tuple(os.strerror(n) for n in (errno.ENOSPC, errno.EDQUOT))  # how the ArrayRecord writer says it


def disk_full(output: str, e: BaseException) -> PrepareError | None:
    """The error to raise for ``e`` if it says the disk (or quota) holding ``output`` is full.

    Args:
        output: the output folder, named in the message.
        e: the error: an ``OSError`` with ``ENOSPC``/``EDQUOT``, or the ArrayRecord
            writer's ``RuntimeError`` quoting one, says so.

    Returns:
        A :class:`PrepareError` saying so, or ``None`` for any other error.
    """
    if isinstance(e, PrepareError):
        return None
    if isinstance(e, OSError):
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    else:
        full = isinstance(e, RuntimeError) and any(text in str(e) for text in _FULL)
    if not full:
        return None
    cause = e.strerror if isinstance(e, OSError) and e.strerror else next(t for t in _FULL if t in str(e))
    return PrepareError(
        f"prepare: the disk holding the output folder {output!r} is full ({cause}): free space there (or choose "
        "another --output) and run the same prepare again; the shards it finished are kept"
    )


def _forked_child(pid: int) -> None:
    """End this process if it is not ``pid``: the map forked, and its child returned into prepare.

    The child would write shards and take tasks beside its parent.
    """
    if os.getpid() != pid:
        print(
            f"quern prepare: the map forked, and its child (pid {os.getpid()}) returned into quern prepare: it is "
            "ended (a process a map forks must end with os._exit, or be started with subprocess or "
            "multiprocessing)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(70)


def _convert(job: Job, item: Item, rec: Rec) -> list[tuple[bytes, str, int, dict[str, Any]]]:
    """``rec`` through the map, as ``[(record bytes, type, length, fields)]``.

    One record, or one per element when the map returns a list (a document cut
    into chunks; an empty list stores nothing for ``rec``). Raises
    :class:`RecordError` naming the record.
    """
    out = rec.value if job.map_fn is None else None
    if job.images is not None:
        try:
            out = job.images(rec.value, item.name)
        except ValueError as e:
            raise RecordError(where_of(item, rec), str(e)) from e
    elif job.map_fn is not None:
        pid = os.getpid()
        try:
            out = job.map_fn(rec.value)
        except Exception as e:
            _forked_child(pid)
            raise RecordError(where_of(item, rec), f"the map raised {type(e).__name__}: {e}") from e
        _forked_child(pid)
    elif rec.raw is not None:
        out = rec.raw
    return [_one(job, item, rec, o) for o in (out if isinstance(out, list) and job.map_fn is not None else [out])]


def _one(job: Job, item: Item, rec: Rec, out: Any) -> tuple[bytes, str, int, dict[str, Any]]:
    source = rec.fields
    if isinstance(out, dict):
        if "record" not in out:
            raise RecordError(
                where_of(item, rec),
                "a dict from the map must hold the record under 'record' (and scalar fields beside it)"
                if job.map_fn is not None
                else "a record of several columns needs a map to make one record of them",
            )
        source, out = out, out["record"]
    try:
        data, kind, length = as_record(out)
    except TypeError as e:
        raise RecordError(where_of(item, rec), f"{'the map returned' if job.map_fn else 'the input is'} {e}") from e
    values = {}
    for f in job.fields:
        v = source.get(f) if isinstance(source, dict) else None
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, bool) or isinstance(v, (int, float)):
            values[f] = v
        else:
            got = "nothing" if v is None else type(v).__name__
            raise RecordError(where_of(item, rec), f"field {f!r} must be a number or a boolean, got {got}")
    return data, kind, length, values


def expansion(job: Job) -> float:
    """Stored bytes per input byte, measured on a fixed sample of records.

    The sample is the first records of up to 16 items spread evenly over the
    input: the same in every run.

    Args:
        job: the job (its items and map).

    Returns:
        The ratio, to 4 significant digits; 1 without a sample.
    """
    n = len(job.items)
    picks = sorted({int(i) for i in np.linspace(0, n - 1, min(n, _SAMPLE_ITEMS))})
    inp = out = 0
    for i in picks:
        item = job.items[i]
        for k, rec in enumerate(
            read_item(item, jsonl_field=job.jsonl_field, columns=job.columns, fields=job.fields, member=job.member)
        ):
            if k >= _SAMPLE_RECORDS:
                break
            if isinstance(rec, RecordError):
                continue
            try:
                made = _convert(job, item, rec)
            except RecordError:
                continue
            inp += rec.nbytes
            out += sum(len(m[0]) for m in made)
    return float(f"{out / inp:.4g}") if inp and out else 1.0


def plan_shards(sizes: Sequence[int], shard_size: int, *, ratio: float) -> list[tuple[int, int]]:
    """Cut consecutive items into shards of at most ``shard_size`` estimated bytes.

    A shard is closed before the item that would take it over, so only an item
    bigger than ``shard_size`` alone makes a bigger one. Every shard holds at
    least one item.

    Args:
        sizes: the items' input bytes, in record order.
        shard_size: the most bytes a shard should hold.
        ratio: stored bytes per input byte (:func:`expansion`).

    Returns:
        The item range ``[a, b)`` of each shard; it depends only on the arguments.

    Example:
        >>> plan_shards([10] * 5, 25, ratio=1.0)
        [(0, 2), (2, 4), (4, 5)]
    """
    out, start, total = [], 0, 0.0
    for i, size in enumerate(sizes):
        est = size * ratio
        if i > start and total + est > shard_size:
            out.append((start, i))
            start, total = i, 0.0
        total += est
    out.append((start, len(sizes)))
    return out


def _atomic_json(path: str, value: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # written in part (a full disk): never left behind
            os.remove(tmp)


def write_shard(job: Job, index: int, *, report: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write shard ``index`` of ``job``, then its sidecar (the commit: a shard without one is unfinished).

    The records go to a temporary file, renamed to its final name once complete.
    The shard's bytes depend only on its items and the map.

    Args:
        job: the job.
        index: the shard's index in ``job.shards``.
        report: called as ``report(input_bytes, records)`` as items are done.

    Returns:
        The sidecar: ``file``, ``records``, ``bytes``, ``sha256``, ``type``,
        ``lengths``, ``fields``, ``skipped``, ``input_sha256``.

    Raises:
        PrepareError: a record cannot be read or mapped (without
            ``skip_errors``), the records are of two types, or the disk is full
            (see :func:`disk_full`).
    """
    tmp = os.path.join(tmp_dir(job.output), f"{job.names[index]}.{os.getpid()}.tmp")
    try:
        os.makedirs(tmp_dir(job.output), exist_ok=True)
        return _write_shard(job, index, tmp, report)
    except (OSError, RuntimeError) as e:
        full = disk_full(job.output, e)
        if full is not None:
            raise full from e
        raise


def _write_shard(job: Job, index: int, tmp: str, report: Callable[[int, int], None] | None) -> dict[str, Any]:
    from array_record.python import array_record_module

    name = job.names[index]
    a, b = job.shards[index]
    final = os.path.join(job.output, name)
    writer = array_record_module.ArrayRecordWriter(tmp, job.writer_options)
    if not writer.ok():
        raise PrepareError(f"prepare: cannot create {tmp!r}")
    lengths: list[int] = []
    fields: dict[str, list[Any]] = {f: [] for f in job.fields}
    skipped: list[dict[str, str]] = []
    kind: str | None = None
    first_where = ""
    h_in = hashlib.sha256()
    try:
        for item in job.items[a:b]:
            done = 0
            for rec in read_item(
                item, jsonl_field=job.jsonl_field, columns=job.columns, fields=job.fields, member=job.member
            ):
                try:
                    if isinstance(rec, RecordError):
                        raise rec
                    _hash_input(h_in, rec.value if rec.raw is None else rec.raw)
                    made = _convert(job, item, rec)
                    for _, k, _, _ in made:
                        if kind is None:
                            kind, first_where = k, where_of(item, rec)
                        elif k != kind:
                            raise RecordError(
                                where_of(item, rec),
                                f"this record is {k}, the first of its shard ({first_where}) {kind}",
                            )
                except RecordError as e:
                    if not job.skip_errors:
                        raise PrepareError(f"prepare: {e}") from e.__cause__
                    skipped.append({"where": e.where, "error": e.message})
                    continue
                for data, _, length, values in made:
                    writer.write(data)
                    lengths.append(length)
                    for f, v in values.items():
                        fields[f].append(v)
                done += len(made)
            if report is not None:
                report(item.size, done)
        if not writer.ok():
            raise PrepareError(f"prepare: writing {name!r} failed (the ArrayRecord writer is not ok: disk full?)")
        writer.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        sidecar = {
            "file": name,
            "records": len(lengths),
            "bytes": os.path.getsize(tmp),
            "sha256": prepared.file_sha256(tmp),
            "type": kind,
            "lengths": lengths,
            "fields": fields,
            "skipped": skipped,
            "input_sha256": h_in.hexdigest(),
        }
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    os.makedirs(os.path.dirname(sidecar_path(job.output, name)), exist_ok=True)
    _atomic_json(sidecar_path(job.output, name), sidecar)
    return sidecar


def _hash_input(h: Any, value: Any) -> None:
    """Feed one input value to the input digest.

    Bytes and text as they are, arrays by dtype and bytes, anything else by its JSON form.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        h.update(b"b%d:" % len(value))
        h.update(value)
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(data))
        h.update(data)
    elif isinstance(value, np.ndarray):
        h.update(f"a{value.dtype.str}{value.shape}:".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        for k in sorted(value):
            _hash_input(h, str(k))
            _hash_input(h, value[k])
    else:
        h.update(b"j" + json.dumps(value, sort_keys=True, default=repr).encode())
