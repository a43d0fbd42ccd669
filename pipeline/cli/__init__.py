"""The ``quern`` command: run, explain, inspect, bench and verify a pipeline config; prepare and index data.

::

    quern run CONFIG [--steps N] [--start-step S] [--workers W] [--state FILE [--force]] [--save-state FILE]
              [--ledger PATH]
    quern explain CONFIG --step S [--process-index H --process-count N] [--json]
    quern inspect CONFIG --step S [--process-index H --process-count N]
    quern bench CONFIG [--steps N] [--start-step S] [--workers W] [--step-ms MS] [--plot OUT.png]
    quern prepare INPUT... --output DIR [--map MODULE:FN] [--workers N] [--shard-size 128MB] [--fields A,B]
                  [--format F] [--field NAME] [--columns A,B] [--include GLOB] [--compression C]
                  [--skip-errors] [--ray [--ray-address A]]
    quern verify CONFIG [--steps A:B|N] [--hosts 1,2,4] [--workers 0,2] [--resume-at K,...]
    quern verify CONFIG --ledger PATH [PATH...] [--steps A:B|N] [--workers W]
    quern verify [CONFIG] --compare LEDGER_A LEDGER_B
    quern where CONFIG RECORD [--component NAME] [--epochs E] [--json]
    quern index PATH... [--format webdataset|tfrecord|jsonl] [--threads N]
    quern --version

``python -m quern ...`` is the same command. ``--traceback`` (before or after
the command's name) prints the full traceback of an error. ``--allow PREFIX``
(repeatable, before or after the command's name) lets the config name
functions of modules under ``PREFIX`` (``mypkg`` allows ``mypkg`` and
``mypkg.sub``), as ``QUERN_ALLOW=PREFIX,...`` does; otherwise a config names
only registered transforms and modules in its own folder
(:mod:`quern.pipeline.config.trust`), and anything else is refused before it is
imported, with exit status 2.

The arguments and exit statuses are :mod:`.parser`'s, the commands
:mod:`.commands`', their reports :mod:`.reports`', and how an error becomes one
message on stderr (``quern: ...``, never a traceback unless ``--traceback``) and a
status :mod:`.failure`'s.
"""

from __future__ import annotations

import sys
import traceback

from .commands import COMMANDS
from .failure import expected, message, status
from .parser import EXIT_INTERRUPTED, build_parser
from .reports import _count as _count  # the names of the single-module cli that tests import

_message = message

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``quern`` command.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status (:mod:`quern.pipeline.cli.parser`).
    """
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `quern explain ... | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("quern: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # the command's one place that turns errors into messages
        if args.traceback:
            traceback.print_exc()
        else:
            hint = "" if expected(e) else " (an unexpected error: --traceback shows where)"
            print(f"quern: {message(e)}{hint}", file=sys.stderr)
        return status(e)
