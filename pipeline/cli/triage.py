"""Where the data waits, and what to do about it: the triage tree of ``quern bench``.

The monitoring guide this project grew from finds a data-feed bottleneck by
asking, in order, where the next batch is when the accelerator wants it::

    on the device?       yes: the training step bounds the loop (compute-bound)
    in host memory?      yes: the host-to-device transfer, or the CPU work on it
    on local disk?       yes: the storage read
    otherwise            the network (remote storage)

:func:`triage` answers from measured figures only: the caller's loop (the
health and bubble rate of :class:`~quern.pipeline.core.timing.StepClock`), the
seconds per stage (:mod:`quern.pipeline.core.timing`) and a few facts about the
sources. It returns the level, the stage that bounds the loader and one concrete
suggestion. It is a pure function of its arguments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ..core.timing import DEVICE_PUT, HANDOVER, SEND
from ..execute import COLLATE, READ

__all__ = [
    "DEVICE",
    "HOST_MEMORY",
    "LOCAL_DISK",
    "NETWORK",
    "SourceFacts",
    "Diagnosis",
    "triage",
    "bounding_stage",
    "device_advice",
    "DEVICE_ROW_SECONDS",
    "DEVICE_MIN_ROWS",
]

DEVICE = "device"
HOST_MEMORY = "host memory"
LOCAL_DISK = "local disk"
NETWORK = "network"
DEVICE_ROW_SECONDS = 1e-3
"""The seed's rule: per-row work past about 1 ms belongs on the accelerator..."""
DEVICE_MIN_ROWS = 32
"""...once batches pass about 32 rows."""


class SourceFacts(NamedTuple):
    """What the triage needs to know of one source the pipeline reads.

    Attributes:
        name: The source's name, as its read stage names it (``read: NAME``).
        kind: The source's class name: ``ArrayRecordSource``, ``ParquetSource``, ...
        remote: Read by URL through the local-disk cache.
        block_size: Its natural read granularity in records (a Parquet row group); 1: random access.
        shuffle: ``"global"``, ``"block"`` or ``None`` (no shuffle).
    """

    name: str
    kind: str
    remote: bool
    block_size: int
    shuffle: str | None


class Diagnosis(NamedTuple):
    """Where the data waits, and what to do about it.

    Attributes:
        level: :data:`DEVICE`, :data:`HOST_MEMORY`, :data:`LOCAL_DISK` or :data:`NETWORK`
            (``"unknown"`` from :func:`quern.pipeline.cli.bench.diagnose` when too few steps ran).
        stage: The stage that bounds the loader (``""`` when nothing waits).
        share: The share of the loader's time spent in that stage.
        reason: One sentence: what the figures show.
        suggestion: One concrete thing to try.
    """

    level: str
    stage: str
    share: float
    reason: str
    suggestion: str


def bounding_stage(stages: Mapping[str, float]) -> tuple[str, float]:
    """The stage with the most seconds, and its share of all of them.

    Args:
        stages: Seconds per stage.

    Returns:
        ``(stage, share)``; ``("", 0.0)`` when there is none or no time was spent.

    Example:
        >>> bounding_stage({"read": 1.0, "map[0] decode": 3.0})
        ('map[0] decode', 0.75)
    """
    total = sum(stages.values())
    if not stages or total <= 0:
        return "", 0.0
    stage = max(stages, key=lambda k: stages[k])
    return stage, stages[stage] / total


def triage(
    stages: Mapping[str, float],
    *,
    health: str,
    bubble_rate: float,
    sources: Sequence[SourceFacts],
    num_workers: int,
    cpus: int,
    cache_misses: int = 0,
) -> Diagnosis:
    """The level where the data waits, by the triage tree (module docstring).

    A pure function of its arguments. The old spellings (these options passed
    positionally, ``workers=``) still work, with a ``DeprecationWarning``.

    Args:
        stages: Seconds per stage of the loader (and ``device_put`` when the loop fed devices).
        health: The loop's health, from ``it.stats()`` (``"healthy"``, ``"warning"``, ``"alarm"``).
        bubble_rate: The loop's bubble rate, from ``it.stats()``.
        sources: The facts of each source the pipeline reads.
        num_workers: The worker processes the loop ran with.
        cpus: The cores of this host.
        cache_misses: Files the disk cache had to fetch during the loop.

    Returns:
        The level, the bounding stage and its share, the reason and one suggestion.

    Example:
        >>> facts = [SourceFacts("docs", "ArrayRecordSource", remote=False, block_size=1, shuffle="global")]
        >>> d = triage({"read": 1.0, "collate": 8.0}, health="alarm", bubble_rate=0.6, sources=facts,
        ...            num_workers=0, cpus=8)
        >>> d.level, d.stage
        ('host memory', 'collate')
    """
    stage, share = bounding_stage(stages)
    if health == "healthy":
        return Diagnosis(
            DEVICE,
            "",
            0.0,
            f"the batch is ready when the step asks for it (bubble rate {bubble_rate:.1%})",
            "nothing to do on the data side: the training step bounds the loop",
        )
    waits = f"the loop waits for data (bubble rate {bubble_rate:.1%}, health {health})"
    more_workers = (
        f"add worker processes (num_workers={min(max(2 * num_workers, 2), cpus)}; this host has {cpus} cores)"
        if num_workers < cpus
        else f"cheapen the stage or add hosts (each of the {cpus} cores already runs a worker)"
    )
    where = f"; stage {stage!r} takes {share:.0%} of the loader's time"
    if stage == DEVICE_PUT:
        return Diagnosis(
            HOST_MEMORY,
            stage,
            share,
            waits + where + " (host-to-device transfer)",
            "keep more batches in flight to the devices (global_iterator(device_prefetch=4)), or send smaller "
            "dtypes (int32/bfloat16) and cast on the device",
        )
    if stage == READ or stage.startswith(f"{READ}: "):
        read_sources = _read_sources(stage, sources)
        if any(s.remote for s in read_sources) and cache_misses:
            return Diagnosis(
                NETWORK,
                stage,
                share,
                waits + where + f", and the disk cache fetched {cache_misses} file(s) during the loop",
                "give the disk cache room for the working set (ShardCache(capacity=...)) and keep lookahead on "
                "(iterator(lookahead=64)), or `quern prepare` a copy on local disk",
            )
        scattered = [s for s in read_sources if s.block_size > 1 and s.shuffle == "global"]
        if scattered:
            return Diagnosis(
                LOCAL_DISK,
                stage,
                share,
                waits + where + f"; {scattered[0].name!r} is read in row groups of {scattered[0].block_size} "
                "records but shuffled globally, so each batch decodes many row groups",
                "use a block shuffle (shuffle('block')): whole row groups, shuffled within a window",
            )
        if any(s.kind != "ArrayRecordSource" for s in read_sources):
            tip = "convert the data to ArrayRecord shards with `quern prepare` (bulk reads of one file each), or "
        else:
            tip = "prepare with --compression snappy or uncompressed (faster decode), or "
        return Diagnosis(LOCAL_DISK, stage, share, waits + where + " (the storage read)", tip + more_workers)
    if stage in (SEND, HANDOVER):
        return Diagnosis(
            HOST_MEMORY,
            stage,
            share,
            waits + where + " (moving batches between processes)",
            "send fewer, larger arrays (one stacked array per field), or use num_workers=0 with num_threads=2 "
            "when the transforms release the GIL",
        )
    if stage == COLLATE:
        return Diagnosis(
            HOST_MEMORY,
            stage,
            share,
            waits + where + " (stacking records one by one)",
            "make the records fixed-shape numpy arrays (pad in a transform), or do the work in map_batch on "
            "whole batches",
        )
    kind = re.match(r"(\w+)\[", stage.split(": ")[-1])
    if kind is not None and kind.group(1) in ("map", "random_map", "filter"):
        return Diagnosis(
            HOST_MEMORY,
            stage,
            share,
            waits + where + " (a per-record Python transform)",
            f"vectorise this transform: one numpy call over the batch in map_batch instead of a Python call per "
            f"record{'; or ' + more_workers if num_workers < cpus else ''}",
        )
    return Diagnosis(HOST_MEMORY, stage, share, waits + where + " (CPU work on the batch)", more_workers)


def _read_sources(stage: str, sources: Sequence[SourceFacts]) -> list[SourceFacts]:
    """The sources a read stage covers: ``read: NAME`` one component's, ``read`` all."""
    if stage.startswith(f"{READ}: "):
        name = stage[len(READ) + 2 :]
        named = [s for s in sources if s.name == name]
        return named or list(sources)
    return list(sources)


def device_advice(per_row: Mapping[str, float], batch_size: int | None, device_stages: Sequence[str]) -> list[str]:
    """Which stages to move to the devices, or back, by the seed's rule, each with the figures behind it.

    A host stage (a record or batch transform) costing more than :data:`DEVICE_ROW_SECONDS` a row, in
    batches of at least :data:`DEVICE_MIN_ROWS` rows, is worth moving to ``map_device`` /
    ``random_map_device``; device stages in batches of fewer rows are worth moving back (a launch per
    small batch costs more than the host work). A pure function of its arguments.

    Args:
        per_row: Seconds per row of each host stage (measured).
        batch_size: The rows of a (global) batch, ``None`` when it varies.
        device_stages: The labels of the pipeline's device stages.

    Returns:
        One line per advice (none when the rule says nothing).

    Example:
        >>> device_advice({"random_map[1] crop": 2.5e-3, "map[0] decode": 4e-4}, 64, [])
        ['move random_map[1] crop to the devices (random_map_device): 2.50 ms a row on the host, batches of 64 rows (the rule: over 1 ms a row and 32 rows)']
    """
    rule = f"(the rule: over {DEVICE_ROW_SECONDS * 1e3:g} ms a row and {DEVICE_MIN_ROWS} rows)"
    rows = f"batches of {batch_size} rows" if batch_size else "batches of varying size"
    out = []
    if batch_size is not None and batch_size >= DEVICE_MIN_ROWS:
        for stage, seconds in per_row.items():
            kind = re.match(r"(\w+)\[", stage)
            if kind is None or kind.group(1) not in ("map", "random_map", "map_batch", "random_map_batch"):
                continue
            if seconds > DEVICE_ROW_SECONDS:
                target = "random_map_device" if kind.group(1).startswith("random") else "map_device"
                out.append(
                    f"move {stage} to the devices ({target}): {seconds * 1e3:.2f} ms a row on the host, {rows} {rule}"
                )
    elif device_stages and batch_size is not None:
        out.append(f"move {', '.join(device_stages)} back to the host: {rows}, too few for the devices to pay {rule}")
    return out
