"""What a step is computed for and what it gives: :class:`Where`, :class:`StepResult`, :class:`LengthCheck`."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Where", "StepResult", "LengthCheck"]


class Where(NamedTuple):
    """The step and host slice being computed, as messages name them."""

    step: int
    process_index: int = 0
    process_count: int = 1

    def __str__(self) -> str:
        return f"step {self.step} (host {self.process_index} of {self.process_count})"


class StepResult(NamedTuple):
    """The outcome of one step: its batch, or the error that stopped it."""

    step: int
    batch: Any
    error: BaseException | None


class LengthCheck(NamedTuple):
    """A bucket's check of its records against the length index it was bucketed by.

    Before record transform ``at`` (the bucket's ``pad``), every record's tokens (``len(record[key])``) must be what
    ``lengths`` (one value per source record) says, else the record could be cut to the bucket's bound or be in another
    bucket.
    """

    lengths: np.ndarray
    key: str | None
    at: int
