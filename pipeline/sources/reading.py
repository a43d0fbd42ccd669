"""Whether a bulk read may spread its records over the reading library's own threads.

ArrayRecord's ``read(list)`` hands the records of one call to the library's thread
pool (64 threads, each spinning a while before it sleeps) with the GIL released. In
one process that overlaps the read with Python work on other threads, and it is the
faster way. In a worker process the parallelism is the processes': there the pool's
threads only add their own CPU (about a fifth of a 1 KiB record's read, measured in
``benchmarks/vs_grain.py``) and take cores from the other workers, so where the
workers fill the cores (:func:`threads_help`) each reads a file of one record per
chunk a record at a time on its calling thread instead (``seek`` and ``read()``,
which hold the GIL: only the worker's own fetch threads wait on it). The records
read are the same either way; only the cost differs.
"""

from __future__ import annotations

import os

__all__ = ["library_threads", "threads_help", "usable_cores", "use_library_threads"]

_STATE = {"library_threads": True}


def use_library_threads(on: bool) -> None:
    """Let (``True``, the default) or stop (``False``) this process's bulk reads using the library's threads.

    Args:
        on: whether reads may use the library's thread pool; a worker process sets ``False`` as it starts.
    """
    _STATE["library_threads"] = bool(on)


def library_threads() -> bool:
    """Whether this process's bulk reads may use the reading library's thread pool.

    Returns:
        ``True`` unless :func:`use_library_threads` turned it off (in a worker process).

    Example:
        >>> library_threads()
        True
    """
    return _STATE["library_threads"]


def threads_help(processes: int) -> bool:
    """Whether a library's threads may help ``processes`` worker processes: fewer processes than usable cores.

    Where the processes fill the cores, the library's threads only compete with them, and each worker
    reads on its calling thread; where cores are left over, the threads put them to use.

    Args:
        processes: the worker processes of one pool.

    Returns:
        ``processes`` below the cores this process may run on (its CPU affinity).
    """
    return processes < usable_cores()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system has one, else the CPU count.

    Cgroup CPU quotas are not counted.

    Returns:
        At least 1.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
