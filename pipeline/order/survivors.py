"""The survivors of a filter: the sorted record ids it keeps, in a verified index file.

The file (:mod:`.indexfile`, magic ``b"QUERNSV2"``, under ``cache_dir()/filters/``)
records the key (the filter's fingerprint) it was built for.
"""

from __future__ import annotations

import os

import numpy as np

from . import indexfile
from .indexfile import cache_dir

__all__ = ["MAGIC", "cache_dir", "path_for", "store", "load"]

MAGIC = indexfile.SURVIVORS


def path_for(key: str, override: str | os.PathLike | None = None) -> str:
    """Where the survivors of the filter whose fingerprint is ``key`` are kept.

    Args:
        key: the filter's fingerprint.
        override: the cache folder to use instead of the default (:func:`cache_dir`).

    Returns:
        ``filters/<key>.survivors`` in the cache folder.
    """
    return indexfile.path_for(key, override, kind=MAGIC)


def store(path: str, ids: np.ndarray, n: int, *, key: str | None = None) -> None:
    """Write a filter's survivors to ``path`` atomically.

    Args:
        path: where to write them.
        ids: the sorted survivors.
        n: the number of candidate records they were found among.
        key: the filter's fingerprint (default: the key ``path`` is named for).

    Raises:
        ValueError: ``key`` is longer than 32 ASCII characters.
        OSError: the file cannot be written.
    """
    indexfile.store(path, ids, n, kind=MAGIC, key=key)


def load(path: str, n: int, *, key: str | None = None) -> tuple[np.ndarray | None, str]:
    """The verified survivors in ``path``, or why they cannot be used.

    Args:
        path: the file.
        n: the number of candidate records they must have been found among.
        key: the filter's fingerprint the file must have been built for (default: the
            key ``path`` is named for).

    Returns:
        ``(ids, "verified")``, the ids a read-only memory map, or ``(None, why)``
        (see :func:`.indexfile.load`).
    """
    return indexfile.load(path, n, kind=MAGIC, key=key)
