"""The survivors of a filter: the sorted record ids it keeps, in a verified index file
(:mod:`.indexfile`, magic ``b"QUERNSV1"``, under ``cache_dir()/filters/``)."""

from __future__ import annotations

import os

import numpy as np

from . import indexfile
from .indexfile import cache_dir

__all__ = ["MAGIC", "cache_dir", "path_for", "store", "load"]

MAGIC = indexfile.SURVIVORS


def path_for(key: str, override: str | os.PathLike | None = None) -> str:
    """Where the survivors of the filter whose fingerprint is ``key`` are kept."""
    return indexfile.path_for(key, override, MAGIC)


def store(path: str, ids: np.ndarray, n: int) -> None:
    """Write ``ids`` (sorted survivors among ``n`` candidates) to ``path`` atomically."""
    indexfile.store(path, ids, n, MAGIC)


def load(path: str, n: int) -> tuple[np.ndarray | None, str]:
    """The verified survivors in ``path`` (read-only memory map), or ``None`` and why not."""
    return indexfile.load(path, n, MAGIC)
