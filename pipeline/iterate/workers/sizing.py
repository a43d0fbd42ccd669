"""How many steps a task holds and a worker has in flight.

The sizes depend on the batch size and host slice (records per step), the pool's
``num_workers``, ``prefetch`` and ``read_ahead``, and this process's limit of
open files (the parent maps one descriptor per shared-memory slot), which
:func:`descriptor_room` raises towards the hard limit when needed. They change
how much is computed ahead, never a batch's bytes.
"""

from __future__ import annotations

import os

from ... import execute
from ...core.timing import MAX_WINDOW
from ...order.index import host_rows

__all__ = ["TASK_RECORDS", "MAX_TASK_STEPS", "SHARED_MEMORY_BUDGET", "task_sizes", "fit_read_ahead", "descriptor_room"]

TASK_RECORDS = 16384  # default task: about this many records read in one bulk call...
MAX_TASK_STEPS = 64  # ...but at most this many steps
SHARED_MEMORY_BUDGET = 256 << 20  # ...and the default task size keeps all slots within this


def task_sizes(
    batch_size: int | None,
    num_workers: int,
    *,
    process_index: int,
    process_count: int,
    prefetch: int,
    read_ahead: int | None,
) -> tuple[int, int]:
    """The largest task and the most steps a worker may have in flight.

    Args:
        batch_size: Rows of a global batch (``None``: unbatched, 0 rows).
        num_workers: Worker processes of the pool.
        process_index: This host's index.
        process_count: The number of hosts.
        prefetch: Tasks each worker has in flight.
        read_ahead: Steps per task; ``None`` picks about :data:`TASK_RECORDS`
            records per task (at most :data:`MAX_TASK_STEPS` steps), made smaller
            where the descriptors this process may open would not hold the slots.

    Returns:
        ``(read_ahead, most_in_flight)``: steps per task, and steps per worker in
        flight (its ``prefetch`` tasks, plus at most half the descriptors left, for
        an adaptive prefetch window).
    """
    auto = read_ahead is None
    if read_ahead is None:
        lo, hi = host_rows(batch_size or 0, process_index, process_count)
        read_ahead = execute.steps_per_read(hi - lo, TASK_RECORDS, MAX_TASK_STEPS)
    wanted = num_workers * (prefetch * read_ahead + 2)  # one descriptor per slot, plus spares
    room = descriptor_room(wanted + MAX_WINDOW)  # and room for an adaptive prefetch window
    # steps per worker in flight: the prefetch tasks, and at most half the descriptors left for a window
    most_in_flight = prefetch * read_ahead + max(0, room - wanted) // 2 // num_workers
    if auto and room < wanted:
        read_ahead = max(1, (room // num_workers - 2) // prefetch)
    return read_ahead, most_in_flight


def fit_read_ahead(nbytes: int, num_workers: int, *, prefetch: int, max_read_ahead: int) -> int:
    """Steps per task once a batch is known to take ``nbytes`` of shared memory.

    Args:
        nbytes: The shared memory one batch takes.
        num_workers: Worker processes of the pool.
        prefetch: Tasks each worker has in flight.
        max_read_ahead: The most steps per task.

    Returns:
        As many steps as keep every worker's slots within :data:`SHARED_MEMORY_BUDGET`,
        between 1 and ``max_read_ahead``.

    Example:
        >>> fit_read_ahead(1 << 20, 4, prefetch=2, max_read_ahead=64)  # 1 MiB batches: 256 MiB / (4 * 2 * 1 MiB)
        32
    """
    fit = SHARED_MEMORY_BUDGET // (num_workers * prefetch * max(nbytes, 1))
    return max(1, min(max_read_ahead, fit))


def descriptor_room(wanted: int) -> int:
    """How many more files this process may open, after raising its limit if ``wanted`` more would not fit.

    The soft limit (``RLIMIT_NOFILE``) is raised towards the hard one; the parent
    maps one descriptor per shared-memory slot, and workers inherit the limit.

    Args:
        wanted: The descriptors the caller wants to open.

    Returns:
        The descriptors left (``wanted`` when there is no limit).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 256
    need = in_use + wanted + 64  # 64: headroom for everything else
    if soft != resource.RLIM_INFINITY and need > soft:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
    return wanted if soft == resource.RLIM_INFINITY else max(0, soft - in_use - 64)
