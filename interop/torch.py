"""A quern pipeline as PyTorch batches: :func:`loader`, with the ``StatefulDataLoader`` protocol.

``quern.interop.torch.loader(pipe)`` is an iterable of this rank's batches of ``pipe``
as ``torch.Tensor`` trees (rank ``r`` of ``W`` holds rows ``[r*B/W, (r+1)*B/W)`` of
every global batch, as a JAX host does), starting at ``start_step``. Its
``state_dict()`` is quern's state (the next step and the fingerprint), which torch's
checkpoints (``torch.save``, DCP) carry; ``load_state_dict`` checks it against the
pipeline, so a changed pipeline is refused, and the next iteration starts at its step,
on any world size that divides the batch: the global batches are the same.

It is also a ``torch.utils.data.IterableDataset``, for code that keeps its own
``DataLoader(loader, batch_size=None)``: with ``num_workers=W`` there, torch's worker
``w`` computes the steps ``start + w, start + w + W, ...`` (each step once; torch
takes them in turn, so the order is kept), but the ``DataLoader`` has no
``state_dict``: resume by building the loader with ``start_step``.

Tensors share memory with the NumPy batch where torch has the dtype (``torch.from_numpy``);
the ml_dtypes torch also has (``bfloat16`` and the ``float8`` kinds) become torch's by their
bits; other ml_dtypes (``int4``, say), strings and objects are refused by leaf.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..pipeline.core.tree import leaves, map_leaves
from . import check_pipeline

__all__ = ["Loader", "loader", "to_torch"]

_BY_BITS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
"""The ml_dtypes that torch also has: converted by their bits."""

_torch: Any = None
_Base: Any = object
try:  # the base class when torch is installed (quern does not need it otherwise)
    import torch
except ImportError:  # pragma: no cover - torch is an extra
    pass
else:
    _torch, _Base = torch, torch.utils.data.IterableDataset


def _need_torch() -> Any:
    if _torch is None:
        raise ImportError("quern.interop.torch needs torch: pip install 'quern[torch]'")
    return _torch


def to_torch(batch: Any, *, pin_memory: bool = False, device: Any = None, where: str = "batch") -> Any:
    """``batch`` with every array leaf as a ``torch.Tensor`` (sharing memory where it can).

    Args:
        batch: a tree of NumPy arrays (dicts, tuples, lists).
        pin_memory: copy each tensor into pinned memory (needs CUDA).
        device: move each tensor there (``non_blocking`` from pinned memory).
        where: names the batch in messages (``"step 12"``).

    Raises:
        TypeError: a leaf torch cannot hold (strings, objects, an ml_dtype other than bfloat16), by its path.
    """
    torch = _need_torch()

    by_bits = {name: getattr(torch, name) for name in _BY_BITS if hasattr(torch, name)}

    def one(path: str, x: Any) -> Any:
        arr = np.asarray(x)
        if arr.dtype.kind in "OUSV" and arr.dtype.name not in by_bits:
            raise TypeError(
                f"{where}: leaf {path} is {arr.dtype} of shape {arr.shape}, which torch cannot hold as a tensor; "
                "turn it into numbers in a transform (or drop it) before the loader"
            )
        if arr.dtype.name in by_bits:  # ml_dtypes torch has: the same bits, viewed as torch's dtype
            bits = np.ascontiguousarray(arr).view(np.int16 if arr.dtype.itemsize == 2 else np.uint8)
            t = torch.from_numpy(bits).view(by_bits[arr.dtype.name])
        else:
            t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if pin_memory:
            t = t.pin_memory()
        if device is not None:
            t = t.to(device, non_blocking=pin_memory)
        return t

    paths = iter([path for path, _ in leaves(batch)])  # the leaves in map_leaves' order
    return map_leaves(lambda x: one(next(paths), x), batch)


class Loader(_Base):
    """This rank's batches of a pipeline as torch tensors; what :func:`loader` returns (its arguments)."""

    def __init__(
        self,
        pipe: Any,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        start_step: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        device: Any = None,
        **options: Any,
    ) -> None:
        torch = _need_torch()
        if pipe.batch_size is None:
            raise ValueError("quern.interop.torch.loader needs a pipeline with batch(): a step is a batch")
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        self.rank = int(rank if rank is not None else (dist.get_rank() if ready else 0))
        self.world_size = int(world_size if world_size is not None else (dist.get_world_size() if ready else 1))
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is not one of world_size={self.world_size} ranks (0..{self.world_size - 1})"
            )
        if pipe.batch_size % self.world_size:
            raise ValueError(
                f"world_size={self.world_size} does not divide the global batch of {pipe.batch_size} rows: every "
                "rank holds batch/world_size rows"
            )
        check_pipeline(pipe, "quern.interop.torch.loader", self.rank, self.world_size)
        wants_cuda = pin_memory or (device is not None and torch.device(device).type == "cuda")
        if wants_cuda and not torch.cuda.is_available():
            what = "pin_memory=True" if pin_memory else f"device={device!r}"
            raise ValueError(f"{what} needs CUDA, and torch sees none here (torch.cuda.is_available() is False)")
        self.pipe = pipe
        self.step = pipe.check_step(start_step, name="start_step", end_ok=True)
        self.num_workers, self.pin_memory, self.device, self.options = num_workers, pin_memory, device, options

    def __iter__(self) -> Iterator[Any]:
        """This rank's batches from the current step on (in a torch ``DataLoader`` worker: its share of the steps)."""
        torch = _need_torch()
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:  # inside DataLoader(num_workers=W): every W-th step
            yield from self._strided(info.id, info.num_workers)
            return
        with self.pipe.iterator(
            start_step=self.step,
            process_index=self.rank,
            process_count=self.world_size,
            num_workers=self.num_workers,
            **self.options,
        ) as it:
            for batch in it:
                out = to_torch(batch, pin_memory=self.pin_memory, device=self.device, where=f"step {self.step}")
                self.step += 1
                yield out

    def _strided(self, worker: int, workers: int) -> Iterator[Any]:
        step = self.step + worker
        end = self.pipe.num_steps
        while end is None or step < end:
            batch = self.pipe.batch_at(step, self.rank, self.world_size)
            yield to_torch(batch, where=f"step {step}")
            step += workers

    def __len__(self) -> int:
        """The steps left (an endless pipeline has no length: ``TypeError``)."""
        if self.pipe.num_steps is None:
            raise TypeError("an endless pipeline has no len()")
        return int(self.pipe.num_steps - self.step)

    def state_dict(self) -> dict[str, Any]:
        """Quern's state: the next step, the fingerprint and the description (JSON-able, for ``torch.save``)."""
        return dict(self.pipe.state_at(self.step))

    def load_state_dict(self, state_dict: dict[str, Any], force: bool = False) -> None:
        """Resume at ``state_dict``'s step after checking it was saved from this pipeline.

        Raises:
            ValueError: a state of another pipeline (naming the first difference), or not quern's
                (torch's own ``DataLoader`` state, say).
        """
        if not isinstance(state_dict, dict) or ("fingerprint" not in state_dict and not force):
            keys = sorted(state_dict)[:6] if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"load_state_dict: not a quern state (keys {keys}); pass what loader.state_dict() returned"
            )
        self.step = self.pipe.check_state(state_dict, force=force)


def loader(
    pipe: Any,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    start_step: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    device: Any = None,
    **options: Any,
) -> Loader:
    """This rank's batches of ``pipe`` as torch tensors, resumable by ``state_dict`` / ``load_state_dict``.

    Args:
        pipe: the pipeline, with ``batch(B)``: ``B`` is the global batch.
        rank: this rank (default: ``torch.distributed``'s when it is initialised, else 0).
        world_size: the ranks (default: ``torch.distributed``'s, else 1); it divides ``B``.
        start_step: the first step.
        num_workers: quern's worker processes (not torch's).
        pin_memory: copy batches into pinned memory (needs CUDA).
        device: move batches there (``"cuda"``; ``non_blocking`` with ``pin_memory``).
        **options: more of ``pipe.iterator``'s options (``prefetch``, ``num_threads``, ``ledger``...).

    Returns:
        A :class:`Loader` (also a ``torch.utils.data.IterableDataset``).

    Raises:
        ValueError: no batch, a rank outside the world, a world size that does not divide the batch, CUDA
            asked for where there is none.
        ImportError: torch is not installed.

    Example:
        >>> import numpy as np, quern
        >>> from quern.interop.torch import loader
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(64)}, seed=0).shuffle().batch(8)
        >>> it = loader(pipe, rank=1, world_size=2)
        >>> batch = next(iter(it))
        >>> type(batch["x"]).__name__, tuple(batch["x"].shape), it.state_dict()["step"]
        ('Tensor', (4,), 1)
    """
    return Loader(
        pipe,
        rank=rank,
        world_size=world_size,
        start_step=start_step,
        num_workers=num_workers,
        pin_memory=pin_memory,
        device=device,
        **options,
    )
