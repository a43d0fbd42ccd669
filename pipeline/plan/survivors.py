"""The survivors of a filter: the sorted record ids it keeps, in a verified index file
(:mod:`.indexfile`, magic ``b"QUERNSV2"``, under ``cache_dir()/filters/``) that
records the key (the filter's fingerprint) it was built for."""

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


def store(path: str, ids: np.ndarray, n: int, key: str | None = None) -> None:
    """Write ``ids`` (sorted survivors among ``n`` candidates, found for the filter whose
    fingerprint is ``key``; default: the key ``path`` is named for) to ``path`` atomically."""
    indexfile.store(path, ids, n, MAGIC, key)


def load(path: str, n: int, key: str | None = None) -> tuple[np.ndarray | None, str]:
    """The verified survivors in ``path`` (read-only memory map) if it was built for
    ``key`` (default: the key ``path`` is named for), or ``None`` and why not."""
    return indexfile.load(path, n, MAGIC, key)
