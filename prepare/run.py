"""``prepare()``: plan, write the shards (here, in worker processes or on Ray), then the manifest.

Restarts, atomicity and the worker processes: ``docs/design/prepare.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..pipeline.core.deprecation import renamed
from ..pipeline.core.errors import PrepareError
from ..pipeline.core.progress import Bar
from ..pipeline.identity import samedef
from ..pipeline.identity.fingerprint import describe_callable, fingerprint_of
from ..pipeline.sources import prepared
from . import images as _images
from . import inputs as _inputs
from . import shards as _shards
from .inputs import Format
from .processes import in_processes, on_ray

__all__ = ["prepare", "parse_size", "resolve_map"]

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_MAX_SKIPPED_SHOWN = 100


def parse_size(text: str | int) -> int:
    """Bytes from a size such as ``"128MB"``, in binary units (1 KB = 1024 B).

    Args:
        text: ``"128MB"``, ``"512KB"``, ``"1GB"``, ``"4096"`` (case and spaces
            do not matter; ``MiB`` is ``MB``), or an int.

    Returns:
        The bytes, at least 1.

    Raises:
        ValueError: ``text`` is not a size, or under 1 byte.
        TypeError: ``text`` is neither an int nor a string.

    Example:
        >>> parse_size("128MB"), parse_size("1.5 KiB"), parse_size(4096)
        (134217728, 1536, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    elif isinstance(text, str):
        t = text.strip().upper().replace(" ", "").replace("IB", "B")
        num = t.rstrip("KMGTB")
        unit = t[len(num) :]
        if unit not in _UNITS or not num.replace(".", "", 1).isdigit():
            raise ValueError(f"a size must be bytes with an optional unit (512KB, 1MB, 128MB, 1GB), got {text!r}")
        n = int(float(num) * _UNITS[unit])
    else:
        raise TypeError(f"a size must be an int or a string like '128MB', got {text!r}")
    if n < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return n


def resolve_map(spec: str) -> Callable[[Any], Any]:
    """The function ``"package.module:function"`` names, imported.

    The current directory is searched first (the command line is its user's own
    code, not a config).

    Args:
        spec: ``"package.module:function"`` (``function`` may be dotted: ``Class.method``).

    Returns:
        The callable.

    Raises:
        ValueError: ``spec`` is malformed or names something not callable.
        ImportError: the module cannot be imported.
        AttributeError: the module has no such name.
    """
    from ..pipeline.config.trust import FN

    if not FN.fullmatch(spec):
        raise ValueError(f"--map must look like 'package.module:function', got {spec!r}")
    module_name, _, qualname = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--map {spec!r} is not callable")
    return obj


def _by_value(fn: Any) -> None:
    """Ship the map's module by value to processes that cannot import it.

    Those are a script or a module of the current directory, on Ray workers started elsewhere.
    """
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if module is None or file is None or module.__name__ == "__main__":
        return
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # quern itself
    if not any(os.path.abspath(file).startswith(os.path.abspath(r) + os.sep) for r in roots):
        cloudpickle.register_pickle_by_value(module)


class _Progress(Bar):
    """prepare's bar on stderr when it is a terminal; quiet otherwise.

    It shows the input bytes, with rates and ETA, and the records written and
    their rate. Called with each piece of progress.
    """

    def __init__(self, total: int, shown: bool | None) -> None:
        super().__init__(total, "quern prepare", unit="B", scale=1024, count="records", per="rec", shown=shown)

    def __call__(self, nbytes: int, records: int) -> None:
        self.update(nbytes, records)


# --------------------------------------------------------------------------- the folder


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):  # written in part (a full disk): never left behind
            os.remove(tmp)
        raise


@contextlib.contextmanager
def _full_disk_said(output: str) -> Iterator[None]:
    """A full disk under ``output`` raised as a :class:`PrepareError` that says so."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        full = _shards.disk_full(output, e)
        if full is None:
            raise
        raise full from e


def _check_output(output: str) -> None:
    """Raise ``ValueError`` if ``output`` (absolute), or the nearest of its folders that exists, is not a folder."""
    path = output
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        what = "a file" if os.path.isfile(path) else "a link to nothing, a FIFO or a device"
        where = f"the output {output!r}" if path == output else f"{path!r}, a folder of the output {output!r},"
        raise ValueError(f"prepare: {where} is {what}, not a folder; choose a new or empty folder for --output")


def _resume(output: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Clean an unfinished prepare of the same job.

    Temporaries are removed, finished shards whose checksum matches kept (their
    sidecars returned), the rest removed.
    """
    shutil.rmtree(_shards.tmp_dir(output), ignore_errors=True)
    kept: dict[str, dict[str, Any]] = {}
    for name in names:
        final, side = os.path.join(output, name), _shards.sidecar_path(output, name)
        record = None
        if os.path.exists(final) and os.path.exists(side):
            try:
                with open(side) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                record = None
            if record is not None and prepared.file_sha256(final) != record.get("sha256"):
                record = None
        if record is None:
            for p in (final, side):
                if os.path.exists(p):
                    os.remove(p)
        else:
            kept[name] = record
    _remove_temporaries(output)
    return kept


def _remove_temporaries(output: str) -> None:
    """The ``*.tmp`` files a killed run left in ``output`` and ``output/metadata``."""
    for folder in (output, os.path.join(output, "metadata")):
        if os.path.isdir(folder):
            for leftover in os.listdir(folder):
                if leftover.endswith(".tmp"):
                    os.remove(os.path.join(folder, leftover))


def _assemble(job: _shards.Job, sides: list[dict[str, Any]], head: dict[str, Any]) -> dict[str, Any]:
    """The metadata files and the manifest, from the shards' sidecars (in shard order)."""
    kinds = {s["type"] for s in sides if s["type"] is not None}
    if len(kinds) > 1:
        first = {k: next(s["file"] for s in sides if s["type"] == k) for k in sorted(kinds)}
        raise PrepareError(f"prepare: the records are not all of one type: {first} (bytes, or arrays of one dtype)")
    skipped = [e for s in sides for e in s["skipped"]]
    count = sum(s["records"] for s in sides)
    if count == 0:
        why = (
            f" ({len(skipped)} skipped for errors, the first: {skipped[0]['where']}: {skipped[0]['error']})"
            if skipped
            else ""
        )
        raise PrepareError(f"prepare: no record was prepared{why}")
    meta_dir = os.path.join(job.output, "metadata")
    os.makedirs(meta_dir, exist_ok=True)
    columns = {"length": np.asarray([n for s in sides for n in s["lengths"]], dtype=np.int64)}
    for f in job.fields:
        values = [v for s in sides for v in s["fields"][f]]
        dtype = (
            np.bool_
            if all(isinstance(v, bool) for v in values)
            else (np.int64 if all(isinstance(v, int) and not isinstance(v, bool) for v in values) else np.float64)
        )
        columns[f] = np.asarray(values, dtype=dtype)
    metadata = {}
    for f, arr in columns.items():
        import io

        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        data = buf.getvalue()
        rel = f"metadata/{f}.npy"
        _atomic_write(os.path.join(job.output, rel), data)
        metadata[f] = {"file": rel, "dtype": str(arr.dtype), "sha256": hashlib.sha256(data).hexdigest()}
    kind = kinds.pop() if kinds else "bytes"
    h = hashlib.sha256()
    for s in sides:
        h.update(s["input_sha256"].encode())
    manifest = {
        "format": prepared.FORMAT,
        "version": prepared.VERSION,
        **head,
        "input": {**head["input"], "sha256": h.hexdigest()},
        "records": {"count": count, "type": "bytes"}
        if kind == "bytes"
        else {"count": count, "type": "array", "dtype": kind},
        "shards": [{k: s[k] for k in ("file", "records", "bytes", "sha256")} for s in sides],
        "metadata": metadata,
        "skipped": {"count": len(skipped), "first": skipped[:_MAX_SKIPPED_SHOWN]},
    }
    _atomic_write(
        os.path.join(job.output, prepared.MANIFEST), (json.dumps(manifest, sort_keys=True, indent=1) + "\n").encode()
    )
    return manifest


@renamed(workers="num_workers")
def prepare(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    map: Callable[[Any], Any] | str | None = None,
    fields: Sequence[str] = (),
    shard_size: int | str = "128MB",
    num_workers: int | None = None,
    ray: bool = False,
    ray_address: str | None = None,
    skip_errors: bool = False,
    format: Format | None = None,
    field: str | None = None,
    member: str | None = None,
    columns: Sequence[str] = (),
    include: Sequence[str] = (),
    compression: str = _shards.COMPRESSION,
    progress: bool | None = None,
    labels_from_dirs: bool = False,
    max_side: int | None = None,
) -> dict[str, Any]:
    """Convert ``inputs`` to ArrayRecord shards in the folder ``output``, with a manifest and a metadata index.

    The output is byte-identical for any ``num_workers``, local or on Ray, and
    for any output folder: it depends only on the inputs' records, the map and
    the options. A run killed and run again keeps its finished shards; nothing
    has its final name before it is complete (see ``docs/design/prepare.md``).

    Args:
        inputs: a path or a list of paths (globs allowed): directories of small
            files (a record per file: its bytes), JSON-lines files (a record per
            line: the line, or its ``field``), Parquet files (a record per row: its
            one column of ``columns``, or with a ``map`` a dict of them),
            ArrayRecord files or prepared folders (re-sharded), WebDataset tar
            shards (a record per sample: the sample kept whole as a tar of its own,
            which :func:`quern.pipeline.sources.webdataset.read_sample` reads
            back, or its ``member``; a ``map`` receives the sample dict
            ``{"__key__": str, ext: bytes}``) and TFRecord files (a record per
            record: its bytes).
        output: the output folder: new, empty, or holding a prepare of the same job.
        map: turns each record into the stored one (a callable or
            ``"module:function"``). It returns ``bytes``, ``str`` (stored as
            UTF-8), a 1-D numpy array (stored as its raw bytes; every record the
            same dtype), or a dict holding one of these under ``"record"`` and the
            scalar ``fields`` beside it; or a list of these, each stored as a
            record in list order (a document cut into chunks).
        fields: scalar fields kept in the metadata index beside ``length``
            (without a map, read from the JSON objects or Parquet columns).
        shard_size: about the bytes of a shard (``"128MB"``, or an int).
        num_workers: 0 writes the shards in this process, N in N spawned processes
            (default: the CPU count; in a script, call ``prepare`` under
            ``if __name__ == "__main__":``, as for any spawned process). With
            ``ray``, the CPUs of a new local cluster.
        ray: write the shards as Ray tasks (a new local cluster, or the one at
            ``ray_address``; every node must see the input and output folders).
        ray_address: the Ray cluster to use.
        skip_errors: skip records that cannot be read or mapped (counted in the
            manifest) instead of raising.
        format: the kind of every input (default: by name, see ``docs/design/prepare.md``).
        field: the JSON field holding the record.
        member: WebDataset: the extension of the member that is the record
            (``"jpg"``; case and a leading dot do not matter; a ``map`` receives its
            bytes). A sample without it cannot be read (``skip_errors`` counts it).
        columns: the Parquet columns to read.
        include: glob patterns a directory's files must match (relative paths, e.g. ``"*.py"``).
        compression: each record's compression: ``zstd:N``, ``brotli:N``,
            ``snappy`` or ``uncompressed`` (``snappy`` and ``uncompressed`` read
            faster, ``zstd`` is smaller).
        progress: draw a progress bar (default: when stderr is a terminal).
        labels_from_dirs: image folders (``INPUT/CLASS/FILE``): each file's ``label`` is its class
            folder's index among them sorted by name (listed in the manifest), in the metadata with
            ``width`` and ``height`` (:mod:`quern.prepare.images`); not with ``map``.
        max_side: image files: shrink those whose longer side is larger to it, once (recorded in the
            manifest); with it (or ``labels_from_dirs``) every file must be a JPEG or PNG.

    Returns:
        The manifest (as written to ``output/manifest.json``).

    Raises:
        PrepareError: an input cannot be read or mapped (naming the file and
            line), changed during the run, holds no record, or the disk is full.
        ValueError: an option is invalid, or ``output`` holds something else
            than a prepare of the same job.
        TypeError: ``map`` is not callable.

    Example:
        >>> import pathlib, shutil, tempfile
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "docs").mkdir()
        >>> for name in ("a.txt", "b.txt"):
        ...     _ = (root / "docs" / name).write_text(f"text of {name}")
        >>> manifest = prepare(root / "docs", root / "out", num_workers=0, progress=False)
        >>> manifest["records"]["count"], [s["file"] for s in manifest["shards"]]
        (2, ['shard-00000-of-00001.array_record'])
        >>> shutil.rmtree(root)
    """
    output = os.path.abspath(os.fspath(output))
    _check_output(output)
    given = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    if not given:
        raise ValueError("prepare: no input given")
    size = parse_size(shard_size)
    fields = tuple(fields)
    if "length" in fields or "record" in fields:
        raise ValueError("prepare: 'length' is always in the metadata, and 'record' names the record: not fields")
    bad = [
        f for f in fields if not isinstance(f, str) or f in ("", ".", "..") or any(c in "/\\" or ord(c) < 32 for c in f)
    ]
    if bad:  # each field is the file metadata/<field>.npy: one plain file name (readers refuse any other)
        raise ValueError(f"prepare: field name {bad[0]!r} is not a plain file name (no '/', '\\' or control character)")
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
        raise ValueError(f"prepare: num_workers must be an int >= 0, got {num_workers!r}")
    options_text = _shards.writer_options(compression)
    spec = map if isinstance(map, str) else None
    fn = resolve_map(map) if isinstance(map, str) else map
    if fn is not None and not callable(fn):
        raise TypeError(f"prepare: map must be callable or 'module:function', got {fn!r}")
    if member is not None:
        if not isinstance(member, str) or not member.strip(". ") or "/" in member:
            raise ValueError(f"prepare: member must be a member's extension such as 'jpg', got {member!r}")
        member = member.strip().lstrip(".").lower()  # WebDataset lowercases extensions
    chunk = max(4096, min(_inputs.CHUNK, size // 4))  # items well under a shard: shards end near their size
    items, described = _inputs.list_items(
        given, fmt=format, include=tuple(include), columns=tuple(columns), output=output, chunk=chunk
    )
    if not items:
        pattern = f" matching {list(include)}" if include else ""
        raise PrepareError(f"prepare: no input record: {given} hold no file{pattern}")
    if member is not None and not any(it.kind == "webdataset" for it in items):
        raise ValueError("prepare: member applies to WebDataset tar shards, and no input is one")
    images = None
    if labels_from_dirs or max_side is not None:
        if fn is not None:
            raise ValueError("prepare: labels_from_dirs and max_side make the image records; leave map out")
        if any(it.kind != "file" for it in items):
            raise ValueError("prepare: labels_from_dirs and max_side take folders of image files")
        images = _images.image_records([it.name for it in items], labels_from_dirs, max_side)
        fields = tuple(dict.fromkeys(images.fields() + fields))
    map_desc = None
    if fn is not None:
        name = spec or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        map_desc = {"fn": name, "fingerprint": fingerprint_of({"map": describe_callable(fn, f"map {name}")})}
    options = {
        "shard_size": size,
        "fields": list(fields),
        "field": field,
        "columns": list(columns),
        "include": list(include),
        "format": format,
        "skip_errors": bool(skip_errors),
        "writer_options": options_text,
    }
    if member is not None:  # only when given: the jobs of earlier versions keep their hash
        options["member"] = member
    if images is not None:
        options["images"] = images.describe()
    job_key = fingerprint_of(
        {"version": prepared.VERSION, "items": _inputs.describe_inputs(items), "map": map_desc, "options": options}
    )
    head = {
        "quern_version": _version(),
        "job": job_key,
        "input": {
            "inputs": described,
            "order": "inputs as given; a directory's files by relative path; records in file order",
        },
        "map": map_desc,
        "options": options,
    }
    manifest_path = os.path.join(output, prepared.MANIFEST)
    plan_path = os.path.join(output, prepared.STAGING, "plan.json")
    files_key = _inputs.describe_files(items)  # a rerun keeps finished shards only of the very same files
    if os.path.exists(manifest_path):
        m = prepared.open_manifest(output)
        if m.get("job") != job_key:
            raise ValueError(
                f"prepare: {output!r} holds the manifest of another prepare (other input, map or options); "
                "choose another --output, or remove that folder"
            )
        prepared.verify(output, m)
        shutil.rmtree(os.path.join(output, prepared.STAGING), ignore_errors=True)  # killed after the manifest
        _remove_temporaries(output)
        return m
    job = _shards.Job(
        items, [], [], output, fn, fields, field, tuple(columns), bool(skip_errors), options_text, member=member
    )
    job.images = images
    if fn is not None:  # what the worker processes and Ray tasks check they loaded (samedef)
        job.map_definition = samedef.definition(fn, f"map {name}")
    kept: dict[str, dict[str, Any]] = {}
    if os.path.exists(plan_path):
        try:
            with open(plan_path) as f:
                plan = json.load(f)
        except (OSError, ValueError):
            plan = {}
        if plan.get("job") == job_key and plan.get("files") == files_key:
            job.shards = [(int(a), int(b)) for a, b in plan["shards"]]
            job.names = _shards.shard_names(len(job.shards))
            kept = _resume(output, job.names)
        else:  # an unfinished prepare of other input, map or options, or of inputs changed since (its shards hold
            # what they were): its files go, the new one starts
            theirs = {*_shards.shard_names(len(plan.get("shards", []))), prepared.STAGING, "metadata"}
            others = [n for n in os.listdir(output) if n not in theirs and not n.endswith(".tmp")]
            if others:
                raise ValueError(
                    f"prepare: the output folder {output!r} holds an unfinished prepare of another job and other "
                    f"files ({sorted(others)[:5]}); choose a new or empty folder"
                )
            why = "of inputs changed since" if plan.get("job") == job_key else "of another job"
            print(f"quern prepare: {output} holds an unfinished prepare {why}; starting over", file=sys.stderr)
            _remove_temporaries(output)
            for name in _shards.shard_names(len(plan.get("shards", []))):
                if os.path.exists(os.path.join(output, name)):
                    os.remove(os.path.join(output, name))
            shutil.rmtree(os.path.join(output, prepared.STAGING))
            shutil.rmtree(os.path.join(output, "metadata"), ignore_errors=True)
    if not job.names:
        if os.path.isdir(output) and os.listdir(output):
            raise ValueError(
                f"prepare: the output folder {output!r} is not empty and holds no quern prepare; "
                "choose a new or empty folder"
            )
        ratio = _shards.expansion(job)
        job.shards = _shards.plan_shards([it.size for it in items], size, ratio=ratio)
        job.names = _shards.shard_names(len(job.shards))
        with _full_disk_said(output):
            os.makedirs(os.path.join(output, prepared.STAGING), exist_ok=True)
            plan = {"job": job_key, "files": files_key, "shards": job.shards, "ratio": ratio}
            _atomic_write(plan_path, json.dumps(plan).encode())
    if fn is not None:
        _by_value(fn)
    todo = [i for i, n in enumerate(job.names) if n not in kept]
    bar = _Progress(sum(it.size for it in items), progress)
    for n, side in kept.items():
        a, b = job.shards[job.names.index(n)]
        bar(sum(it.size for it in items[a:b]), side["records"])
    try:  # a full disk is said by write_shard, here and in worker processes or Ray tasks
        n_workers = (os.cpu_count() or 1) if num_workers is None else num_workers
        if not todo:
            done: list[dict[str, Any]] = []
        elif ray:
            done = on_ray(job, todo, address=ray_address, num_workers=num_workers, progress=bar)
        elif n_workers == 0 or len(todo) == 1:
            done = [_shards.write_shard(job, i, report=bar) for i in todo]
        else:
            done = in_processes(job, todo, num_workers=n_workers, progress=bar)
    finally:
        bar.close()
    _inputs.check_unchanged(items)  # every input is still the file listed: nothing read of it mixes two versions
    by_name = {**kept, **{s["file"]: s for s in done}}
    with _full_disk_said(output):
        manifest = _assemble(job, [by_name[n] for n in job.names], head)
    shutil.rmtree(os.path.join(output, prepared.STAGING), ignore_errors=True)
    return manifest


def _version() -> str:
    from .. import __version__

    return __version__
