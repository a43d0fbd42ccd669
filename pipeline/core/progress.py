"""The progress bar of the ``quern`` commands: a tqdm bar on stderr, drawn only on a terminal.

    bar = Bar(total_bytes, "quern prepare", unit="B", scale=1024, count="records", per="rec")
    bar.update(nbytes, records)  # ... 1.2MB/3.4MB [00:01<00:02, 1.1MB/s, 300 records, 290 rec/s]
    bar.close()

    with Bar(steps, "quern run", unit="step", count="records") as bar:
        bar.update(1, len(batch))  # ... 30/30 [00:00<00:00, 98.2step/s, 240 records, 785 records/s]

When stderr is not a terminal (a file, a pipe, a test's capture) the bar is off
and writes nothing, unless ``shown=True`` forces it (``shown=False`` turns it
off on a terminal too). A pseudo-terminal whose size was never set says 0 x 0,
and tqdm would then hide the bar: it is drawn 100 columns wide instead.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any, Self


def screen() -> tuple[int, int]:
    """The terminal's size on stderr, with a usable default where it says none.

    Returns:
        ``(columns, rows)``; 100 x 24 where the terminal says 0 (a pseudo-terminal
        whose size was never set: tqdm would hide its bar) or cannot say.
    """
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):  # not a terminal, or a stream without a descriptor
        return 100, 24
    return size.columns or 100, size.lines or 24


class Bar:
    """A tqdm bar of ``total`` units on stderr, titled ``desc``, with a second count in its postfix.

    Closing it (also as a context manager, on an error) ends its line, so what is
    printed next starts on its own line.

    Args:
        total: the units to do.
        desc: the bar's title.
        unit: what ``total`` counts (``"B"``, ``"step"``).
        scale: 1024 or 1000 to show ``total`` and its rate scaled (``1.2MB``);
            ``None`` to show them as they are.
        count: the noun of the second count (``"records"``, ``"rows"``), shown
            with its rate (``240 records, 785 records/s``); ``None``: none.
        per: the rate's unit (``rec`` for ``rec/s``; default: ``count``).
        shown: draw the bar (default: when stderr is a terminal).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "it",
        scale: int | None = None,
        count: str | None = None,
        per: str | None = None,
        shown: bool | None = None,
    ) -> None:
        from tqdm import tqdm

        self.on: bool = sys.stderr.isatty() if shown is None else shown
        self.count, self.per = count, per or count
        self.counted = 0
        self.t0 = time.monotonic()
        columns, rows = screen() if self.on else (None, None)
        self.bar: Any = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=scale is not None,
            unit_divisor=scale or 1000,
            disable=not self.on,
            file=sys.stderr,
            ncols=columns,
            nrows=rows,
        )

    def update(self, n: int = 1, counted: int = 0) -> None:
        """Count work done.

        Args:
            n: units more done.
            counted: more of the second count.
        """
        self.counted += counted
        self.bar.update(n)
        if self.on and self.count is not None:
            rate = self.counted / max(time.monotonic() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.counted:,} {self.count}, {rate:,.0f} {self.per}/s", refresh=False)

    def close(self) -> None:
        """Draw the bar a last time and end its line (nothing when it is off); twice is once."""
        self.bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
