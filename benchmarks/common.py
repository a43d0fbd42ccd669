"""What the benchmark scripts share: data making, child processes, timing and tables.

A script run as ``python benchmarks/NAME.py`` has ``benchmarks/`` on ``sys.path``,
so it imports this module as ``common``. Nothing here measures on its own: the
scripts decide what is timed and what is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

import quern

VOCAB = 32000  # token values are drawn from [1, VOCAB)
WORKER_START_TIMEOUT = 60.0  # seconds for quern's worker processes to start

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


# --------------------------------------------------------------------------- data


def write_array_record(path: str, records: Iterable[bytes], options: str = "group_size:1") -> None:
    """Write ``records`` to one ArrayRecord file.

    Args:
        path: the file to write (replaced if it exists).
        records: the records, in order.
        options: the ``ArrayRecordWriter`` options.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, options)
    for record in records:
        writer.write(record)
    writer.close()


def read_marker(path: str, want: dict[str, Any], *needed: str) -> dict[str, Any] | None:
    """The JSON object a script left in ``path`` to say what data it made, if it still applies.

    Args:
        path: the marker file (JSON).
        want: items the marker must hold (compared as JSON: tuples equal lists).
        *needed: paths that must exist as well.

    Returns:
        The marker's object, or ``None`` when it is missing, unreadable, lacks an
        item of ``want`` or a needed path is missing.
    """
    try:
        with open(path) as f:
            desc = json.load(f)
    except (OSError, ValueError):
        return None
    wanted = json.loads(json.dumps(want))
    if not isinstance(desc, dict) or any(desc.get(k) != v for k, v in wanted.items()):
        return None
    return desc if all(os.path.exists(p) for p in needed) else None


def token_shards(
    folder: str,
    meta: dict[str, Any],
    parts: Sequence[tuple[Sequence[str], tuple[int, int]]],
    records: int,
    seed: int,
    announce: str = "",
) -> float | None:
    """Write synthetic int32 token records as ArrayRecord shards, unless they are there already.

    Each part is ``(paths, (lo, hi))``: ``records`` records split evenly over its
    paths (``np.linspace``), lengths uniform in ``lo..hi``, tokens uniform in
    ``[1, VOCAB)``, all drawn from one ``np.random.default_rng(seed)`` part by
    part, shard by shard; written with ``group_size:1``. ``folder/meta.json``
    records ``meta``: the shards are reused while it holds exactly ``meta``.

    Args:
        folder: where ``meta.json`` goes (created if missing).
        meta: what the data are; any change rewrites them.
        parts: the shard paths of each part and its range of lengths.
        records: records per part.
        seed: the generator's seed.
        announce: printed before writing, with the time taken after, if given.

    Returns:
        Seconds spent writing, or ``None`` when the shards were reused.
    """
    meta_path = os.path.join(folder, "meta.json")
    if read_marker(meta_path, meta, *(p for paths, _ in parts for p in paths)) == json.loads(json.dumps(meta)):
        return None
    if announce:
        print(announce, flush=True)
    t0 = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(meta_path):
        os.remove(meta_path)
    rng = np.random.default_rng(seed)
    for paths, (lo, hi) in parts:
        bounds = np.linspace(0, records, len(paths) + 1).astype(np.int64)
        for k, path in enumerate(paths):
            lengths = rng.integers(lo, hi + 1, size=int(bounds[k + 1] - bounds[k]))
            tokens = rng.integers(1, VOCAB, size=int(lengths.sum()), dtype=np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            write_array_record(path + ".tmp", (tokens[a:b].tobytes() for a, b in zip(offsets[:-1], offsets[1:])))
            os.replace(path + ".tmp", path)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    seconds = time.perf_counter() - t0
    if announce:
        print(f"  done in {seconds:.1f}s", flush=True)
    return seconds


def warm_page_cache(paths: Iterable[str]) -> int:
    """Read every file once, so that the page cache holds them.

    Args:
        paths: the files.

    Returns:
        The bytes read.
    """
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


def stdlib_py_files() -> list[str]:
    """The ``.py`` files of this Python's standard library, in a fixed order.

    Folders are walked sorted, leaving out ``site-packages``, ``__pycache__``,
    ``test`` and ``tests``; the files of a folder are sorted by name.

    Returns:
        Their full paths.
    """
    files = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "test", "tests"))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return files


def decode_pad(record: bytes, seq_len: int = 512) -> dict[str, np.ndarray]:
    """bytes -> int32 tokens padded with 0 or truncated to ``seq_len``, and their length.

    The per-record transform the grain pipelines use (quern's ``decode(int32)`` then ``pad``).

    Args:
        record: the record's bytes (int32 tokens).
        seq_len: the padded length.

    Returns:
        ``{"tokens": (seq_len,) int32, "length": int32}``.
    """
    arr = np.frombuffer(record, dtype=np.int32)
    n = min(arr.size, seq_len)
    tokens = np.zeros(seq_len, dtype=np.int32)
    tokens[:n] = arr[:n]
    return {"tokens": tokens, "length": np.int32(n)}


# --------------------------------------------------------------------------- processes and iterators


def run_child(script: str, args: list[Any], timeout: float = 600.0) -> Any:
    """Run ``script --child JSON(args)`` in a fresh Python; its answer.

    The child answers through :func:`parse_args`: JSON on its last line of output.

    Args:
        script: the benchmark script (its ``main`` reads ``--child``).
        args: the arguments, JSON-serialisable.
        timeout: seconds before the child is killed (``subprocess.TimeoutExpired``).

    Returns:
        The JSON value the child printed last.

    Raises:
        RuntimeError: the child exited with a non-zero status (its output in the message).
    """
    out = subprocess.run(
        [sys.executable, os.path.abspath(script), "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(ap: argparse.ArgumentParser, child: Callable[..., Any] | None = None) -> argparse.Namespace | None:
    """Parse the command line, with ``--json FILE`` (for :func:`save_figures`) added to ``ap``.

    With ``child``, also the hidden ``--child JSON`` of :func:`run_child`: a
    process started with it prints ``child(*args)`` as JSON, ``args`` decoded
    from the flag's value, and gets ``None``.

    Args:
        ap: the script's parser.
        child: what a child process of this script computes.

    Returns:
        The parsed arguments, or ``None`` in a child (which has answered).
    """
    ap.add_argument("--json", help="also write the figures to this file")
    if child is not None:
        ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if child is None or args.child is None:
        return args
    print(json.dumps(child(*json.loads(args.child))))
    return None


def started(it: Any, timeout: float = WORKER_START_TIMEOUT) -> Any:
    """``it`` (a quern iterator) once its worker processes, if any, have started.

    Args:
        it: the iterator.
        timeout: seconds to wait for the workers.

    Returns:
        ``it``.

    Raises:
        RuntimeError: the workers did not start in time (``it`` is closed).
    """
    if not it.wait_for_workers(timeout):
        it.close()
        raise RuntimeError(f"quern workers did not start within {timeout:g}s")
    return it


def close(obj: Any) -> None:
    """Call ``obj.close()`` if it has one (iterators of quern and grain; ``None`` does not)."""
    fn = getattr(obj, "close", None)
    if callable(fn):
        fn()


def grain_flags() -> None:
    """Parse absl's flags (grain's multiprocessing reads them) when not running under ``absl.app``."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS([os.path.basename(sys.argv[0])])


def error_line(e: BaseException) -> str:
    """``Type: message``, first line only, at most 200 characters: a failed config's note."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


# --------------------------------------------------------------------------- timing


def rate(
    next_item: Callable[[], Any],
    min_seconds: float,
    min_items: int = 0,
    size: Callable[[Any], int] | None = None,
) -> float:
    """Items per second of ``next_item()`` called in a loop.

    The loop runs until at least ``min_items`` calls were made and at least
    ``min_seconds`` passed; the clock starts at the first call.

    Args:
        next_item: makes one item (a batch).
        min_seconds: the shortest timed run.
        min_items: the fewest calls.
        size: what one item counts for (default 1 each), e.g. its rows.

    Returns:
        The items (or their sizes, summed) per second.
    """
    calls = count = 0
    t0 = time.perf_counter()
    while calls < min_items or time.perf_counter() - t0 < min_seconds:
        item = next_item()
        calls += 1
        count += 1 if size is None else size(item)
    return count / (time.perf_counter() - t0)


def interleaved(
    cases: Sequence[tuple[K, Callable[[], T]]],
    runs: int,
    alternate: bool = False,
    errors: dict[K, str] | None = None,
    progress: bool = False,
) -> dict[K, list[T]]:
    """``runs`` rounds of every case, the cases taking turns, so a slow spell of the machine hits them all.

    Args:
        cases: ``(key, run)``; ``run()`` is one measurement.
        runs: the rounds.
        alternate: every second round in reverse order (on/off, then off/on).
        errors: if given, a case that raises is noted there (``key: error_line``),
            printed as FAILED and not run again; else the error propagates.
        progress: print a line after each round.

    Returns:
        Each key's results, in round order.
    """
    out: dict[K, list[T]] = {key: [] for key, _ in cases}
    for r in range(runs):
        for key, run in cases[::-1] if alternate and r % 2 else cases:
            if errors is None:
                out[key].append(run())
            elif key not in errors:
                try:
                    out[key].append(run())
                except Exception as e:  # noqa: BLE001 - one broken config must not stop the benchmark
                    errors[key] = error_line(e)
                    print(f"  {key}: FAILED: {errors[key]}", flush=True)
        if progress:
            print(f"  run {r + 1}/{runs} done", flush=True)
    return out


# --------------------------------------------------------------------------- lines and tables


def command_line() -> str:
    """``command: <the command line of this process>``."""
    return "command: " + shlex.join([sys.executable] + sys.argv)


def begin(**versions: str) -> float:
    """Print :func:`command_line` and :func:`machine_line` (with ``versions``); the time it is.

    Returns:
        ``time.perf_counter()``, for the script's total time.
    """
    print(command_line())
    print(machine_line(**versions))
    return time.perf_counter()


def machine_line(**versions: str) -> str:
    """One line on what ran: versions of Python, NumPy, quern and ``versions``, the machine, CPUs and load.

    Args:
        **versions: more names and versions (``grain="0.2.12"``), in order.

    Returns:
        ``python X, numpy Y, quern Z, <name> <version>, ..., <arch> <system>, cpus N, load average a, b, c``.
    """
    parts = [f"python {sys.version.split()[0]}", f"numpy {np.__version__}", f"quern {quern.__version__}"]
    parts += [f"{name} {version}" for name, version in versions.items()]
    parts += [f"{platform.machine()} {platform.system()}", f"cpus {os.cpu_count()}"]
    return ", ".join(parts) + ", load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def ratio(x: float | None, y: float | None) -> str:
    """``x / y`` as ``1.23x``, or ``-`` when either is missing, ``y`` is 0 or the ratio is not finite."""
    if x is None or not y or not math.isfinite(x / y):
        return "-"
    return f"{x / y:.2f}x"


def join_runs(values: Iterable[float], spec: str = ",.0f", sep: str = ", ") -> str:
    """The figures of single runs in one cell: ``1,234, 1,250, 1,198``."""
    return sep.join(format(v, spec) for v in values)


def format_table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    left: Collection[int] = (0,),
    indent: str = "",
    rule: bool = False,
) -> list[str]:
    """The lines of a plain-text table: the header, then one line per row.

    Each column is padded to its widest cell, two spaces apart, left aligned for
    the columns in ``left`` and right aligned for the others (a left-aligned last
    column is not padded). A row may be shorter than the header: the missing
    cells are blank.

    Args:
        header: the column titles.
        rows: the cells (``str()`` of each).
        left: indices of the left-aligned columns.
        indent: put before every line.
        rule: a line of ``-`` under the header.

    Returns:
        The lines, without newlines.
    """
    cells = [[str(c) for c in row] + [""] * (len(header) - len(row)) for row in rows]
    widths = [max(len(r[i]) for r in [list(header), *cells]) for i in range(len(header))]
    last = len(header) - 1

    def line(row: Sequence[str]) -> str:
        out = [
            c if i == last and i in left else c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        return (indent + "  ".join(out)).rstrip()

    lines = [line(header)] + ([indent + "-" * (sum(widths) + 2 * last)] if rule else [])
    return lines + [line(row) for row in cells]


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]], **options: Any) -> None:
    """Print :func:`format_table` (the same arguments and options), flushed."""
    print("\n".join(format_table(header, rows, **options)), flush=True)


def markdown_header(header: Sequence[str], left: Collection[int] = (0,)) -> str:
    """The first two lines of a Markdown table: the titles, then each column's alignment.

    Args:
        header: the column titles.
        left: indices of the left-aligned columns (the others are right aligned).

    Returns:
        ``| a | b |`` and ``|---|---:|``, joined by a newline.
    """
    align = "|" + "|".join("---" if i in left else "---:" for i in range(len(header))) + "|"
    return markdown_row(header) + "\n" + align


def markdown_row(cells: Sequence[object]) -> str:
    """One row of a Markdown table: ``| a | b |`` (printed as it comes, so a long run shows its progress)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def save_figures(path: str | None, figures: dict[str, Any]) -> None:
    """Write ``figures`` as JSON to ``path`` (NumPy numbers as floats) and say so; nothing if ``path`` is empty."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1, default=float)
        print(f"figures written to {path}")
