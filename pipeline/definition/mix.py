"""``quern.mix``: a weighted mixture of named pipelines, with a schedule of weights.

>>> import numpy as np, quern
>>> web = quern.Pipeline.from_source({"x": np.arange(100)}, seed=1).shuffle()
>>> code = quern.Pipeline.from_source({"x": np.arange(1000, 1010)}, seed=2).shuffle()
>>> pipe = quern.mix({"web": web, "code": code}, schedule=[(0, {"web": 0.9, "code": 0.1}),
...                                                     (200, {"web": 0.5, "code": 0.5})], seed=0).batch(64)
>>> sum(name == "code" for s in range(16) for [(name, _)] in pipe.explain(s))  # 10% of the first block of 1024
102
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..order import components as _mixture
from ..order.index import check_int, check_seed
from ..streams import MixtureStream
from ..streams.capabilities import RowMaking, SingleSource, has, require
from .dataset import Pipeline

__all__ = ["mix"]


def _components(components: Any) -> tuple[tuple[str, ...], tuple[Pipeline, ...]]:
    if isinstance(components, Mapping):
        items = list(components.items())
    elif isinstance(components, Sequence) and not isinstance(components, (str, bytes)):
        items = list(components)
        if not all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
            raise TypeError("mix() components must be a dict of name -> pipeline or a list of (name, pipeline) pairs")
    else:
        raise TypeError(f"mix() components must be a dict of name -> pipeline, got {type(components).__name__}")
    if not items:
        raise ValueError("mix() needs at least one component")
    names, pipes = [], []
    for name, pipe in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"mix(): component names must be non-empty strings, got {name!r}")
        if name in names:
            raise ValueError(f"mix(): component {name!r} is named twice")
        if not isinstance(pipe, Pipeline):
            raise TypeError(f"mix(): component {name!r} must be a quern.Pipeline, got {type(pipe).__name__}")
        if pipe.batch_size is not None:
            raise ValueError(
                f"mix(): component {name!r} has a batch; mix pipelines without batch, then batch the mixture"
            )
        why = pipe.stream.refusal("mix")
        if why is not None:
            raise ValueError(f"mix(): component {name!r} {why}")
        if not (has(pipe.stream, SingleSource) or has(pipe.stream, RowMaking)):
            require(pipe.stream, SingleSource, f"mix(): component {name!r}: mix")
        names.append(name)
        pipes.append(pipe)
    return tuple(names), tuple(pipes)


def mix(
    components: Mapping[str, Pipeline] | Sequence[tuple[str, Pipeline]],
    weights: Mapping[str, float] | Sequence[float] | None = None,
    *,
    schedule: Sequence[Any] | None = None,
    seed: int = 0,
    block: int = _mixture.BLOCK,
    stop: Literal["first", "last"] = "first",
) -> Pipeline:
    """A pipeline (without batch) whose records come from named ``components``, mixed by weight.

    Each component is a pipeline without batch (any source, its own shuffle, filter and
    transforms, or packed rows of ``seq_len`` tokens: rows of a component, mixed by weight), in proportions ``weights`` (a dict by name, or a list in
    component order) or, with ``schedule=[(start_step, weights), ...]``, weights
    that change at those steps (the first stage starts at step 0; stages may start
    at any step). Weights are relative (normalised per stage); zero weights are
    allowed (a component zero everywhere is never read).

    Positions are assigned to components with exact counts per block of ``block``
    positions (1024; at least the number of components squared) and a keyed
    permutation (``seed``) inside each block; over any window of whole blocks a
    component's count is within the number of components of ``weight x length``,
    over any window of one stage within ``block / 2 + 3 x components`` (see
    :mod:`quern.pipeline.order.components`). The ``k``-th record drawn from a
    component is position ``k`` of that component's own stream, so each
    component has its own epochs. The batches before a stage's start are the same
    with or without that stage: a state saved at step ``k`` resumes on a
    pipeline whose schedule differs only in stages starting at ``k`` or later, or
    that adds (or drops) a component whose weight is zero in every stage starting
    before ``k``, as long as the block size stays the same (it is raised to the
    number of components squared: an edit that raises it changes the earlier
    batches and is refused).

    Components with ``num_epochs`` make a finite mixture, still step addressable:
    with ``stop="first"`` (grain's ``mix``) it ends at the first position whose
    component has no record left (an endless component never runs out, so a
    finite one ends it); with ``stop="last"`` an ended component's weight goes to
    the others (renormalised) from the position where it ended, and the mixture
    ends when every component has ended (all must be finite). The end depends
    only on the definition and the batch size (a schedule's stages start at steps).

    Chain ``.map(...)`` (transforms of the mixed records) and ``.batch(B)``;
    ``shuffle`` and ``filter`` belong to the components. ``explain`` names the
    component and the record in its source. Bad weights or schedules are a
    ``ValueError`` naming the stage and key.
    """
    names, pipes = _components(components)
    stages = _mixture.check_schedule(names, weights, schedule)
    seed = check_seed(seed)
    k = _mixture.block_size(len(names), check_int(block, "block", 1))
    if stop not in ("first", "last"):
        raise ValueError(f"mix(): stop must be 'first' or 'last', got {stop!r}")
    finite = [n for n, p in zip(names, pipes) if p.stream.length() is not None]
    if finite and stop == "last" and len(finite) < len(names):
        endless = [n for n in names if n not in finite]
        raise ValueError(
            f"mix(stop='last'): components {endless} are endless, so the mixture would never end; give every "
            "component num_epochs, or stop='first' (the mixture ends when a finite component runs out)"
        )
    stream = MixtureStream(
        names=names, components=pipes, stages=stages, seed=seed, block=k, stop=stop if finite else None
    )
    if finite and len(stages) == 1:
        stream.length()  # found now: a component whose weight is zero everywhere is an error here
    return Pipeline(stream=stream)
