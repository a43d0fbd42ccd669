"""Orbax checkpointing of the iterator state, next to the model state.

The state is tiny JSON (``{"step": ..., "fingerprint": ...}``), written by the
primary host. Register nothing: the argument types are registered with their
handler, so they compose with the model's in one ``CheckpointManager``::

    import orbax.checkpoint as ocp
    from quern.sharding.checkpoint import QuernRestore, QuernSave

    mngr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(params), data=QuernSave(it)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(params), data=QuernRestore(pipe)))
    it = quern.sharding.global_iterator(pipe, mesh, start_step=restored.data["step"])

Restoring against a pipeline with another fingerprint (another definition, or
changed data) raises ``ValueError`` unless ``QuernRestore(pipe, force=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp

__all__ = ["QuernCheckpointHandler", "QuernSave", "QuernRestore"]


class QuernCheckpointHandler(ocp.JsonCheckpointHandler):
    """Saves an iterator's ``state()`` as ``quern_iterator.json``; restores it, checked
    against the pipeline it will resume."""

    def __init__(self, filename: str | None = None, **kwargs: Any) -> None:
        super().__init__(filename or "quern_iterator.json", **kwargs)

    async def async_save(self, directory: Any, item: Any = None, args: QuernSave | None = None) -> Any:
        source = args.iterator if args is not None else item
        state = source.state() if hasattr(source, "state") else dict(source)
        return await super().async_save(directory, args=ocp.args.JsonSave(state))

    def restore(self, directory: Any, item: Any = None, args: QuernRestore | None = None) -> dict:
        state = dict(super().restore(directory))
        if args is not None and args.pipeline is not None:
            state["step"] = args.pipeline.check_state(state, force=args.force)
        return state


@ocp.args.register_with_handler(QuernCheckpointHandler, for_save=True)
@dataclasses.dataclass
class QuernSave(ocp.args.CheckpointArgs):
    """Save ``iterator.state()`` (any object with ``state()``, or a state dict)."""

    iterator: Any


@ocp.args.register_with_handler(QuernCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class QuernRestore(ocp.args.CheckpointArgs):
    """Restore the state dict; with ``pipeline``, refuse one saved from another pipeline
    unless ``force``."""

    pipeline: Any = None
    force: bool = False
