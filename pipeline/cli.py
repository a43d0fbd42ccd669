"""The ``quern`` command: run, explain, inspect and bench a pipeline config.

    quern run CONFIG [--steps N] [--start-step S] [--workers W] [--state FILE [--force]] [--save-state FILE]
    quern explain CONFIG --step S [--process-index H --process-count N] [--json]
    quern inspect CONFIG --step S [--process-index H --process-count N]
    quern bench CONFIG [--steps N] [--start-step S] [--workers W] [--step-ms MS] [--plot OUT.png]
    quern prepare INPUT... --output DIR [--map MODULE:FN] [--workers N] [--shard-size 128MB] [--fields A,B]
                  [--format F] [--field NAME] [--columns A,B] [--include GLOB] [--compression C]
                  [--skip-errors] [--ray [--ray-address A]]
    quern --version

``python -m quern ...`` is the same command. ``--traceback`` (before or after
the command's name) prints the full traceback of an error. ``--allow PREFIX``
(repeatable, before or after the command's name) lets the config name
functions of modules under ``PREFIX`` (``mypkg`` allows ``mypkg`` and
``mypkg.sub``), as ``QUERN_ALLOW=PREFIX,...`` does; otherwise a config names
only registered transforms and modules in its own folder (see "What a config
may run" in :mod:`quern.pipeline.config`), and anything else is refused before
it is imported, with exit status 2.

For a mixture (a config with ``mix:``), ``explain`` names each row's component
(``web[123]``: record 123 of component ``web``'s source), and ``explain``,
``inspect`` and ``run`` print the proportions of rows each component actually
gave over the step(s) shown or run: ``components drawn: web 0.897, code 0.103
(steps 0-99, 6,400 rows)``, counted from the plan (pure index arithmetic, no
record is read for it).

For a packed pipeline (a config with ``pack:``), ``inspect`` and ``run`` print
the fill (real tokens / (rows x ``seq_len``)) and padding (``1 - fill``) of the
step shown or the steps run: ``packing: fill 0.981, padding 0.019, 212
documents (step 3, 64 rows of 2048 tokens)``, and ``run`` also the lowest and
highest fill of one step; ``explain`` prints the same line and lists every
document of each row, with the tokens of each row (a piece of a document cut
over rows is shown with its token range: ``toks[12][2048:3000]``). A document
cut over several rows counts once in each. All of it comes from the plan
(:meth:`~quern.Pipeline.pieces`: pure index arithmetic, no record is read for
it).

For a bucketed pipeline (a config with ``bucket:``), ``inspect`` prints the
step's bucket, rows and padding (padded slots / (rows x the bucket's bound)):
``bucket len<=512: 32 rows, padding 0.231 (step 3)``; ``run`` prints one line
per bucket the steps run went to (``bucket len<=512: 40 steps, 1,280 rows,
padding 0.231``) and one for all of them, with the lowest and highest padding of
one step (``bucketing: padding 0.240 (steps 0-99, 3,200 rows); padding per
step: min 0.102 (step 5), max 0.391 (step 17)``); ``explain`` prints the
step's bucket and rows. The bucket of a step comes from the plan (index
arithmetic); the real tokens of its rows from the bucketing's length index when
it keeps one, otherwise from the ``length`` values of the batch just made (what
the padding wrote), so no record is read twice; without either (a batch
transform that drops ``length``) the padding is left out.

Errors are one message on stderr, ``quern: ...``, never a traceback (unless
``--traceback``), and the exit status says whose they are:

- 0: done.
- 1: the data failed while batches were being made: a transform raised, a
  record could not be read or collated (:class:`~quern.StepError`, which names
  the step, host slice, stage and records, and the original error), a source
  failed (:class:`~quern.SourceError`), a filter's predicate raised while the
  filter scanned its records (:class:`~quern.ScanError`, which names the
  config key of the filter), worker processes could not start or kept dying
  (:class:`~quern.WorkerError`); also any unexpected error.
- 2: the command could not start from what it was given: bad arguments, a
  config that does not load (:class:`~quern.ConfigError`, which covers data
  files that cannot be found or opened, and functions the config may not
  import), a step outside the stream, a state file that is unreadable, too
  large, not a state (a step that is not an integer: ``"3"``, ``3.0``,
  ``true``) or saved from another pipeline.
- 130: interrupted (Ctrl-C).

A message is bounded: at most :data:`MAX_MESSAGE` characters (``--traceback``
shows all of it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from typing import Any

import numpy as np

from .. import __version__
from ..prepare import prepare
from . import bench
from .config import load_config
from .dataset import Pipeline
from .errors import (
    CollateError,
    ConfigError,
    FingerprintError,
    PrepareError,
    ScanError,
    SourceError,
    StepError,
    WorkerError,
)
from .limits import MAX_BYTES
from .plan import mixture as _mixture
from .progress import Bar
from .sources.prepared import MANIFEST
from .tree import leaves

__all__ = ["main"]


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


EXIT_DATA = 1
"""Exit status when the data fails while batches are made (see the module docstring)."""
EXIT_USAGE = 2
"""Exit status when the arguments, the config or the state file are bad."""
EXIT_INTERRUPTED = 130
MAX_MESSAGE = 4000
"""The most characters of one error message (the rest is left out; ``--traceback`` shows it)."""

_DATA_ERRORS = (StepError, SourceError, WorkerError, CollateError, ScanError, PrepareError)
_USAGE_ERRORS = (ValueError, IndexError, OSError, FingerprintError)  # ConfigError is a ValueError
_OWN_ERRORS = (*_DATA_ERRORS, ConfigError, FingerprintError)  # their messages say what failed without the class name


def _load(args: argparse.Namespace) -> Pipeline:
    """The pipeline of ``args.config``, with the ``--allow`` prefixes given before and after
    the command's name; a :class:`ConfigError` (which names the file) goes to :func:`main`."""
    allow = [*(getattr(args, "allow_before", None) or ()), *(getattr(args, "allow", None) or ())]
    return load_config(args.config, process_count=getattr(args, "process_count", 1), allow=allow)


def _read_state(path: str) -> Any:
    """The JSON of a state file, read at most :data:`~quern.pipeline.limits.MAX_BYTES`;
    a ``ValueError`` saying why not (exit 2)."""
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


def _drawn(pipe: Pipeline, counts: np.ndarray, what: str) -> str:
    """``components drawn: web 0.897, code 0.103 (what, 6,400 rows)``: the share of
    ``counts`` (rows per component, in the mixture's order) of each component."""
    total = int(counts.sum())
    shares = ", ".join(f"{name} {c / max(total, 1):.3f}" for name, c in zip(pipe.leaf_names, counts.tolist()))
    return f"components drawn: {shares} ({what}, {total:,} rows)"


def _draws_before(pipe: Pipeline, position: int) -> np.ndarray:
    """Rows each component of a mixture gave at the stream positions before ``position``,
    from the plan (what :meth:`Pipeline.segments` of all those positions would count)."""
    m = pipe.mixture
    assert m is not None
    return np.asarray(_mixture.draws_before(m.stages, m.seed, pipe.batch_size or 1, m.block, position), dtype=np.int64)


def _count(pipe: Pipeline, first: int, end: int) -> np.ndarray:
    """Rows per component of a mixture at the stream positions ``[first, end)``, from the
    plan: no record is read, and the cost does not grow with the range."""
    return _draws_before(pipe, end) - _draws_before(pipe, first)


def _packing(pipe: Pipeline, tokens: int, rows: int, documents: int, what: str) -> str:
    """``packing: fill 0.981, padding 0.019, 212 documents (what, 64 rows of 2048 tokens)``."""
    assert pipe.packing is not None
    seq_len = pipe.packing.seq_len
    fill = tokens / max(rows * seq_len, 1)
    return (
        f"packing: fill {fill:.3f}, padding {1 - fill:.3f}, {documents:,} documents "
        f"({what}, {rows:,} rows of {seq_len} tokens)"
    )


PACK_CHUNK = 1 << 16
"""Rows of a packed stream planned at once by :func:`_per_step` (bounds its memory)."""


def _per_step(pipe: Pipeline, start: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, rows and documents (pieces) of each of the ``steps`` steps from ``start`` of a
    packed pipeline (host 0 of 1), from the plan, in chunks of whole steps."""
    b = pipe.batch_size or 1
    tokens, rows, docs = (np.zeros(steps, dtype=np.int64) for _ in range(3))
    chunk = max(1, PACK_CHUNK // b)
    for lo in range(start, start + steps, chunk):
        hi = min(lo + chunk, start + steps)
        first, end = int(pipe.positions(lo)[0]), int(pipe.positions(hi - 1)[-1]) + 1  # host 0 of 1: one range
        positions = np.arange(first, end, dtype=np.int64)
        pieces = pipe.pieces(positions)
        step_of_row = positions // b - start
        step_of_piece = step_of_row[pieces.row]
        tokens += np.bincount(step_of_piece, weights=pieces.length, minlength=steps).astype(np.int64)
        docs += np.bincount(step_of_piece, minlength=steps)
        rows += np.bincount(step_of_row, minlength=steps)
    return tokens, rows, docs


def _pieces_text(pipe: Pipeline, name: str, ids: list[int], starts: list[int], lengths: list[int]) -> str:
    """``toks[5], toks[12][2048:3000]``: the documents of one packed row; a piece that is not
    the whole document with its token range."""
    assert pipe.packing is not None
    whole = pipe.packing.lengths
    return ", ".join(
        f"{name}[{i}]" if s == 0 and n == int(whole[i]) else f"{name}[{i}][{s}:{s + n}]"
        for i, s, n in zip(ids, starts, lengths)
    )


def _bucket(pipe: Pipeline, steps: np.ndarray) -> np.ndarray:
    """The bucket (an index into the bucketing's components) of each of ``steps`` (the plan)."""
    assert pipe.bucketing is not None
    return pipe.bucketing.assign(np.asarray(steps, dtype=np.int64))[0]


def _bound(pipe: Pipeline, bucket: int) -> int:
    """The upper bound (the padded length) of a bucket (an index into the components)."""
    bk = pipe.bucketing
    assert bk is not None
    return bk.boundaries[bk.buckets[bucket]]


def _real_tokens(pipe: Pipeline, step: int, batch: Any, process_index: int = 0, process_count: int = 1) -> int | None:
    """The real (unpadded) tokens of a bucketed step's rows: from the bucketing's length index
    when it keeps one (index arithmetic), else from the ``length`` values of ``batch`` (the
    step's batch, already made); ``None`` when neither is there."""
    bk = pipe.bucketing
    assert bk is not None
    lengths = getattr(bk, "lengths", None)
    if lengths is not None:
        c, k = bk.assign(np.asarray([step], dtype=np.int64))
        part = bk.components[int(c[0])]
        ids = part.record_ids(part.positions(int(k[0]), process_index, process_count))
        return int(np.minimum(np.asarray(lengths)[ids], _bound(pipe, int(c[0]))).sum())
    if isinstance(batch, dict) and "length" in batch:
        values = np.asarray(batch["length"])
        if values.dtype.kind in "iu":
            return int(values.sum())
    return None


def _padding(real: int | None, rows: int, bound: int) -> str:
    return "" if real is None else f", padding {1 - real / max(rows * bound, 1):.3f}"


def _bucket_line(pipe: Pipeline, bucket: int, rows: int, real: int | None, what: str) -> str:
    """``bucket len<=512: 32 rows, padding 0.231 (what)``: one step's bucket."""
    assert pipe.bucketing is not None
    name = pipe.bucketing.names[bucket]
    return f"bucket {name}: {rows:,} rows{_padding(real, rows, _bound(pipe, bucket))} ({what})"


def _bucket_lines(pipe: Pipeline, start: int, rows: list[int], reals: list[int | None]) -> list[str]:
    """The lines ``run`` prints for the steps from ``start`` of a bucketed pipeline (their rows
    and real tokens): one per bucket they went to, then one for all of them."""
    bk = pipe.bucketing
    assert bk is not None
    steps = len(rows)
    buckets = _bucket(pipe, np.arange(start, start + steps))
    bounds = np.asarray([_bound(pipe, int(b)) for b in buckets], dtype=np.int64)
    n = np.asarray(rows, dtype=np.int64)
    known = all(r is not None for r in reals)
    real = np.asarray([r or 0 for r in reals], dtype=np.int64)
    lines = []
    for b in np.unique(buckets).tolist():
        sel = buckets == b
        got = int(real[sel].sum()) if known else None
        lines.append(
            f"bucket {bk.names[b]}: {int(sel.sum()):,} steps, {int(n[sel].sum()):,} rows"
            + _padding(got, int(n[sel].sum()), _bound(pipe, b))
        )
    total = f"({_steps(start, steps)}, {int(n.sum()):,} rows)"
    if not known:
        lines.append(f"bucketing: {total}; padding unknown (the batches have no 'length')")
        return lines
    slots = n * bounds
    lines.append(f"bucketing: padding {1 - int(real.sum()) / max(int(slots.sum()), 1):.3f} {total}")
    if steps > 1:
        pads = 1 - real / np.maximum(slots, 1)
        lines[-1] += (
            f"; padding per step: min {pads.min():.3f} (step {start + int(pads.argmin())}), "
            f"max {pads.max():.3f} (step {start + int(pads.argmax())})"
        )
    return lines


def _steps(start: int, steps: int) -> str:
    return f"step {start}" if steps == 1 else f"steps {start}-{start + steps - 1}"


def cmd_run(args: argparse.Namespace) -> int:
    pipe = _load(args)
    start = args.start_step
    if args.state:
        try:
            state = _read_state(args.state)
        except ValueError as e:
            print(_clip(f"quern: cannot read the state file {args.state}: {e}"), file=sys.stderr)
            return EXIT_USAGE
        try:
            start = pipe.check_state(state, force=args.force)
        except (ValueError, TypeError, IndexError) as e:  # another pipeline's state, or a bad step in it
            message = str(e).replace("force=True", "--force")
            print(_clip(f"quern: cannot resume from {args.state}: {message}"), file=sys.stderr)
            return EXIT_USAGE
    steps = args.steps
    start = pipe.check_step(start, "start step", end_ok=True)  # past the end: main() exits 2
    if pipe.num_steps is not None:
        if pipe.num_steps - start < steps:
            steps = pipe.num_steps - start
            print(f"quern: the stream ends after step {pipe.num_steps - 1}: running {steps} steps", file=sys.stderr)
    t0, records = time.perf_counter(), 0
    noun = "rows" if _packed_rows(pipe) else "records"  # a packed row holds several records
    step_rows: list[int] = []  # of each step, and its real tokens: a bucketed pipeline's padding
    reals: list[int | None] = []
    # a bar on stderr when it is a terminal, closed (its line ended) before an error's message
    with Bar(steps, "quern run", unit="step", count=noun) as bar:
        with pipe.iterator(start_step=start, num_workers=args.workers, step_timeout=args.step_timeout) as it:
            for i in range(steps):
                batch = next(it)
                made = len(leaves(batch)[0][1])  # the step's records (rows)
                records += made
                if pipe.bucketing is not None:
                    step_rows.append(made)
                    reals.append(_real_tokens(pipe, start + i, batch))
                bar.update(1, made)
            state = it.state()
    seconds = time.perf_counter() - t0
    print(
        f"{steps} steps, {records:,} {noun} in {seconds:.2f} s: {records / max(seconds, 1e-9):,.0f} {noun}/s, "
        f"{steps / max(seconds, 1e-9):,.1f} steps/s; next step {state['step']}"
    )
    if pipe.mixture is not None and steps > 0:  # host 0 of 1: the steps' positions are one range
        first, end = int(pipe.positions(start)[0]), int(pipe.positions(start + steps - 1)[-1]) + 1
        print(_drawn(pipe, _count(pipe, first, end), _steps(start, steps)))
    if pipe.packing is not None and steps > 0:
        tokens, rows, docs = _per_step(pipe, start, steps)
        line = _packing(pipe, int(tokens.sum()), int(rows.sum()), int(docs.sum()), _steps(start, steps))
        if steps > 1:
            fills = tokens / np.maximum(rows * pipe.packing.seq_len, 1)
            line += (
                f"; fill per step: min {fills.min():.3f} (step {start + int(fills.argmin())}), max {fills.max():.3f}"
            )
        print(line)
    if pipe.bucketing is not None and steps > 0:
        print("\n".join(_bucket_lines(pipe, start, step_rows, reals)))
    if args.save_state:
        with open(args.save_state, "w") as f:
            json.dump(state, f)
    return 0


def _packed_rows(pipe: Pipeline) -> bool:
    """Whether the rows of ``pipe`` are packed rows (of it, or of a mixture's components)."""
    if pipe.packing is not None:
        return True
    return pipe.mixture is not None and any(c.packing is not None for c in pipe.mixture.components)


def cmd_explain(args: argparse.Namespace) -> int:
    pipe = _load(args)
    rows = pipe.explain(args.step, args.process_index, args.process_count)  # bad arguments: main() exits 2
    first = pipe.positions(args.step, args.process_index, args.process_count)
    counts = None
    if pipe.mixture is not None:  # the rows' components, from the plan (a packed row names several records)
        counts = np.bincount(pipe.segments(first).component, minlength=len(pipe.leaf_names))
    bucket = None
    if pipe.bucketing is not None:  # the step's bucket and, when the bucketing keeps its index, the padding
        bucket = int(_bucket(pipe, np.asarray([args.step]))[0])
        real = _real_tokens(pipe, args.step, None, args.process_index, args.process_count)
    if pipe.packing is not None:  # explain's documents, with where each piece is
        pieces = pipe.pieces(first)
        cut = np.searchsorted(pieces.row, np.arange(len(first) + 1), side="left").tolist()
        spans = [(pieces.start[a:b].tolist(), pieces.length[a:b].tolist()) for a, b in zip(cut, cut[1:])]
        tokens = [int(sum(n)) for _, n in spans]
        summary = _packing(pipe, sum(tokens), len(first), len(pieces.row), _steps(args.step, 1))
    if args.json:
        out: dict[str, Any] = {
            "step": args.step,
            "process_index": args.process_index,
            "process_count": args.process_count,
            "rows": [
                {"row": i, "position": int(p), "records": [[n, r] for n, r in recs]}
                for i, (p, recs) in enumerate(zip(first.tolist(), rows))
            ],
        }
        if counts is not None:
            out["components"] = dict(zip(pipe.leaf_names, counts.tolist()))
        if bucket is not None:
            assert pipe.bucketing is not None
            bound = _bound(pipe, bucket)
            out["bucket"] = {"name": pipe.bucketing.names[bucket], "bound": bound, "rows": len(first)}
            if real is not None:
                out["bucket"]["padding"] = 1 - real / max(len(first) * bound, 1)
        if pipe.packing is not None:
            seq_len = pipe.packing.seq_len
            for row, n, (starts, lengths) in zip(out["rows"], tokens, spans):
                row["tokens"], row["pieces"] = n, [[s, s + k] for s, k in zip(starts, lengths)]
            fill = sum(tokens) / max(len(first) * seq_len, 1)
            out["packing"] = {
                "seq_len": seq_len,
                "rows": len(first),
                "tokens": sum(tokens),
                "documents": len(pieces.row),
                "fill": fill,
                "padding": 1 - fill,
            }
        print(json.dumps(out))
    else:
        print(f"step {args.step}, host {args.process_index} of {args.process_count}: {len(rows)} rows")
        if counts is not None:
            print("  " + _drawn(pipe, counts, _steps(args.step, 1)))
        if bucket is not None:
            print("  " + _bucket_line(pipe, bucket, len(first), real, _steps(args.step, 1)))
        if pipe.packing is not None:
            print("  " + summary)
            for i, (p, recs) in enumerate(zip(first.tolist(), rows)):
                starts, lengths = spans[i]
                text = _pieces_text(pipe, pipe.leaf_names[0], [r for _, r in recs], starts, lengths)
                print(f"  row {i:4d}  position {p}  {tokens[i]} tokens  {text}")
            return 0
        for i, (p, recs) in enumerate(zip(first.tolist(), rows)):
            print(f"  row {i:4d}  position {p}  " + ", ".join(f"{n}[{r}]" for n, r in recs))
    return 0


def _summary(path: str, leaf: Any) -> str:
    """One line about one array of a batch: dtype, shape, and min/max/mean (and zeros) of numbers."""
    x = np.asarray(leaf)
    line = f"{path}: {x.dtype} {x.shape}"
    if x.dtype.kind in "biuf" and x.size:
        line += f"  min {x.min()}  max {x.max()}  mean {x.astype(np.float64).mean():.4g}"
        if x.ndim >= 2:
            line += f"  zeros {np.mean(x == 0):.1%}"
    elif x.dtype == object and x.size:
        line += f"  e.g. {x.flat[0]!r}"[:120]
    return line


def cmd_inspect(args: argparse.Namespace) -> int:
    pipe = _load(args)
    batch = pipe.batch_at(args.step, args.process_index, args.process_count)  # errors: main() exits 1 or 2
    print(f"step {args.step}, host {args.process_index} of {args.process_count}")
    if pipe.mixture is not None:  # the plan of the rows just read: index arithmetic, no second read
        seg = pipe.segments(pipe.positions(args.step, args.process_index, args.process_count))
        counts = np.bincount(seg.component, minlength=len(pipe.leaf_names))
        print("  " + _drawn(pipe, counts, _steps(args.step, 1)))
    if pipe.packing is not None:  # the plan of the rows just made: index arithmetic, no second read
        positions = pipe.positions(args.step, args.process_index, args.process_count)
        pieces = pipe.pieces(positions)
        print("  " + _packing(pipe, int(pieces.length.sum()), len(positions), len(pieces.row), _steps(args.step, 1)))
    if pipe.bucketing is not None:  # the plan's bucket; the real tokens of the batch just made (or the index)
        bucket = int(_bucket(pipe, np.asarray([args.step]))[0])
        n = len(pipe.positions(args.step, args.process_index, args.process_count))
        real = _real_tokens(pipe, args.step, batch, args.process_index, args.process_count)
        print("  " + _bucket_line(pipe, bucket, n, real, _steps(args.step, 1)))
    for path, leaf in leaves(batch):
        print("  " + _summary(path, leaf))
    if isinstance(batch, dict) and "length" in batch and "tokens" in batch:
        tokens, lengths = np.asarray(batch["tokens"]), np.asarray(batch["length"])
        pad = 1 - lengths.sum() / max(tokens.shape[0] * tokens.shape[1], 1)
        print(f"  padding: {pad:.1%} of {tokens.shape[0]} x {tokens.shape[1]} token slots")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("quern: bench --plot needs matplotlib: pip install 'quern[plot]'", file=sys.stderr)
            return EXIT_USAGE
    pipe = _load(args)
    end = pipe.check_step(args.start_step, "start step") + args.steps  # past the end: main() exits 2
    if pipe.num_steps is not None:
        end = min(end, pipe.num_steps)
    steps = end - args.start_step
    noun = "rows" if _packed_rows(pipe) else "records"  # a packed row holds several records
    prof = bench.profile(pipe, args.start_step, steps)
    run = bench.loop(pipe, args.start_step, steps, args.workers, args.step_ms / 1e3)
    diagnosis = bench.diagnose(pipe, run)
    print("\n".join(bench.report(prof, run, diagnosis, noun)))
    if args.plot:
        bench.plot(prof, run, diagnosis, args.plot)
        print(f"plot: {args.plot}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    finished = os.path.exists(os.path.join(args.output, MANIFEST))
    t0 = time.perf_counter()
    split = lambda text: [x for x in (text or "").split(",") if x]  # noqa: E731
    m = prepare(
        args.inputs,
        args.output,
        map=args.map,
        fields=split(args.fields),
        shard_size=args.shard_size,
        workers=args.workers,
        ray=args.ray or args.ray_address is not None,
        ray_address=args.ray_address,
        skip_errors=args.skip_errors,
        format=args.format,
        field=args.field,
        columns=split(args.columns),
        include=args.include or (),
        compression=args.compression,
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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="quern",
        description="Run, explain, inspect and bench quern pipeline configs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"quern {__version__}")
    traceback_help = "on an error, print the full Python traceback instead of one message"
    allow_help = (
        "let the config name functions of modules under PREFIX, a dotted module name: 'mypkg' allows "
        "mypkg and mypkg.sub, not mypkgevil (repeatable; also QUERN_ALLOW=PREFIX,PREFIX). Without it a config "
        "names only registered transforms and modules in its own folder"
    )
    ap.add_argument("--traceback", action="store_true", help=traceback_help)
    ap.add_argument("--allow", action="append", dest="allow_before", metavar="PREFIX", help=allow_help)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)  # SUPPRESS: given before the command, it is kept
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback_help)
    common.add_argument("--allow", action="append", metavar="PREFIX", help=allow_help)  # its own dest: both kept

    def with_config(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            parents=[common],
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("config", help="pipeline config: a YAML or JSON file")
        return p

    def host(p: argparse.ArgumentParser) -> None:
        p.add_argument("--process-index", type=_nonneg, default=0, help="this host's index (default 0)")
        p.add_argument("--process-count", type=_positive, default=1, help="number of hosts (default 1)")

    p = with_config("run", "iterate the pipeline (a progress bar on a terminal) and print throughput")
    p.add_argument("--steps", type=_positive, default=100, help="steps to run (default 100)")
    p.add_argument("--start-step", type=_nonneg, default=0, help="first step (default 0; --state overrides it)")
    p.add_argument("--workers", type=_nonneg, default=0, help="worker processes (default 0)")
    p.add_argument(
        "--step-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="fail (exit 1) naming the step and stage when a step takes longer (default: no deadline)",
    )
    p.add_argument("--state", help="resume from this saved state (JSON); refused if the data or config changed")
    p.add_argument("--force", action="store_true", help="resume from --state even if the fingerprint differs")
    p.add_argument("--save-state", help="write the state after the last step to this JSON file")
    p.set_defaults(fn=cmd_run)

    p = with_config(
        "explain", "which records make each row of a step (O(batch), any step); a mixture's rows name their component"
    )
    p.add_argument("--step", type=_nonneg, required=True)
    host(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(fn=cmd_explain)

    p = with_config("inspect", "shapes, dtypes, value summaries and padding of one batch")
    p.add_argument("--step", type=_nonneg, required=True)
    host(p)
    p.set_defaults(fn=cmd_inspect)

    p = with_config(
        "bench",
        "time per stage (read, transforms, collate), then a training loop's data wait and bubble rate, and where "
        "the data waits (device, host memory, local disk, network) with a suggestion",
    )
    p.add_argument("--steps", type=_positive, default=20, help="steps to time (default 20)")
    p.add_argument("--start-step", type=_nonneg, default=0)
    p.add_argument("--workers", type=_nonneg, default=0, help="worker processes of the loop (default 0)")
    p.add_argument(
        "--step-ms",
        type=_nonneg_float,
        default=0.0,
        help="the training step the loop simulates, in ms (default 0: none)",
    )
    p.add_argument("--plot", metavar="OUT.png", help="draw the loop's wait vs compute and the stage times per step")
    p.set_defaults(fn=cmd_bench)

    help = "convert inputs to ArrayRecord shards with a manifest and a metadata index (see quern.prepare)"
    p = sub.add_parser("prepare", help=help, description=help, parents=[common], epilog=_EPILOG)
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a directory of small files, JSON-lines (.jsonl), Parquet (.parquet) or ArrayRecord files, a glob, "
        "or a prepared folder; in the order given (a directory's files sorted by relative path)",
    )
    p.add_argument("--output", "-o", required=True, help="the folder to write (new or empty; or an unfinished prepare)")
    p.add_argument(
        "--map",
        help="module:function applied to each record (a tokeniser, say); the current directory is searched first",
    )
    p.add_argument(
        "--workers", type=_nonneg, default=None, help="processes writing shards (default: the CPU count; 0: this one)"
    )
    p.add_argument("--shard-size", default="128MB", help="bytes per shard, e.g. 512KB, 1MB, 128MB, 1GB (default 128MB)")
    p.add_argument(
        "--fields",
        help="scalar fields for the metadata index, comma-separated (JSON keys, Parquet columns, or the map's dict)",
    )
    p.add_argument(
        "--format",
        choices=["files", "jsonl", "parquet", "array_record"],
        help="the kind of every input (default: by name)",
    )
    p.add_argument("--field", help="JSON lines: the record is this field of each line (default: the whole line)")
    p.add_argument("--columns", help="Parquet: the columns read (one: the record; several: a dict for --map)")
    p.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="directories: only files whose relative path matches (repeatable)",
    )
    p.add_argument(
        "--compression",
        default="zstd:1",
        help="per record: zstd[:LEVEL] (default zstd:1), brotli[:LEVEL], snappy or uncompressed (fastest reads)",
    )
    p.add_argument(
        "--skip-errors", action="store_true", help="skip records that cannot be read or mapped; counted in the manifest"
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="write the shards as Ray tasks on a new local cluster (pip install 'quern[ray]')",
    )
    p.add_argument(
        "--ray-address", help="the Ray cluster to use (implies --ray); input and output must be on a shared file system"
    )
    p.set_defaults(fn=cmd_prepare)
    return ap


_EPILOG = """\
code: a config's fn entries may name registered transforms, modules in the config's own folder, and modules
under prefixes given with --allow PREFIX or QUERN_ALLOW=PREFIX,PREFIX; anything else is refused (exit 2).
errors: one message on stderr, or the full traceback with --traceback.
exit status: 0 done; 1 the data failed while making batches (a transform raised, a record could not be
read or collated, workers could not start or kept dying); 2 bad arguments, config or state file (the
command could not start); 130 interrupted."""


def _clip(text: str) -> str:
    """``text`` in at most :data:`MAX_MESSAGE` characters, saying how many were left out."""
    if len(text) <= MAX_MESSAGE:
        return text
    return f"{text[:MAX_MESSAGE]}... ({len(text) - MAX_MESSAGE:,} more characters left out)"


def _message(error: BaseException) -> str:
    """``error`` as one message: quern's own errors as they are, others with their class
    name; without the worker traceback a worker's error carries (``--traceback`` shows it);
    at most :data:`MAX_MESSAGE` characters."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = re.split(r"\n\n(?=[^\n]*traceback:\n)", text, maxsplit=1)[0]
    return _clip(text if isinstance(error, _OWN_ERRORS) else f"{type(error).__name__}: {text}")


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``); the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `quern explain ... | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("quern: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # the command's one place that turns errors into messages
        # a CollateError is a ValueError, but the data's: data errors take precedence
        expected = isinstance(e, _DATA_ERRORS + _USAGE_ERRORS)
        if args.traceback:
            traceback.print_exc()
        else:
            hint = "" if expected else " (an unexpected error: --traceback shows where)"
            print(f"quern: {_message(e)}{hint}", file=sys.stderr)
        return EXIT_USAGE if expected and not isinstance(e, _DATA_ERRORS) else EXIT_DATA


if __name__ == "__main__":
    sys.exit(main())
