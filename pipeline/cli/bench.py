"""``quern bench``: where a pipeline's time goes, and where the data waits.

Two measurements of the same steps, then a diagnosis:

1. :func:`profile`: each step computed on its own in this process (one read per
   step), its seconds per stage (:mod:`quern.pipeline.core.timing`): what each stage
   costs, free of any overlap.
2. :func:`loop`: the real iterator (threads or worker processes, prefetch) fed to
   a training loop whose step takes ``step_s`` seconds (a sleep: the host is free
   while an accelerator computes), with the iterator's own figures: the data wait
   and step period of every step, the bubble rate, the health, the stage seconds
   of its threads or workers, the disk cache.
3. :func:`diagnose`: the triage tree (:mod:`quern.pipeline.cli.triage`) over the
   loop's figures: the level where the data waits, the bounding stage, one
   suggestion.

:func:`report` turns them into the lines ``quern bench`` prints; :func:`plot`
draws them (matplotlib, ``pip install 'quern[plot]'``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from .. import execute
from ..core.ops import DEVICE_KINDS
from ..definition.dataset import Pipeline
from .triage import Diagnosis, SourceFacts, device_advice, triage

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["Profile", "Loop", "profile", "loop", "source_facts", "diagnose", "report", "plot", "tuning_line"]


class Profile(NamedTuple):
    """The stage seconds of steps computed one at a time in this process (:func:`profile`).

    Attributes:
        steps: The steps.
        stages: The stage labels, in pipeline order.
        per_step: Seconds per stage of each step.
        rows: Rows (records, or packed rows) made.
    """

    steps: list[int]
    stages: list[str]
    per_step: list[dict[str, float]]
    rows: int


class Loop(NamedTuple):
    """The figures of a training loop fed by the iterator (:func:`loop`).

    Attributes:
        steps: The steps.
        waits: Seconds blocked in ``next()`` at each step.
        periods: Seconds between the returns of ``next()`` (0.0 for the first).
        step_s: The training step the loop simulated, in seconds.
        num_workers: The iterator's worker processes.
        stats: ``it.stats()`` at the end.
    """

    steps: list[int]
    waits: list[float]
    periods: list[float]
    step_s: float
    num_workers: int | Literal["auto"]
    stats: dict[str, Any]


def stage_names(pipe: Pipeline) -> list[str]:
    """The stage labels of ``pipe``, in the order they run.

    A mixture's per-component ``read: NAME`` stages are not among them:
    :func:`profile` adds them when met.

    Args:
        pipe: The pipeline.

    Returns:
        ``read``, the stream's own stages, the record transforms, ``collate``, the batch transforms.
    """
    return (
        [execute.READ]
        + pipe.stream.stages_before()
        + [op.label(k) for k, op in enumerate(pipe.record_ops)]
        + [execute.COLLATE]
        + [op.label(k) for k, op in enumerate(pipe.batch_ops) if op.kind not in DEVICE_KINDS]
    )


def short(label: str, width: int = 44) -> str:
    """A stage label cut to ``width`` characters, for tables and legends.

    Args:
        label: The stage label (``map[1] partial(tokenize)``).
        width: The most characters.

    Returns:
        The label, or its start and ``...``.

    Example:
        >>> short("map[1] partial(tokenize, vocab='a very long path')", 20)
        'map[1] partial(to...'
    """
    return label if len(label) <= width else label[: width - 3] + "..."


def profile(pipe: Pipeline, start: int, *, count: int) -> Profile:
    """Time each stage of ``count`` steps from ``start`` (host 0 of 1), one at a time in this process.

    One read per step and no overlap: what each stage costs on its own.

    Args:
        pipe: The pipeline.
        start: The first step.
        count: The number of steps.

    Returns:
        The seconds per stage of each step.

    Raises:
        StepError: The first step that fails, as :meth:`Pipeline.batch_at` raises it.
    """
    names = stage_names(pipe)
    per_step, rows = [], 0
    for s in range(start, start + count):
        times: dict[str, float] = {}
        for result in execute.step_results(pipe, [s], timings=times):
            if result.error is not None:
                raise result.error
        for stage in times:
            if stage not in names:
                names.insert(1 if stage.startswith(execute.READ) else len(names), stage)
        per_step.append(times)
        rows += len(pipe.positions(s))
    return Profile(list(range(start, start + count)), names, per_step, rows)


def loop(pipe: Pipeline, start: int, *, count: int, num_workers: int | Literal["auto"], step_s: float) -> Loop:
    """Run ``count`` steps from ``start`` through the iterator, each followed by a training step of ``step_s`` s.

    The training step is a sleep: the host is free while an accelerator computes.
    The old spellings (these options passed positionally, ``workers=``) still
    work, with a ``DeprecationWarning``.

    Args:
        pipe: The pipeline.
        start: The first step.
        count: The number of steps.
        num_workers: The iterator's worker processes (``pipe.iterator(num_workers=...)``; ``"auto"``).
        step_s: The simulated training step, in seconds (0: none).

    Returns:
        The iterator's data wait and step period of every step, and its stats at the end.
    """
    waits, periods = [], []
    with pipe.iterator(start_step=start, num_workers=num_workers) as it:
        for _ in range(count):
            next(it)
            waits.append(it.clock.last_wait if it.clock.steps > 1 else it.clock.first_batch_s or 0.0)
            periods.append(it.clock.last_period if it.clock.steps > 1 else 0.0)
            if step_s:
                time.sleep(step_s)
        stats = it.stats()
    return Loop(list(range(start, start + count)), waits, periods, step_s, num_workers, stats)


def source_facts(pipe: Pipeline) -> list[SourceFacts]:
    """What the triage needs of each source ``pipe`` reads, named as its read stage names it.

    Args:
        pipe: The pipeline.

    Returns:
        One :class:`SourceFacts` per leaf of the stream, in order.
    """
    out = []
    for name, leaf, src in zip(pipe.leaf_names, pipe.leaves, pipe.sources):
        out.append(
            SourceFacts(
                name=name,
                kind=type(src).__name__,
                remote=getattr(src, "cache", None) is not None,
                block_size=int(src.block_size()),
                shuffle=leaf.stream.read_order(),
            )
        )
    return out


def diagnose(pipe: Pipeline, run: Loop, *, fallback: dict[str, float] | None = None) -> Diagnosis:
    """Where the data of the loop waits: the triage (:func:`quern.pipeline.cli.triage.triage`) of its figures.

    Args:
        pipe: The pipeline the loop ran.
        run: The loop's figures (:func:`loop`).
        fallback: Seconds per stage to use when the loop's stats have none (its
            threads' or workers' stage seconds).

    Returns:
        The diagnosis; level ``"unknown"`` when fewer than 3 steps ran.
    """
    s = run.stats
    if s["steps"] < 3:  # the first batch is start-up: fewer than 2 steps after it say nothing of the loop
        return Diagnosis("unknown", "", 0.0, "too few steps to measure the loop", "run more steps (--steps 20)")
    cache = s.get("disk_cache") or {}
    misses = int(cache.get("misses", 0)) + (1 if cache.get("bytes_fetched") else 0)
    return triage(
        s.get("stages") or fallback or {},
        health=s["health"],
        bubble_rate=s["bubble_rate_total"],
        sources=source_facts(pipe),
        num_workers=_workers_used(run),
        cpus=os.cpu_count() or 1,
        cache_misses=misses,
    )


def tuning_line(tuning: dict[str, Any]) -> str:
    """The line of ``quern run`` and ``quern bench`` on what ``num_workers="auto"`` chose and why.

    Args:
        tuning: ``it.stats()["tuning"]``.

    Returns:
        ``tuning: CHOICE (WHY); measured: ...; from step S``.
    """
    measured = ", ".join(f"{k} {v:,.1f} steps/s" for k, v in tuning["measured"].items()) or "nothing yet"
    at = f"; from step {tuning['at_step']}" if tuning["at_step"] is not None else ""
    return f"tuning: {tuning['chose'] or 'not chosen yet'} ({tuning['why']}); measured: {measured}{at}"


def _workers_used(run: Loop) -> int:
    """The worker processes the loop ended with (``"auto"``: those it chose, 0 for threads)."""
    if run.num_workers != "auto":
        return run.num_workers
    chose = str((run.stats.get("tuning") or {}).get("chose") or "")
    return int(chose.split("=")[1]) if chose.startswith("num_workers=") else 0


def report(
    prof: Profile,
    run: Loop,
    *,
    diagnosis: Diagnosis,
    noun: str = "records",
    batch_size: int | None = None,
    device_stages: Sequence[str] = (),
) -> list[str]:
    """The lines ``quern bench`` prints.

    Args:
        prof: The stage seconds (:func:`profile`).
        run: The loop's figures (:func:`loop`).
        diagnosis: Where the data waits (:func:`diagnose`).
        noun: What a row is called (``records``, or ``rows`` for packed rows).
        batch_size: The rows of a global batch (``None``: varying), for the device advice.
        device_stages: The labels of the pipeline's device stages (not timed here: they run in
            ``quern.sharding``).

    Returns:
        The per-stage table, the bounding stage, the loop's figures, the level, the suggestion and the
        device advice (:func:`~quern.pipeline.cli.triage.device_advice`).
    """
    totals = {name: sum(t.get(name, 0.0) for t in prof.per_step) for name in prof.stages}
    total = sum(totals.values())
    n = len(prof.steps)
    lines = [
        f"{n} steps, {prof.rows:,} {noun}, one read per step, one process: {prof.rows / max(total, 1e-9):,.0f} {noun}/s"
    ]
    width = max(18, *(len(short(name)) for name in prof.stages))
    for name, dt in totals.items():
        lines.append(f"  {short(name):{width}s} {1e3 * dt / n:9.3f} ms/step  {dt / max(total, 1e-9):6.1%}")
    lines.append(f"bound by: {short(max(totals, key=lambda k: totals[k]), 200)}")
    s = run.stats
    lines.append(
        f"loop: {len(run.steps)} steps, {run.num_workers} workers, a training step of {1e3 * run.step_s:.1f} ms: "
        f"data wait {1e3 * s['data_wait']['mean']:.2f} ms/step, step period {1e3 * s['step_period']['mean']:.2f} ms, "
        f"bubble rate {s['bubble_rate_total']:.1%}, health {s['health']} (first batch {s['first_batch_s'] or 0:.2f} s)"
    )
    if run.step_s == 0 and diagnosis.level != "unknown":
        lines.append(
            f"note: no training step (--step-ms 0): the loop waits by design; the loader gives a batch every "
            f"{1e3 * s['step_period']['mean']:.2f} ms, so a shorter training step would wait, at this level"
        )
    if s.get("tuning"):
        lines.append(tuning_line(s["tuning"]))
    lines.append(f"where the data waits: {diagnosis.level}: {diagnosis.reason}")
    lines.append(f"suggestion: {diagnosis.suggestion}")
    per_row = {name: dt / max(prof.rows, 1) for name, dt in totals.items()}
    lines += [f"device: {line}" for line in device_advice(per_row, batch_size, device_stages)]
    return lines


def plot(prof: Profile, run: Loop, *, diagnosis: Diagnosis, path: str) -> None:
    """Draw the bench to a PNG: the loop's data wait against the training's own time, and the stage times.

    Args:
        prof: The stage seconds (:func:`profile`), drawn per step.
        run: The loop's figures (:func:`loop`), drawn per step.
        diagnosis: Where the data waits (:func:`diagnose`), in the titles.
        path: The PNG file to write.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'quern[plot]'``).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("quern bench --plot needs matplotlib: pip install 'quern[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), constrained_layout=True)
    steps = run.steps[1:]  # the first is start-up
    waits = [1e3 * w for w in run.waits[1:]]
    own = [1e3 * max(p - w, 0.0) for w, p in zip(run.waits[1:], run.periods[1:])]
    top.bar(steps, own, color="#4477aa", label="training step (outside next())")
    top.bar(steps, waits, bottom=own, color="#cc3311", label="data wait (inside next())")
    s = run.stats
    top.set_title(
        f"the loop ({run.num_workers} workers): bubble rate {s['bubble_rate_total']:.1%}, health {s['health']}; "
        f"data waits at: {diagnosis.level}"
    )
    top.set_xlabel("step")
    top.set_ylabel("ms")
    top.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    bottom_of = [0.0] * len(prof.steps)
    colours = plt.get_cmap("tab10")
    for i, name in enumerate(prof.stages):
        ms = [1e3 * t.get(name, 0.0) for t in prof.per_step]
        bottom.bar(prof.steps, ms, bottom=bottom_of, color=colours(i % 10), label=short(name))
        bottom_of = [a + b for a, b in zip(bottom_of, ms)]
    bottom.set_title(
        f"stages per step (one process, one read per step); the loader is bound by {short(diagnosis.stage)}"
    )
    bottom.set_xlabel("step")
    bottom.set_ylabel("ms")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.savefig(path, dpi=90)
    plt.close(fig)
