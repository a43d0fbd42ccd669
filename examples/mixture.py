"""A scheduled mixture of two components, resumed across its switch after the future was edited.

1. Reads the Python standard library on this machine as two components of byte
   records (one record per ``.py`` file): "modules", the files outside
   ``test/``, and "tests", the files under ``test/`` (where the standard
   library's test folder is absent or nearly empty, the files whose name starts
   with ``test_`` anywhere; the printout says which). The "tests" component
   keeps only files of at least ``--min-lines`` lines: a filter, whose
   survivors are found once by a scan and cached under ``--out``.
2. Mixes them with ``quern.mix`` and a schedule: 90% modules / 10% tests from
   step 0, 50% / 50% from step 200; the mixed records are decoded to bytes and
   padded / truncated to 512, in batches of 64.
3. Runs to step 150, saves the iterator state as JSON, then builds everything
   afresh (as a restarted job would) with a schedule that adds a third stage
   from step 300 (20% / 80%): the past is unchanged, so the state is accepted,
   while a schedule edited before step 150 is refused. It resumes from the
   state, runs across the switch at step 200 to step 260, checks that every
   batch equals ``batch_at(step)`` of the edited pipeline and of the original
   one, and that rows hold the files ``explain`` names, and prints the share
   of each component drawn before and after the switch.

Run:  python examples/mixture.py  [--out DIR] [--min-lines 50] [--stop-at 150] [--until 260] [--workers 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

import quern

SEQ_LEN = 512
BATCH = 64
SWITCH = 200  # the step where the second stage starts
EDIT = 300  # the step where the resumed pipeline's third stage starts
STAGE0 = {"modules": 0.9, "tests": 0.1}
STAGE1 = {"modules": 0.5, "tests": 0.5}
STAGE2 = {"modules": 0.2, "tests": 0.8}


def stdlib_files() -> tuple[list[str], list[str], str]:
    """The standard library's ``.py`` files split into modules and tests, and how they were split."""
    root = os.path.dirname(os.__file__)
    modules, tests = [], []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        rel = os.path.relpath(folder, root)
        under_test = rel == "test" or rel.startswith("test" + os.sep)
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                (tests if under_test else modules).append(path)
    if len(tests) >= 20:
        return modules, tests, f"the files under {os.path.join(root, 'test')}"
    everything = sorted(modules + tests)
    tests = [p for p in everything if os.path.basename(p).startswith("test_")]
    modules = [p for p in everything if not os.path.basename(p).startswith("test_")]
    return modules, tests, f"no test folder with files in {root}: the files named test_*.py anywhere"


def read_all(paths: list[str]) -> list[bytes]:
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


class AtLeastLines:
    """Filter predicate: keep a file (its bytes) of at least ``n`` lines."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, record: bytes) -> bool:
        return record.count(b"\n") >= self.n


def make_pipeline(args: argparse.Namespace, schedule: list) -> tuple[quern.Pipeline, dict[str, list[str]]]:
    """The mixture, built from the files on disk: what a (re)started job does."""
    modules, tests, _ = stdlib_files()
    comp_modules = quern.Pipeline.from_source(read_all(modules), seed=1).shuffle()
    comp_tests = (
        quern.Pipeline.from_source(read_all(tests), seed=2)
        .shuffle()
        .filter(AtLeastLines(args.min_lines), cache_dir=os.path.join(args.out, "cache"))
    )
    pipe = (
        quern.mix({"modules": comp_modules, "tests": comp_tests}, schedule=schedule, seed=0)
        .map(quern.transforms.decode(np.uint8))
        .map(quern.transforms.pad(SEQ_LEN))
        .batch(BATCH)
    )
    return pipe, {"modules": modules, "tests": tests}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def share(pipe: quern.Pipeline, steps: range, name: str) -> float:
    """The share of rows drawn from component ``name`` over ``steps`` (from the plan: no reads)."""
    seg = pipe.segments(np.concatenate([pipe.positions(s) for s in steps]))
    return float(np.mean(seg.component == pipe.leaf_names.index(name)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "data", "mixture"), help="filter cache and state.json")
    parser.add_argument("--min-lines", type=int, default=50, help="the filter keeps test files of this many lines")
    parser.add_argument("--stop-at", type=int, default=150, help="save the state here (before the switch at 200)")
    parser.add_argument("--until", type=int, default=260, help="resume and run to this step (past the switch)")
    parser.add_argument("--workers", type=int, default=0, help="worker processes of the resumed iterator")
    args = parser.parse_args(argv)
    if not 0 < args.stop_at < SWITCH < args.until <= EDIT:
        parser.error(f"need 0 < --stop-at < {SWITCH} < --until <= {EDIT}")
    os.makedirs(args.out, exist_ok=True)

    t0 = time.perf_counter()
    modules, tests, how = stdlib_files()
    print(f"modules: {len(modules)} files outside the test folder; tests: {len(tests)} files ({how})")
    schedule = [(0, STAGE0), (SWITCH, STAGE1)]
    pipe, files = make_pipeline(args, schedule)
    kept = pipe.leaves[1].stream_len
    print(
        f"filter on tests: {kept} of {len(tests)} files have at least {args.min_lines} lines "
        f"({time.perf_counter() - t0:.1f} s to read the files and build the pipeline, scan or cache included)"
    )
    print(f"schedule: {schedule}, batch {BATCH}, records padded/truncated to {SEQ_LEN} bytes")

    # -- run to --stop-at, save the state as JSON
    with pipe.iterator() as it:
        for _ in range(args.stop_at):
            next(it)
        state = it.state()
    state_path = os.path.join(args.out, "state.json")
    with open(state_path, "w") as f:
        json.dump(state, f)
    print(f"stopped at step {state['step']}; saved {state_path} (keys: {', '.join(sorted(state))})")

    # -- a restarted job: everything rebuilt from the files, with the future edited (a third stage)
    del pipe
    edited_schedule = [(0, STAGE0), (SWITCH, STAGE1), (EDIT, STAGE2)]
    edited, _ = make_pipeline(args, edited_schedule)
    with open(state_path) as f:
        state = json.load(f)
    print(f"edited schedule (a stage added from step {EDIT}): {edited_schedule}")
    print(f"fingerprints differ: {state['fingerprint'] != edited.fingerprint()} (the definition changed)")

    # an edit of the past is refused: the switch moved to step 100, before the saved step
    past_edited, _ = make_pipeline(args, [(0, STAGE0), (100, STAGE1)])
    try:
        past_edited.check_state(state)
        print("UNEXPECTED: a schedule edited before the saved step was accepted")
        refused = False
    except ValueError as e:
        refused = True
        why = re.search(r"what changed for the steps before \d+: [^;]+", str(e))
        print(f"a schedule edited before step {state['step']} is refused ({why.group(0) if why else e})")

    with edited.resume(state, num_workers=args.workers) as it:
        steps = range(state["step"], args.until)
        resumed = [next(it) for _ in steps]
    print(f"resumed at step {steps.start} (num_workers={args.workers}) and ran to step {steps.stop - 1}")

    # -- checks: each resumed batch is the edited pipeline's batch_at(step) and the original's
    original, _ = make_pipeline(args, schedule)
    ok_edited = all(same(b, edited.batch_at(s)) for s, b in zip(steps, resumed))
    ok_original = all(same(b, original.batch_at(s)) for s, b in zip(steps, resumed))
    print(f"resumed batches {steps.start}..{steps.stop - 1} equal the edited pipeline's batch_at: {ok_edited}")
    print(f"resumed batches {steps.start}..{steps.stop - 1} equal the original pipeline's batch_at: {ok_original}")

    # rows hold the files explain() names: their first 512 bytes, zero-padded
    records = {name: read_all(paths) for name, paths in files.items()}
    rows_ok, checked = True, 0
    for s in (steps.start, SWITCH - 1, SWITCH, steps.stop - 1):
        batch = resumed[s - steps.start]
        for row, ((name, rid),) in enumerate(edited.explain(s)):
            raw = np.frombuffer(records[name][rid], np.uint8)[:SEQ_LEN]
            n = int(batch["length"][row])
            rows_ok &= n == len(raw) and batch["tokens"][row, :n].tobytes() == raw.tobytes()
            rows_ok &= not batch["tokens"][row, n:].any()
            if name == "tests":
                rows_ok &= records[name][rid].count(b"\n") >= args.min_lines  # the filter's survivors only
            checked += 1
    print(
        f"the {checked} rows of steps {steps.start}, {SWITCH - 1}, {SWITCH}, {steps.stop - 1} hold the files explain() names: {rows_ok}"
    )

    # -- the drawn proportions before and after the switch (over the resumed steps)
    before, after = range(steps.start, SWITCH), range(SWITCH, steps.stop)
    for label, rng, weights in (("before", before, STAGE0), ("after", after, STAGE1)):
        shares = {name: share(edited, rng, name) for name in ("modules", "tests")}
        print(
            f"{label} the switch (steps {rng.start}-{rng.stop - 1}): "
            + ", ".join(f"{name} share {x:.3f} (weight {weights[name]})" for name, x in shares.items())
        )
    first_after = edited.explain(SWITCH)
    print(f"step {SWITCH}, first rows: {[name for ((name, _),) in first_after[:8]]}")

    ok = ok_edited and ok_original and rows_ok and refused
    print(f"total {time.perf_counter() - t0:.1f} s")
    if ok:
        print("mixture example OK: resumed across the switch with an edited future, batches identical.")
        return 0
    print("mixture example FAILED", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
