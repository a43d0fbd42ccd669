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
    """Saves an iterator's ``state()`` as ``quern_iterator.json``; restores it, checked against its pipeline.

    Its methods keep the signatures of orbax's ``JsonCheckpointHandler``, which
    orbax calls.

    Args:
        filename: the file's name in the checkpoint folder.
        **kwargs: passed to ``JsonCheckpointHandler``.
    """

    def __init__(self, filename: str | None = None, **kwargs: Any) -> None:
        super().__init__(filename or "quern_iterator.json", **kwargs)

    async def async_save(self, directory: Any, item: Any = None, args: QuernSave | None = None) -> Any:
        """Save the iterator's state (orbax calls it).

        Args:
            directory: the checkpoint folder.
            item: the iterator or a state dict (orbax's older form; ``args`` is preferred).
            args: a :class:`QuernSave`.

        Returns:
            Orbax's futures of the write.
        """
        source = args.iterator if args is not None else item
        state = source.state() if hasattr(source, "state") else dict(source)
        return await super().async_save(directory, args=ocp.args.JsonSave(state))

    def restore(self, directory: Any, item: Any = None, args: QuernRestore | None = None) -> dict:
        """Read the state back, checked against ``args.pipeline`` when it is given (orbax calls it).

        Args:
            directory: the checkpoint folder.
            item: unused (orbax's older form).
            args: a :class:`QuernRestore`.

        Returns:
            The state dict, its ``step`` the step to resume at.

        Raises:
            ValueError: the state was saved from a pipeline with another
                fingerprint, and ``args.force`` is not set.
        """
        state = dict(super().restore(directory))
        if args is not None and args.pipeline is not None:
            state["step"] = args.pipeline.check_state(state, force=args.force)
        return state


@ocp.args.register_with_handler(QuernCheckpointHandler, for_save=True)
@dataclasses.dataclass
class QuernSave(ocp.args.CheckpointArgs):
    """Save ``iterator.state()``.

    Attributes:
        iterator: any object with ``state()``, or a state dict.
    """

    iterator: Any


@ocp.args.register_with_handler(QuernCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class QuernRestore(ocp.args.CheckpointArgs):
    """Restore the state dict; with ``pipeline``, refuse one saved from another pipeline unless ``force``.

    Attributes:
        pipeline: the pipeline the state will resume (``None``: not checked).
        force: accept a state saved from a pipeline with another fingerprint.
    """

    pipeline: Any = None
    force: bool = False
