"""quern and grain both ways: a pipeline as a ``grain.MapDataset`` of batches, grain's data sources as quern sources.

:func:`map_dataset` keeps grain's ``DataLoader`` / ``IterDataset`` code and its
checkpointing on top of quern: item ``s`` of the dataset is ``pipe.batch_at(s)`` (a
host's slice when given one), so grain's iterator state, an index, is a quern step.
:func:`source` reads any ``grain.sources.RandomAccessDataSource`` (``len`` and
``__getitem__``) in quern, through its bulk ``__getitems__`` where it has one;
grain's ``ArrayRecordDataSource`` is described in the fingerprint by its files (name,
size, records, a sampled hash), other sources as
:class:`~quern.pipeline.sources.memory.SequenceSource` describes them.
"""

from __future__ import annotations

from typing import Any

from ..pipeline.sources.base import file_identity
from ..pipeline.sources.memory import SequenceSource
from . import check_pipeline

__all__ = ["GrainSource", "map_dataset", "source"]


class GrainSource(SequenceSource):
    """A grain data source read by quern (what :func:`source` returns)."""

    def identity(self) -> dict:
        """The files of an ``ArrayRecordDataSource`` (name, size, records, a sampled hash); else as a sequence."""
        paths = getattr(self.obj, "paths", None)
        instructions = getattr(self.obj, "_read_instructions", None)
        if type(self.obj).__name__ == "ArrayRecordDataSource" and paths and instructions is not None:
            counts = [int(ri.num_records) for ri in instructions]
            starts = [int(getattr(ri, "start", 0)) for ri in instructions]
            files = file_identity([str(p) for p in paths], counts)
            out = {**super(SequenceSource, self).identity(), "object": "grain.ArrayRecordDataSource"}
            return {**out, "files": files, "starts": starts}
        return super().identity()


def source(grain_source: Any, name: str | None = None) -> GrainSource:
    """A grain data source (``len`` and ``__getitem__``, ``__getitems__`` used when there) as a quern source.

    Args:
        grain_source: ``grain.sources.ArrayRecordDataSource``, an in-memory source, or your own.
        name: the source's name (default: the object's ``name``, else its type's).

    Raises:
        TypeError: it lacks ``__len__`` or ``__getitem__``.

    Example:
        >>> import grain, quern
        >>> from quern.interop.grain import source
        >>> src = source(grain.sources.RangeDataSource(0, 10, 1), name="range")
        >>> quern.Pipeline.from_source(src, seed=0).batch(4).batch_at(1).tolist()
        [4, 5, 6, 7]
    """
    return GrainSource(grain_source, name=name)


def map_dataset(pipe: Any, *, process_index: int = 0, process_count: int = 1) -> Any:
    """``pipe`` as a ``grain.MapDataset`` whose item ``s`` is ``pipe.batch_at(s, process_index, process_count)``.

    Its length is the pipeline's steps (an endless pipeline: ``sys.maxsize``, as grain's
    ``repeat()`` gives). Shuffle, batch and mix in quern, not in grain: the items are
    already batches in quern's order. Iterated through ``to_iter_dataset()``, grain's
    checkpoint is the next index: the next step.

    Args:
        pipe: the pipeline, with ``batch()``.
        process_index: this host's slice of each batch.
        process_count: the hosts.

    Raises:
        ValueError: a pipeline without ``batch()`` or with device stages, or a host slice that does not divide
            the batch.
        ImportError: grain is not installed.

    Example:
        >>> import numpy as np, quern
        >>> from quern.interop.grain import map_dataset
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(40)}, seed=1, num_epochs=1).shuffle().batch(8)
        >>> ds = map_dataset(pipe)
        >>> len(ds), bool((ds[2]["x"] == pipe.batch_at(2)["x"]).all())
        (5, True)
    """
    import sys

    import grain

    if pipe.batch_size is None:
        raise ValueError("map_dataset() needs a pipeline with batch(): an item is a step's batch")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not one of process_count={process_count} hosts")
    check_pipeline(pipe, "quern.interop.grain.map_dataset", process_index, process_count)
    steps = pipe.num_steps

    class _Steps(grain.MapDataset):
        """The pipeline's steps as items."""

        def __len__(self) -> int:
            return sys.maxsize if steps is None else int(steps)

        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, slice):
                return self.slice(index)
            return pipe.batch_at(int(index), process_index, process_count)

        def __str__(self) -> str:
            return f"quern.interop.grain.map_dataset({pipe!r})"

    return _Steps()
