"""The command line of ``quern``: its parser, its help epilog and its exit statuses.

The parser knows the commands by name only (``args.command``); what each does is
:mod:`quern.pipeline.cli.commands`'. Exit statuses:

- 0: done.
- :data:`EXIT_DATA` (1): the data failed while batches were being made: a
  transform raised, a record could not be read or collated
  (:class:`~quern.StepError`, which names the step, host slice, stage and
  records, and the original error), a source failed
  (:class:`~quern.SourceError`), a filter's predicate raised while the filter
  scanned its records (:class:`~quern.ScanError`, which names the config key of
  the filter), worker processes could not start or kept dying
  (:class:`~quern.WorkerError`); also any unexpected error.
- :data:`EXIT_USAGE` (2): the command could not start from what it was given:
  bad arguments, a config that does not load (:class:`~quern.ConfigError`,
  which covers data files that cannot be found or opened, and functions the
  config may not import), a step outside the stream, a state file that is
  unreadable, too large, not a state (a step that is not an integer: ``"3"``,
  ``3.0``, ``true``) or saved from another pipeline.
- :data:`EXIT_INTERRUPTED` (130): interrupted (Ctrl-C).

``quern verify`` exits :data:`EXIT_DATA` (1) when the digests differ (or a ledger
has gaps, differing duplicates, a torn line in the middle, or a bad line: a step
that is not an integer from 0 to 2**62 - 1 or that the pipeline does not have, a
host count that cannot split its batch, each named by file and line), naming the
first differing step, host slice, row, records and leaf; and :data:`EXIT_USAGE`
(2) for a ledger it cannot read or with a line another pipeline logged (wherever
the line is and whatever the config's edits), naming the file, the line and both
fingerprints.
"""

from __future__ import annotations

import argparse
from typing import Any

from ... import __version__

__all__ = ["EPILOG", "EXIT_DATA", "EXIT_INTERRUPTED", "EXIT_USAGE", "INDEX_FORMATS", "build_parser"]

EXIT_DATA = 1
"""Exit status when the data fails while batches are made (see the module docstring)."""
EXIT_USAGE = 2
"""Exit status when the arguments, the config or the state file are bad."""
EXIT_INTERRUPTED = 130
"""Exit status when the command is interrupted (Ctrl-C)."""

INDEX_FORMATS = ("webdataset", "tfrecord", "jsonl")
"""The formats ``quern index`` writes sidecar indexes of."""

EPILOG = """\
code: a config's fn entries may name registered transforms, modules in the config's own folder, and modules
under prefixes given with --allow PREFIX or QUERN_ALLOW=PREFIX,PREFIX; anything else is refused (exit 2).
errors: one message on stderr, or the full traceback with --traceback.
exit status: 0 done; 1 the data failed while making batches (a transform raised, a record could not be
read or collated, workers could not start or kept dying); 2 bad arguments, config or state file (the
command could not start); 130 interrupted."""
"""The end of every ``--help``: what a config may run, errors and exit statuses."""


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _workers(text: str) -> int | str:
    """``auto``, or a worker count ``>= 0``."""
    return "auto" if text == "auto" else _nonneg(text)


def _step_range(text: str) -> range:
    """``A:B`` (steps A to B-1) or ``N`` (the first N steps), as a range.

    Example:
        >>> _step_range("3:7"), _step_range("5")
        (range(3, 7), range(0, 5))
    """
    first, sep, stop = text.partition(":")
    try:
        a, b = (int(first), int(stop)) if sep else (0, int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be A:B (steps A to B-1) or N (the first N steps), got {text!r}"
        ) from None
    if a < 0 or b <= a:
        raise argparse.ArgumentTypeError(f"must be A:B with 0 <= A < B, or N >= 1; got {text!r}")
    return range(a, b)


def _size(text: str) -> int:
    """A size in bytes: ``4096``, ``512KB``, ``4GB`` (binary units; :func:`quern.prepare.run.parse_size`)."""
    from ...prepare.run import parse_size

    try:
        return parse_size(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _counts(least: int) -> Any:
    """The type of a comma-separated list of integers, each at least ``least``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be integers separated by commas, got {text!r}") from None
        if not values or any(v < least for v in values):
            raise argparse.ArgumentTypeError(f"must be integers >= {least} separated by commas, got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``quern``'s arguments.

    Returns:
        The parser; ``args.command`` names the command parsed (``run``, ``explain``,
        ``inspect``, ``bench``, ``plan``, ``prepare``, ``verify``, ``where``, ``index``).

    Example:
        >>> args = build_parser().parse_args(["run", "pipe.yaml", "--workers", "2"])
        >>> args.command, args.config, args.workers, args.steps
        ('run', 'pipe.yaml', 2, 100)
    """
    ap = argparse.ArgumentParser(
        prog="quern",
        description="Run, explain, inspect and bench quern pipeline configs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"quern {__version__}")
    traceback_help = "on an error, print the full Python traceback instead of one message"
    allow_help = (
        "let the config name functions of modules under PREFIX, a dotted module name: 'mypkg' allows "
        "mypkg and mypkg.sub, not mypkgevil (repeatable; also QUERN_ALLOW=PREFIX,PREFIX). Without it a config "
        "names only registered transforms and modules in its own folder"
    )
    ap.add_argument("--traceback", action="store_true", help=traceback_help)
    ap.add_argument("--allow", action="append", dest="allow_before", metavar="PREFIX", help=allow_help)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)  # SUPPRESS: given before the command, it is kept
    common.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback_help)
    common.add_argument("--allow", action="append", metavar="PREFIX", help=allow_help)  # its own dest: both kept

    def with_config(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            parents=[common],
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("config", help="pipeline config: a YAML or JSON file")
        return p

    def host(p: argparse.ArgumentParser) -> None:
        p.add_argument("--process-index", type=_nonneg, default=0, help="this host's index (default 0)")
        p.add_argument("--process-count", type=_positive, default=1, help="number of hosts (default 1)")

    p = with_config("run", "iterate the pipeline (a progress bar on a terminal) and print throughput")
    p.add_argument("--steps", type=_positive, default=100, help="steps to run (default 100)")
    p.add_argument("--start-step", type=_nonneg, default=0, help="first step (default 0; --state overrides it)")
    p.add_argument(
        "--workers",
        type=_workers,
        default=0,
        help="worker processes (default 0), or auto: measure threads and workers on the first steps, keep the faster",
    )
    p.add_argument(
        "--step-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="fail (exit 1) naming the step and stage when a step takes longer (default: no deadline)",
    )
    p.add_argument("--state", help="resume from this saved state (JSON); refused if the data or config changed")
    p.add_argument("--force", action="store_true", help="resume from --state even if the fingerprint differs")
    p.add_argument("--save-state", help="write the state after the last step to this JSON file")
    p.add_argument(
        "--ledger",
        metavar="PATH",
        help="append a line per step with its digests to this file ({process_index} is replaced by the host): "
        "what quern verify --ledger checks",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="compute the steps on Ray actors (quern.RayService) of a new local cluster (pip install 'quern[ray]')",
    )
    p.add_argument("--ray-address", metavar="HOST:PORT", help="the Ray cluster of the actors (implies --ray)")
    p.add_argument(
        "--actors",
        type=_positive,
        default=None,
        help="with --ray: actors to start (default: the cluster's CPUs)",
    )

    p = with_config(
        "explain", "which records make each row of a step (O(batch), any step); a mixture's rows name their component"
    )
    p.add_argument("--step", type=_nonneg, required=True)
    host(p)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = with_config("inspect", "shapes, dtypes, value summaries and padding of one batch")
    p.add_argument("--step", type=_nonneg, required=True)
    host(p)

    p = with_config(
        "bench",
        "time per stage (read, transforms, collate), then a training loop's data wait and bubble rate, and where "
        "the data waits (device, host memory, local disk, network) with a suggestion",
    )
    p.add_argument("--steps", type=_positive, default=20, help="steps to time (default 20)")
    p.add_argument("--start-step", type=_nonneg, default=0)
    p.add_argument(
        "--workers",
        type=_workers,
        default=0,
        help="worker processes of the loop (default 0), or auto (the iterator chooses; the line tuning: says what)",
    )
    p.add_argument(
        "--step-ms",
        type=_nonneg_float,
        default=0.0,
        help="the training step the loop simulates, in ms (default 0: none)",
    )
    p.add_argument("--plot", metavar="OUT.png", help="draw the loop's wait vs compute and the stage times per step")

    help = (
        "check determinism: the step digests of every host count x worker count (and resumes) against batch_at, "
        "a training run's ledger against a recomputation, or two runs' ledgers against each other"
    )
    p = sub.add_parser(
        "verify",
        help=help,
        description=help + "; exit 0 when all agree, 1 naming the first differing step, host slice, row, records "
        "and leaf (or a ledger's gap, differing duplicate, torn or bad line, named by file and line), 2 for a "
        "ledger that cannot be read or holds a line of another pipeline (named, with both fingerprints)",
        parents=[common],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="pipeline config: a YAML or JSON file (optional with --compare)")
    p.add_argument(
        "--steps",
        type=_step_range,
        default=None,
        metavar="A:B|N",
        help="the steps: A:B (steps A to B-1) or N (the first N), as quern run's --steps (default: the first 8; "
        "with --ledger, every step logged)",
    )
    p.add_argument(
        "--hosts", type=_counts(1), default=None, metavar="H,...", help="host counts to compare (default 1,2,4)"
    )
    p.add_argument(
        "--workers",
        type=_counts(0),
        default=None,
        metavar="W,...",
        help="worker counts to compare (default 0,2); with --ledger, one: the workers recomputing the steps "
        "(default 0)",
    )
    p.add_argument(
        "--resume-at",
        type=_counts(0),
        default=[],
        metavar="K,...",
        help="also resume every topology at these steps (from pipe.state_at(K)) and compare the steps from there",
    )
    p.add_argument(
        "--ledger",
        nargs="+",
        metavar="PATH",
        help="check the ledger a run wrote (pipe.iterator(ledger=PATH)): every host's file (paths, globs, "
        "comma lists; {process_index} matches any host) against a recomputation of each logged step",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("LEDGER_A", "LEDGER_B"),
        help="compare two runs' ledgers without the data (each a path, a glob or a comma list of host files); "
        "with CONFIG, the records of a differing row are named",
    )

    p = with_config("where", "the (step, row) pairs where a source record appears, from the plan (reads nothing)")
    p.add_argument("record", type=_nonneg, help="the record id in the source (in the component's source for a mixture)")
    p.add_argument("--component", metavar="NAME", help="the mixture component whose record it is (mixtures only)")
    p.add_argument("--epochs", type=_positive, default=1, help="epochs to look in (default 1)")
    p.add_argument("--json", action="store_true", help="print a JSON list of [step, row] pairs")

    p = with_config(
        "plan",
        "what each host will read, from the definition and the files' sizes alone (no record read): records, bytes, "
        "files and file reads per step and epoch, the working set, the smallest cache with no refetch, and with "
        "--cache the disk cache's hits, misses and bytes fetched; percentiles over hosts",
    )
    p.add_argument("--hosts", type=_positive, default=1, help="the host count (it must divide the batch; default 1)")
    p.add_argument(
        "--steps",
        type=_step_range,
        default=None,
        metavar="A:B|N",
        help="the steps: A:B (steps A to B-1) or N (the first N) (default: every step of a finite pipeline, else "
        "its first epoch)",
    )
    p.add_argument(
        "--cache", type=_size, default=None, metavar="BYTES", help="replay a disk cache of this size per host (4GB)"
    )
    p.add_argument(
        "--policy",
        choices=("belady", "lru"),
        default="belady",
        help="the cache's eviction: belady (the iterator's lookahead, the default) or lru",
    )
    p.add_argument(
        "--read-ahead", type=_positive, default=None, help="steps per bulk read, as the iterator's (default: its)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    help = "convert inputs to ArrayRecord shards with a manifest and a metadata index (see quern.prepare)"
    p = sub.add_parser("prepare", help=help, description=help, parents=[common], epilog=EPILOG)
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a directory of small files, JSON-lines (.jsonl), Parquet (.parquet), ArrayRecord, WebDataset tar "
        "(.tar: a record per sample) or TFRecord (.tfrecord, .tfrecords, .tfrec) files, a glob, or a prepared "
        "folder; in the order given (a directory's files sorted by relative path)",
    )
    p.add_argument("--output", "-o", required=True, help="the folder to write (new or empty; or an unfinished prepare)")
    p.add_argument(
        "--map",
        help="module:function applied to each record (a tokeniser, say); the current directory is searched first",
    )
    p.add_argument(
        "--workers", type=_nonneg, default=None, help="processes writing shards (default: the CPU count; 0: this one)"
    )
    p.add_argument("--shard-size", default="128MB", help="bytes per shard, e.g. 512KB, 1MB, 128MB, 1GB (default 128MB)")
    p.add_argument(
        "--fields",
        help="scalar fields for the metadata index, comma-separated (JSON keys, Parquet columns, or the map's dict; "
        "for tar and TFRecord inputs the map's dict only)",
    )
    p.add_argument(
        "--format",
        choices=["files", "jsonl", "parquet", "array_record", "webdataset", "tfrecord"],
        help="the kind of every input (default: by name; a directory's files: small files)",
    )
    p.add_argument("--field", help="JSON lines: the record is this field of each line (default: the whole line)")
    p.add_argument("--columns", help="Parquet: the columns read (one: the record; several: a dict for --map)")
    p.add_argument(
        "--member",
        metavar="EXT",
        help="WebDataset: the record is this member of each sample, e.g. jpg (default: the whole sample, stored as "
        "a tar of its own; --map receives the sample dict); a sample without it is an error (or --skip-errors)",
    )
    p.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="directories: only files whose relative path matches (repeatable)",
    )
    p.add_argument(
        "--compression",
        default="zstd:1",
        help="per record: zstd[:LEVEL] (default zstd:1), brotli[:LEVEL], snappy or uncompressed (fastest reads)",
    )
    p.add_argument(
        "--skip-errors", action="store_true", help="skip records that cannot be read or mapped; counted in the manifest"
    )
    p.add_argument(
        "--labels-from-dirs",
        action="store_true",
        help="image folders (INPUT/CLASS/FILE): each image's label is its class folder's index (classes sorted by "
        "name, listed in the manifest), kept in the metadata with width and height",
    )
    p.add_argument(
        "--max-side",
        type=_positive,
        metavar="N",
        help="image folders: shrink images whose longer side is over N to N, once (recorded in the manifest)",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="write the shards as Ray tasks on a new local cluster (pip install 'quern[ray]')",
    )
    p.add_argument(
        "--ray-address", help="the Ray cluster to use (implies --ray); input and output must be on a shared file system"
    )
    help = (
        "index WebDataset tar shards, TFRecord and JSON-lines files for random access: write each file's record "
        "offsets and content hash beside it (FILE.quern.idx), which the sources check against the file and use "
        "instead of scanning it"
    )
    plain = argparse.ArgumentParser(add_help=False)  # no --allow: indexing runs no config's code
    plain.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback_help)
    index_epilog = (
        "errors: one message on stderr, or the full traceback with --traceback. exit status: 0 done; 1 a file "
        "could not be indexed (not a regular file, empty, compressed or bad data: named, with where); 2 bad "
        "arguments (a format that cannot be told by the name, a sidecar named as a file); 130 interrupted."
    )
    p = sub.add_parser("index", help=help, description=help, parents=[plain], epilog=index_epilog)
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="files or globs (a sidecar already right is kept; the sidecars a glob matches are left out)",
    )
    p.add_argument(
        "--format",
        choices=list(INDEX_FORMATS),
        help="the format of every file (default: by name: .tar; .tfrecord, .tfrecords, .tfrec; .jsonl, .ndjson, .json)",
    )
    p.add_argument(
        "--threads", type=_positive, default=None, help="files hashed and scanned at once (default: up to 8)"
    )
    return ap
