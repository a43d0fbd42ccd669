"""The commands of ``quern``: ``run``, ``explain``, ``inspect``, ``bench``, ``plan``, ``prepare``, and more.

The others are ``verify``, ``where`` and ``index``.

Each ``cmd_*`` takes the parsed arguments (:func:`~quern.pipeline.cli.parser.build_parser`),
prints its report on stdout (:mod:`quern.pipeline.cli.reports`) and returns the
exit status; what it raises, :func:`quern.pipeline.cli.main` turns into one
message and a status (:mod:`quern.pipeline.cli.failure`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ...prepare import prepare
from ..config import load_config
from ..config.limits import MAX_BYTES
from ..core.ops import DEVICE_KINDS
from ..core.progress import Bar
from ..core.tree import leaves
from ..definition.dataset import Pipeline
from ..integrity import checks as verify
from ..iterate.service import RayService
from ..sources import IndexedSource, JsonlSource, TFRecordSource, WebDatasetSource
from ..sources.indexed import data_files
from ..sources.prepared import MANIFEST
from . import bench, reports
from .failure import clip
from .parser import EXIT_DATA, EXIT_USAGE

__all__ = [
    "COMMANDS",
    "cmd_bench",
    "cmd_explain",
    "cmd_index",
    "cmd_inspect",
    "cmd_plan",
    "cmd_prepare",
    "cmd_run",
    "cmd_verify",
    "cmd_where",
]

VERIFY_STEPS = 8
"""The steps ``quern verify CONFIG`` compares without ``--steps``: the first 8."""


def _load(args: argparse.Namespace) -> Pipeline:
    """The pipeline of ``args.config``, with the ``--allow`` prefixes given before and after the command's name.

    A :class:`ConfigError` (which names the file) goes to :func:`main`.
    """
    allow = [*(getattr(args, "allow_before", None) or ()), *(getattr(args, "allow", None) or ())]
    return load_config(args.config, process_count=getattr(args, "process_count", 1), allow=allow)


def _read_state(path: str) -> Any:
    """The JSON of a state file, read at most :data:`~quern.pipeline.config.limits.MAX_BYTES`.

    A ``ValueError`` says why not (exit 2).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ValueError(str(e)) from e
    if len(raw) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES:,} bytes: not a state saved by quern")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's limit
        raise ValueError(f"not JSON: {e}") from e


def cmd_run(args: argparse.Namespace) -> int:
    """``quern run``: iterate the pipeline, print the throughput and the report of the steps run.

    A progress bar goes to stderr on a terminal; the state after the last step is
    saved with ``--save-state``.

    Args:
        args: The parsed arguments.

    Returns:
        The exit status: 0, or :data:`EXIT_USAGE` for a state file it cannot resume from.
    """
    pipe = _load(args)
    start = args.start_step
    if args.state:
        try:
            state = _read_state(args.state)
        except ValueError as e:
            print(clip(f"quern: cannot read the state file {args.state}: {e}"), file=sys.stderr)
            return EXIT_USAGE
        try:
            start = pipe.check_state(state, force=args.force)
        except (ValueError, TypeError, IndexError) as e:  # another pipeline's state, or a bad step in it
            message = str(e).replace("force=True", "--force")
            print(clip(f"quern: cannot resume from {args.state}: {message}"), file=sys.stderr)
            return EXIT_USAGE
    steps = args.steps
    start = pipe.check_step(start, name="start step", end_ok=True)  # past the end: main() exits 2
    if pipe.num_steps is not None:
        if pipe.num_steps - start < steps:
            steps = pipe.num_steps - start
            print(f"quern: the stream ends after step {pipe.num_steps - 1}: running {steps} steps", file=sys.stderr)
    ray = args.ray or args.ray_address is not None
    if args.actors is not None and not ray:
        raise ValueError("--actors applies to --ray (or --ray-address) only")
    if ray and args.workers:
        raise ValueError("--ray computes the steps on Ray actors: --workers does not apply (leave it at 0)")
    service = RayService(args.ray_address, num_actors=args.actors) if ray else None
    t0, records = time.perf_counter(), 0
    noun = reports.row_noun(pipe)
    report = reports.RunReport(pipe, start)
    try:
        # a bar on stderr when it is a terminal, closed (its line ended) before an error's message
        with Bar(steps, "quern run", unit="step", count=noun) as bar:
            with pipe.iterator(
                start_step=start,
                num_workers=args.workers,
                step_timeout=args.step_timeout,
                ledger=args.ledger,
                service=service,
            ) as it:
                for i in range(steps):
                    batch = next(it)
                    made = len(leaves(batch)[0][1])  # the step's records (rows)
                    records += made
                    report.add(start + i, batch, rows=made)
                    bar.update(1, made)
                state = it.state()
                figures = it.stats().get("service")
                tuning = it.stats().get("tuning")
    finally:
        if service is not None:
            service.close()
    seconds = time.perf_counter() - t0
    print(
        f"{steps} steps, {records:,} {noun} in {seconds:.2f} s: {records / max(seconds, 1e-9):,.0f} {noun}/s, "
        f"{steps / max(seconds, 1e-9):,.1f} steps/s; next step {state['step']}"
    )
    for line in report.lines(steps):
        print(line)
    if tuning:
        print(bench.tuning_line(tuning))
    if figures is not None:
        print(
            f"service: {figures['actors']} actor{'s' * (figures['actors'] != 1)} on {figures['address']}, "
            f"{figures['units']} units, "
            f"{figures['recomputations']} recomputed, {figures['hedges']} hedged"
        )
    if args.save_state:
        with open(args.save_state, "w") as f:
            json.dump(state, f)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """``quern explain``: which records make each row of one step's host slice (text or JSON).

    Args:
        args: The parsed arguments.

    Returns:
        The exit status, 0.
    """
    pipe = _load(args)
    where = (args.step, args.process_index, args.process_count)
    rows = pipe.explain(*where)  # bad arguments: main() exits 2
    first = pipe.positions(*where)
    if args.json:
        print(json.dumps(reports.explain_json(pipe, *where, first=first, rows=rows)))
    else:
        print("\n".join(reports.explain_lines(pipe, *where, first=first, rows=rows)))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """``quern inspect``: the shapes, dtypes, value summaries and padding of one batch.

    Args:
        args: The parsed arguments.

    Returns:
        The exit status, 0.
    """
    pipe = _load(args)
    batch = pipe.batch_at(args.step, args.process_index, args.process_count)  # errors: main() exits 1 or 2
    print(f"step {args.step}, host {args.process_index} of {args.process_count}")
    lines = reports.inspect_lines(pipe, args.step, args.process_index, args.process_count, batch=batch)
    for line in lines + reports.batch_lines(batch):
        print("  " + line)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``quern bench``: time each stage, then a training loop's data wait, and say where the data waits.

    The measurements are :mod:`quern.pipeline.cli.bench`'s; ``--plot`` draws them.

    Args:
        args: The parsed arguments.

    Returns:
        The exit status: 0, or :data:`EXIT_USAGE` for ``--plot`` without matplotlib.
    """
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("quern: bench --plot needs matplotlib: pip install 'quern[plot]'", file=sys.stderr)
            return EXIT_USAGE
    pipe = _load(args)
    end = pipe.check_step(args.start_step, name="start step") + args.steps  # past the end: main() exits 2
    if pipe.num_steps is not None:
        end = min(end, pipe.num_steps)
    steps = end - args.start_step
    noun = reports.row_noun(pipe)
    prof = bench.profile(pipe, args.start_step, count=steps)
    run = bench.loop(pipe, args.start_step, count=steps, num_workers=args.workers, step_s=args.step_ms / 1e3)
    diagnosis = bench.diagnose(pipe, run)
    device = [op.label(k) for k, op in enumerate(pipe.batch_ops) if op.kind in DEVICE_KINDS]
    lines = bench.report(prof, run, diagnosis=diagnosis, noun=noun, batch_size=pipe.batch_size, device_stages=device)
    print("\n".join(lines))
    if args.plot:
        bench.plot(prof, run, diagnosis=diagnosis, path=args.plot)
        print(f"plot: {args.plot}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """``quern prepare``: convert inputs to ArrayRecord shards with a manifest, and print what was written.

    The conversion is :func:`quern.prepare.prepare`'s.

    Args:
        args: The parsed arguments.

    Returns:
        The exit status, 0.
    """
    finished = os.path.exists(os.path.join(args.output, MANIFEST))
    t0 = time.perf_counter()
    split = lambda text: [x for x in (text or "").split(",") if x]  # noqa: E731
    m = prepare(
        args.inputs,
        args.output,
        map=args.map,
        fields=split(args.fields),
        shard_size=args.shard_size,
        num_workers=args.workers,
        ray=args.ray or args.ray_address is not None,
        ray_address=args.ray_address,
        skip_errors=args.skip_errors,
        format=args.format,
        field=args.field,
        member=args.member,
        columns=split(args.columns),
        include=args.include or (),
        compression=args.compression,
        labels_from_dirs=args.labels_from_dirs,
        max_side=args.max_side,
    )
    seconds = time.perf_counter() - t0
    count, total = m["records"]["count"], sum(s["bytes"] for s in m["shards"])
    skipped = m["skipped"]["count"]
    if finished:
        print(f"{args.output} is complete: {count:,} records in {len(m['shards'])} shards, every checksum verified")
        return 0
    print(
        f"prepared {count:,} records in {len(m['shards'])} shards ({total / 2**20:,.1f} MiB) in {args.output} "
        f"in {seconds:.2f} s: {count / seconds:,.0f} records/s, {total / 2**20 / seconds:,.1f} MiB/s"
        + (f"; skipped {skipped:,} (listed in the manifest)" if skipped else "")
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``quern verify``: step digests across topologies, a ledger against the data, or two ledgers.

    The checks are :mod:`quern.pipeline.integrity.checks`'s; the report (a summary line per
    topology or ledger, then the first difference) goes to stdout.

    Args:
        args: The parsed arguments.

    Returns:
        The exit status: 0 when all agree, :data:`EXIT_DATA` on a difference (or a ledger's gap,
        differing duplicate, torn line in the middle or bad line). Bad arguments, unreadable ledgers
        and ledgers with a line of another pipeline raise (exit 2).

    Raises:
        ValueError: arguments that do not go together, or a ledger that cannot be checked.
    """
    topology = args.hosts is not None or args.resume_at
    if args.compare:
        if args.ledger or topology or args.workers is not None or args.steps is not None:
            raise ValueError("verify --compare takes two ledgers (and an optional CONFIG) only")
        pipe = _load(args) if args.config else None
        result = verify.compare_ledgers(args.compare[0], args.compare[1], pipe=pipe)
    elif not args.config:
        raise ValueError("verify needs a CONFIG (or --compare LEDGER_A LEDGER_B)")
    elif args.ledger:
        if topology:
            raise ValueError("verify --ledger checks a run's own host slices: --hosts and --resume-at do not apply")
        workers = args.workers or [0]
        if len(workers) != 1:
            raise ValueError(f"verify --ledger takes one --workers count (the workers recomputing), got {workers}")
        result = verify.check_ledger(_load(args), args.ledger, steps=args.steps, num_workers=workers[0])
    else:
        pipe = _load(args)
        steps = args.steps
        if steps is None:
            end = VERIFY_STEPS if pipe.num_steps is None else min(VERIFY_STEPS, pipe.num_steps)
            steps = range(end)
        result = verify.compare_topologies(
            pipe,
            steps,
            hosts=args.hosts or [1, 2, 4],
            workers=args.workers if args.workers is not None else [0, 2],
            resume_at=args.resume_at,
        )
    for line in result.lines():
        print(line)
    return 0 if result.ok else EXIT_DATA


def cmd_where(args: argparse.Namespace) -> int:
    """``quern where``: the ``(step, row)`` pairs where a source record appears (``pipe.where``).

    Args:
        args: The parsed arguments.

    Returns:
        The exit status, 0 (a record out of range, or a stream that cannot answer: exit 2).
    """
    pipe = _load(args)
    pairs = pipe.where(args.record, component=args.component, epochs=args.epochs)
    if args.json:
        print(json.dumps([[s, r] for s, r in pairs]))
        return 0
    of = f" of component {args.component!r}" if args.component is not None else ""
    if not pairs:
        print(f"record {args.record}{of} appears in no row of the first {args.epochs} epoch(s)")
    for s, r in pairs:
        print(f"step {s} row {r}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``quern plan``: each host's reads, from the definition and the files' sizes (:func:`quern.plan_io`).

    Args:
        args: The parsed arguments.

    Returns:
        The exit status, 0 (hosts that do not divide the batch, steps past the end, a cache
        smaller than a shard: exit 2).
    """
    from ..definition.io_plan import plan_io

    pipe = _load(args)
    plan = plan_io(
        pipe, hosts=args.hosts, steps=args.steps, cache_bytes=args.cache, policy=args.policy, read_ahead=args.read_ahead
    )
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.text())
    return 0


def _index_kind(path: str, fmt: str | None) -> type[IndexedSource]:
    """The source class that reads ``path`` (by ``--format``, else by its name); a ``ValueError`` (exit 2) if none."""
    kinds: dict[str, type[IndexedSource]] = {
        "webdataset": WebDatasetSource,
        "tfrecord": TFRecordSource,
        "jsonl": JsonlSource,
    }
    if fmt is not None:
        return kinds[fmt]
    for kind in kinds.values():
        if path.lower().endswith(kind.SUFFIXES):
            return kind
    raise ValueError(
        f"index: cannot tell the format of {path!r} by its name (.tar, .tfrecord, .tfrecords, .tfrec, .jsonl, "
        ".ndjson, .json): give --format webdataset, tfrecord or jsonl"
    )


def cmd_index(args: argparse.Namespace) -> int:
    """``quern index``: write a sidecar index beside each file (:meth:`~quern.sources.IndexedSource.write_sidecars`).

    Args:
        args: The parsed arguments.

    Returns:
        The exit status, 0 (a file that cannot be indexed: exit 1, naming it and where; a sidecar
        named as a file: exit 2).
    """
    files = data_files(args.paths, "index")  # the sidecars a glob matches are left out
    groups: dict[type[IndexedSource], list[str]] = {}
    for path in files:
        groups.setdefault(_index_kind(path, args.format), []).append(path)
    done = {}
    for kind, paths in groups.items():
        t0 = time.perf_counter()
        for side in kind.write_sidecars([glob.escape(p) for p in paths], threads=args.threads):  # expanded
            done[side.path] = (kind, side)
        seconds = time.perf_counter() - t0
        size = sum(os.path.getsize(p) for p in paths)
        print(f"{kind.FORMAT}: {len(paths)} file(s), {size / 1e9:.3f} GB in {seconds:.2f} s")
    for path in files:
        kind, side = done[path]
        what = "written" if side.built else "already right, kept"
        print(f"{path}: {side.records:,} {kind.FORMAT} records; index {side.sidecar} {what}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "explain": cmd_explain,
    "inspect": cmd_inspect,
    "bench": cmd_bench,
    "plan": cmd_plan,
    "prepare": cmd_prepare,
    "verify": cmd_verify,
    "where": cmd_where,
    "index": cmd_index,
}
"""Each command's function, by the name :func:`~quern.pipeline.cli.parser.build_parser` parses."""
