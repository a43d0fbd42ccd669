"""The disk cache's eviction rules replayed over a planned read trace: hits, misses and bytes fetched.

:class:`~quern.pipeline.remote.cache.ShardCache` fetches a remote file whole on
its first read, keeps it, and once it holds more than ``capacity`` bytes evicts
entries until it fits again, never the file just read: the least recently used
first (LRU), or, when it is told when each entry is next needed (the iterator's
lookahead), the one needed furthest ahead first, the oldest among equals
(Belady's rule). :func:`simulate` replays exactly that over a trace of file
reads, one cache per host, so that ``quern plan`` can say what a run will fetch
before it runs; :func:`no_refetch_bytes` gives the smallest cache under which
Belady's rule never fetches a file twice.

A trace is host-major: ``files[bounds[h]:bounds[h + 1]]`` are the files host
``h`` reads, in the order it reads them (one entry per read of a file, which is
one ``get`` of the cache). Everything here is pure arithmetic over arrays; the
replay is one loop per read, compiled by numba when it is installed
(``quern[plan]``) and plain Python otherwise (the same figures, about 100x
slower).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = [
    "NEVER",
    "POLICIES",
    "CacheFigures",
    "compiled",
    "first_reads",
    "next_reads",
    "no_refetch_bytes",
    "simulate",
]

NEVER = np.iinfo(np.int64).max  # the next read of a file read no more
POLICIES = ("belady", "lru")
Policy = Literal["belady", "lru"]


class CacheFigures(NamedTuple):
    """Per host, what its cache did over the trace (int64 arrays of one value per host)."""

    hits: np.ndarray  # reads of a file the cache held
    misses: np.ndarray  # reads that fetched the file
    bytes_fetched: np.ndarray  # the bytes of the files fetched
    evictions: np.ndarray  # files evicted
    missed: np.ndarray  # per read of the trace, whether it fetched its file


def next_reads(
    files: np.ndarray, bounds: np.ndarray, n_files: int | None = None, *, compile: bool = True
) -> np.ndarray:
    """For each read, the index of the same host's next read of the same file (:data:`NEVER`: none).

    Args:
        files: the file of each read, host-major (see the module docstring).
        bounds: ``H + 1`` offsets: host ``h``'s reads are ``files[bounds[h]:bounds[h + 1]]``.
        n_files: one more than the largest file (default: computed).
        compile: use numba when installed.

    Returns:
        An int64 array like ``files``.

    Example:
        >>> next_reads(np.array([3, 5, 3, 3]), np.array([0, 2, 4]), compile=False).tolist() == [NEVER, NEVER, 3, NEVER]
        True
    """
    files = np.ascontiguousarray(files, dtype=np.int64)
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    if n_files is None:
        n_files = int(files.max()) + 1 if len(files) else 0
    out = np.empty(len(files), dtype=np.int64)
    _kernels(compile)[1](files, bounds, n_files, out)
    return out


def _build(jit: Callable[[Any], Any]) -> tuple[Callable[..., None], Callable[..., None]]:
    """The replay and the next reads, their helpers wrapped by ``jit`` (numba's, or none: plain Python)."""

    @jit
    def before(key: np.ndarray, order: np.ndarray, i: int, j: int) -> bool:
        """Whether heap entry ``i`` comes before entry ``j``: a smaller key, then a smaller read index."""
        return key[i] < key[j] or (key[i] == key[j] and order[i] < order[j])

    @jit
    def swap(key: np.ndarray, order: np.ndarray, item: np.ndarray, slot: np.ndarray, i: int, j: int) -> None:
        key[i], key[j] = key[j], key[i]
        order[i], order[j] = order[j], order[i]
        item[i], item[j] = item[j], item[i]
        slot[item[i]] = i
        slot[item[j]] = j

    @jit
    def sift(key: np.ndarray, order: np.ndarray, item: np.ndarray, slot: np.ndarray, i: int, size: int) -> None:
        """Restore the heap order around entry ``i`` (up, then down)."""
        while i > 0 and before(key, order, i, (i - 1) // 2):
            swap(key, order, item, slot, i, (i - 1) // 2)
            i = (i - 1) // 2
        while True:
            c = 2 * i + 1
            if c >= size:
                return
            if c + 1 < size and before(key, order, c + 1, c):
                c += 1
            if not before(key, order, c, i):
                return
            swap(key, order, item, slot, i, c)
            i = c

    @jit
    def replay(
        files: np.ndarray,
        sizes: np.ndarray,
        bounds: np.ndarray,
        nxt: np.ndarray,
        capacity: int,
        belady: bool,
        out: np.ndarray,
        missed: np.ndarray,
    ) -> None:
        """The replay, one host after another; ``out[h] = (hits, misses, bytes fetched, evictions)``, ``missed[a]``.

        The files a host's cache holds are kept in a binary min-heap indexed by file
        (``slot``), keyed by ``(key, last read)``: LRU's key is the last read's index,
        Belady's minus the index of the file's next read (so the file read again
        furthest ahead, or never, comes first, then the oldest). A read updates its
        file's key in place, so the heap holds exactly the cached files.
        """
        slot = np.full(len(sizes), -1, dtype=np.int64)  # the file's place in the heap, -1: not cached
        key = np.empty(len(sizes), dtype=np.int64)
        order = np.empty(len(sizes), dtype=np.int64)
        item = np.empty(len(sizes), dtype=np.int64)
        for h in range(len(bounds) - 1):
            size, total = 0, 0
            hits, misses, fetched, evicted = 0, 0, 0, 0
            for a in range(bounds[h], bounds[h + 1]):
                x = files[a]
                k = -nxt[a] if belady else a  # NEVER: -NEVER, the smallest key: evicted first
                i = slot[x]
                if i >= 0:
                    hits += 1
                    key[i], order[i] = k, a
                    sift(key, order, item, slot, i, size)
                    continue
                misses += 1
                missed[a] = True
                fetched += sizes[x]
                total += sizes[x]
                while total > capacity and size > 0:  # evict (the file just read is not in the heap yet)
                    y = item[0]
                    total -= sizes[y]
                    evicted += 1
                    slot[y] = -1
                    size -= 1
                    if size > 0:
                        key[0], order[0], item[0] = key[size], order[size], item[size]
                        slot[item[0]] = 0
                        sift(key, order, item, slot, 0, size)
                key[size], order[size], item[size] = k, a, x
                slot[x] = size
                size += 1
                sift(key, order, item, slot, size - 1, size)
            for j in range(size):  # the next host starts with an empty cache
                slot[item[j]] = -1
            out[h, 0], out[h, 1], out[h, 2], out[h, 3] = hits, misses, fetched, evicted

    @jit
    def following(files: np.ndarray, bounds: np.ndarray, n_files: int, out: np.ndarray) -> None:
        """``out[a]``: the index of the next read of ``files[a]`` by the same host (one pass backwards)."""
        seen = np.full(n_files, NEVER, dtype=np.int64)
        for h in range(len(bounds) - 1):
            for a in range(bounds[h + 1] - 1, bounds[h] - 1, -1):
                out[a] = seen[files[a]]
                seen[files[a]] = a
            for a in range(bounds[h], bounds[h + 1]):
                seen[files[a]] = NEVER

    return replay, following


_KERNELS: dict[bool, tuple[Callable[..., None], Callable[..., None]]] = {}


def compiled() -> bool:
    """Whether the replay is compiled (numba is installed): else it runs as plain Python."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels(compile: bool) -> tuple[Callable[..., None], Callable[..., None]]:
    """The replay and the next reads: compiled by numba (once per process) when ``compile`` and numba is installed."""
    compile = compile and compiled()
    if compile not in _KERNELS:
        if compile:
            import numba

            _KERNELS[compile] = _build(numba.njit(nogil=True, cache=False))
        else:
            _KERNELS[compile] = _build(lambda f: f)
    return _KERNELS[compile]


def simulate(
    files: np.ndarray,
    sizes: np.ndarray,
    bounds: np.ndarray,
    capacity: int,
    policy: Policy = "belady",
    *,
    compile: bool = True,
) -> CacheFigures:
    """Replay ``ShardCache``'s eviction over a trace: one cache of ``capacity`` bytes per host, empty at its start.

    A read of a file the cache holds is a hit; any other read fetches the file
    (a miss: its bytes are fetched), then evicts entries, never the file just
    read, while the cache holds more than ``capacity`` bytes: by ``policy``,
    ``"lru"`` the least recently read first, ``"belady"`` the one read again
    furthest ahead first (one not read again before all others), the least
    recently read among equals. The figures depend on the trace, the sizes, the
    capacity and the policy only.

    Args:
        files: the file of each read, host-major (ints in ``[0, len(sizes))``).
        sizes: the bytes of each file.
        bounds: ``H + 1`` offsets of the hosts' reads in ``files``.
        capacity: the cache's bytes.
        policy: ``"belady"`` or ``"lru"``.
        compile: use numba when installed (``False``: the plain Python loop).

    Returns:
        :class:`CacheFigures`, one value per host.

    Raises:
        ValueError: an unknown policy, or a capacity below 1.

    Example:
        >>> f = simulate(np.array([0, 1, 0, 2, 0]), np.array([10, 10, 10]), np.array([0, 5]), 20, "lru", compile=False)
        >>> f.misses.tolist(), f.hits.tolist(), f.bytes_fetched.tolist()
        ([3], [2], [30])
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if int(capacity) < 1:
        raise ValueError(f"the cache capacity must be at least 1 byte, got {capacity}")
    files = np.ascontiguousarray(files, dtype=np.int64)
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    nxt = next_reads(files, bounds, len(sizes), compile=compile)
    out = np.zeros((len(bounds) - 1, 4), dtype=np.int64)
    missed = np.zeros(len(files), dtype=np.bool_)
    _kernels(compile)[0](files, sizes, bounds, nxt, int(capacity), policy == "belady", out, missed)
    return CacheFigures(out[:, 0], out[:, 1], out[:, 2], out[:, 3], missed)


def first_reads(nxt: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which reads are the first, and which the last, of their file by their host within their group.

    Args:
        nxt: each read's next read of the same file by the same host (:func:`next_reads`).
        group: per read, its group (an epoch, a window), non-decreasing within a host.

    Returns:
        ``(first, last)``, two bool arrays like ``nxt``.

    Example:
        >>> nxt = next_reads(np.array([3, 3, 3]), np.array([0, 3]), compile=False)
        >>> [x.tolist() for x in first_reads(nxt, np.array([0, 0, 1]))]
        [[True, False, True], [False, True, True]]
    """
    group = np.asarray(group, dtype=np.int64)
    again = nxt != NEVER
    again[again] = group[nxt[again]] == group[again]  # read again in the same group
    first = np.ones(len(nxt), dtype=bool)
    first[nxt[again]] = False  # the next read of a read in its group is not a first read
    return first, ~again


def no_refetch_bytes(
    files: np.ndarray,
    sizes: np.ndarray,
    bounds: np.ndarray,
    group: np.ndarray,
    *,
    nxt: np.ndarray | None = None,
    compile: bool = True,
) -> np.ndarray:
    """Per host, the smallest cache under which Belady's rule fetches no file twice within a group of reads.

    Within a group (an epoch), a file is live from its first read to its last;
    Belady's rule evicts files read no more first, so no live file is ever
    evicted exactly when the cache holds the bytes of the files live at every
    read. The answer is the most bytes live at once, over the host's reads.

    Args:
        files: the file of each read, host-major.
        sizes: the bytes of each file.
        bounds: ``H + 1`` offsets of the hosts' reads.
        group: per read, its group (an epoch number), non-decreasing within a host.
        nxt: :func:`next_reads` of ``files``, if already computed.
        compile: use numba when installed.

    Returns:
        An int64 array, one value per host (0 for a host that reads nothing).

    Example:
        >>> no_refetch_bytes(np.array([0, 1, 0, 2]), np.array([5, 7, 11]), np.array([0, 4]), np.zeros(4, int)).tolist()
        [12]
    """
    files = np.asarray(files, dtype=np.int64)
    n, hosts = len(files), len(bounds) - 1
    if not n:
        return np.zeros(hosts, dtype=np.int64)
    if nxt is None:
        nxt = next_reads(files, bounds, len(sizes), compile=compile)
    first, last = first_reads(nxt, group)
    w = np.asarray(sizes, dtype=np.int64)[files]
    delta = np.zeros(n + 1, dtype=np.int64)
    delta[:n][first] += w[first]  # live from its first read in the group ...
    delta[1:][last] -= w[last]  # ... through its last
    live = np.cumsum(delta[:n])
    out = np.zeros(hosts, dtype=np.int64)
    some = np.diff(bounds) > 0
    out[some] = np.maximum.reduceat(live, np.asarray(bounds[:-1])[some])
    return out
