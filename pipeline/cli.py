"""The ``quern`` command: run, explain, inspect and bench a pipeline config.

    quern run CONFIG [--steps N] [--start-step S] [--workers W] [--state FILE]
    quern explain CONFIG --step S [--process-index H --process-count N] [--json]
    quern inspect CONFIG --step S [--process-index H --process-count N]
    quern bench CONFIG [--steps N] [--start-step S]

A config that does not validate prints its message and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

__all__ = ["main"]


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _load(args) -> Any:
    from .config import ConfigError, load_config

    try:
        return load_config(args.config, process_count=getattr(args, "process_count", 1))
    except ConfigError as e:
        print(f"quern: {args.config}: {e}", file=sys.stderr)
        raise SystemExit(2)


def _progress(done: int, total: int, records: int, seconds: float) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    rate = records / seconds if seconds > 0 else 0.0
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps, {rate:,.0f} records/s",
          end="", file=sys.stderr, flush=True)


def cmd_run(args) -> int:
    pipe = _load(args)
    start = args.start_step
    if args.state:
        try:
            with open(args.state) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            print(f"quern: cannot read the state file {args.state}: {e}", file=sys.stderr)
            return 2
        try:
            start = pipe.check_state(state, force=args.force)
        except ValueError as e:
            print(f"quern: cannot resume from {args.state}: {str(e).replace('force=True', '--force')}",
                  file=sys.stderr)
            return 2
    steps = args.steps
    if pipe.num_steps is not None:
        if start > pipe.num_steps:
            print(f"quern: start step {start} is past the end of the stream ({pipe.num_steps} steps)", file=sys.stderr)
            return 2
        if pipe.num_steps - start < steps:
            steps = pipe.num_steps - start
            print(f"quern: the stream ends after step {pipe.num_steps - 1}: running {steps} steps", file=sys.stderr)
    t0, records = time.perf_counter(), 0
    with pipe.iterator(start_step=start, num_workers=args.workers) as it:
        for i in range(steps):
            batch = next(it)
            records += len(next(iter(_leaves(batch))))
            if i % 10 == 0 or i == steps - 1:
                _progress(i + 1, steps, records, time.perf_counter() - t0)
        state = it.state()
    seconds = time.perf_counter() - t0
    print(file=sys.stderr)
    print(f"{steps} steps, {records:,} records in {seconds:.2f} s: {records / max(seconds, 1e-9):,.0f} records/s, "
          f"{steps / max(seconds, 1e-9):,.1f} steps/s; next step {state['step']}")
    if args.save_state:
        with open(args.save_state, "w") as f:
            json.dump(state, f)
    return 0


def _leaves(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (tuple, list)):
        return [x for v in tree for x in _leaves(v)]
    return [np.asarray(tree)]


def cmd_explain(args) -> int:
    pipe = _load(args)
    rows = pipe.explain(args.step, args.process_index, args.process_count)  # errors: main() exits 2
    first = pipe.positions(args.step, args.process_index, args.process_count)
    if args.json:
        print(json.dumps({"step": args.step, "process_index": args.process_index,
                          "process_count": args.process_count,
                          "rows": [{"row": i, "position": int(p), "records": [[n, r] for n, r in recs]}
                                   for i, (p, recs) in enumerate(zip(first.tolist(), rows))]}))
    else:
        print(f"step {args.step}, host {args.process_index} of {args.process_count}: {len(rows)} rows")
        for i, (p, recs) in enumerate(zip(first.tolist(), rows)):
            print(f"  row {i:4d}  position {p}  " + ", ".join(f"{n}[{r}]" for n, r in recs))
    return 0


def _summaries(tree: Any, path: str = "batch") -> list[str]:
    if isinstance(tree, dict):
        return [s for k, v in tree.items() for s in _summaries(v, f"{path}[{k!r}]")]
    if isinstance(tree, (tuple, list)):
        return [s for i, v in enumerate(tree) for s in _summaries(v, f"{path}[{i}]")]
    x = np.asarray(tree)
    line = f"{path}: {x.dtype} {x.shape}"
    if x.dtype.kind in "biuf" and x.size:
        line += f"  min {x.min()}  max {x.max()}  mean {x.astype(np.float64).mean():.4g}"
        if x.ndim >= 2:
            line += f"  zeros {np.mean(x == 0):.1%}"
    elif x.dtype == object and x.size:
        line += f"  e.g. {x.flat[0]!r}"[:120]
    return [line]


def cmd_inspect(args) -> int:
    pipe = _load(args)
    batch = pipe.batch_at(args.step, args.process_index, args.process_count)  # errors: main() exits 2
    print(f"step {args.step}, host {args.process_index} of {args.process_count}")
    for line in _summaries(batch):
        print("  " + line)
    if isinstance(batch, dict) and "length" in batch and "tokens" in batch:
        tokens, lengths = np.asarray(batch["tokens"]), np.asarray(batch["length"])
        pad = 1 - lengths.sum() / max(tokens.shape[0] * tokens.shape[1], 1)
        print(f"  padding: {pad:.1%} of {tokens.shape[0]} x {tokens.shape[1]} token slots")
    return 0


def cmd_bench(args) -> int:
    from .collate import collate

    pipe = _load(args)
    times = {"read": 0.0, "record transforms": 0.0, "collate": 0.0, "batch transforms": 0.0}
    records, end = 0, args.start_step + args.steps
    if pipe.num_steps is not None:
        if args.start_step >= pipe.num_steps:
            print(f"quern: start step {args.start_step} is past the end of the stream ({pipe.num_steps} steps)",
                  file=sys.stderr)
            return 2
        end = min(end, pipe.num_steps)
    args.steps = end - args.start_step
    for s in range(args.start_step, end):
        pos = pipe.positions(s)
        ids = pipe.record_ids(pos)
        t = time.perf_counter()
        recs = pipe.source.read_many(ids)
        t1 = time.perf_counter()
        for k, op in enumerate(pipe.record_ops):
            recs = pipe._apply_record_op(k, op, recs, pos, ids, f"step {s}")
        t2 = time.perf_counter()
        batch = collate(recs)
        t3 = time.perf_counter()
        pipe._batch_ops(batch, pos, ids, f"step {s}")
        t4 = time.perf_counter()
        for name, dt in zip(times, (t1 - t, t2 - t1, t3 - t2, t4 - t3)):
            times[name] += dt
        records += len(ids)
    total = sum(times.values())
    print(f"{args.steps} steps, {records:,} records, one read per step, one process: "
          f"{records / max(total, 1e-9):,.0f} records/s")
    for name, dt in times.items():
        print(f"  {name:18s} {1e3 * dt / args.steps:9.3f} ms/step  {dt / max(total, 1e-9):6.1%}")
    slowest = max(times, key=times.get)
    print(f"bound by: {slowest}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quern", description="Run, explain, inspect and bench quern pipeline configs.")
    sub = ap.add_subparsers(dest="command", required=True)

    def with_config(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("config", help="pipeline config: a YAML or JSON file")
        return p

    def host(p: argparse.ArgumentParser) -> None:
        p.add_argument("--process-index", type=_nonneg, default=0, help="this host's index (default 0)")
        p.add_argument("--process-count", type=_positive, default=1, help="number of hosts (default 1)")

    p = with_config("run", "iterate the pipeline, with a progress bar, and print throughput")
    p.add_argument("--steps", type=_positive, default=100, help="steps to run (default 100)")
    p.add_argument("--start-step", type=_nonneg, default=0, help="first step (default 0; --state overrides it)")
    p.add_argument("--workers", type=_nonneg, default=0, help="worker processes (default 0)")
    p.add_argument("--state", help="resume from this saved state (JSON); refused if the data or config changed")
    p.add_argument("--force", action="store_true", help="resume from --state even if the fingerprint differs")
    p.add_argument("--save-state", help="write the state after the last step to this JSON file")
    p.set_defaults(fn=cmd_run)

    p = with_config("explain", "which records make each row of a step (O(batch), any step)")
    p.add_argument("--step", type=_nonneg, required=True)
    host(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(fn=cmd_explain)

    p = with_config("inspect", "shapes, dtypes, value summaries and padding of one batch")
    p.add_argument("--step", type=_nonneg, required=True)
    host(p)
    p.set_defaults(fn=cmd_inspect)

    p = with_config("bench", "time per stage (read, record transforms, collate, batch transforms)")
    p.add_argument("--steps", type=_positive, default=20, help="steps to time (default 20)")
    p.add_argument("--start-step", type=_nonneg, default=0)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `quern explain ... | head`
        sys.stderr.close()
        return 0
    except (ValueError, IndexError, OSError) as e:  # a bad argument or file: a message, not a traceback
        print(f"quern: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
