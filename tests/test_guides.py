"""The documentation's runnable code blocks run as written.

A fenced ```python block of a page under ``docs/`` that is immediately preceded by
the line ``<!-- runnable -->`` is runnable: the blocks of one page run in order, in
one namespace, in a fresh temporary folder (the current directory), on data they
make themselves. A failing block is reported by page, block number and line; the
traceback points into the page itself (the code is compiled under the page's path,
at the page's line numbers).
"""

from __future__ import annotations

import re
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "docs"
MARKER = "<!-- runnable -->"
PAGE_TIMEOUT_S = 120  # seconds for all the blocks of one page


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """The runnable blocks of ``page``: ``(line of the block's first code line, code)``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.fullmatch(r"```\s*python\s*", fence):
            raise AssertionError(f"{page}:{i + 1}: {MARKER} must be followed by a ```python fence, not {fence!r}")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{page}:{i + 2}: the runnable block is never closed")
        blocks.append((i + 3, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


def pages() -> list[Path]:
    """The pages under ``docs/`` with at least one runnable block."""
    if not ROOT.is_dir():
        return []
    return [p for p in sorted(ROOT.rglob("*.md")) if runnable_blocks(p)]


def _ids(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.skipif(not ROOT.is_dir(), reason=f"no docs folder at {ROOT} (the tests run from a checkout)")
@pytest.mark.parametrize(
    "page", [pytest.param(p, id=_ids(p), marks=pytest.mark.timeout(PAGE_TIMEOUT_S)) for p in pages()]
)
def test_the_runnable_blocks_of_a_page_run_in_order(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a page that imports from its folder leaves no trace
    monkeypatch.setenv("QUERN_CACHE_DIR", str(tmp_path / ".quern-cache"))  # filters, lengths: nothing in ~
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # where jax is not imported yet: no accelerator is looked for
    namespace: dict = {"__name__": "__main__"}  # as a script run with python: `if __name__ == "__main__"` runs
    try:
        for number, (line, code) in enumerate(runnable_blocks(page), start=1):
            # compiled under the page's path at its own line numbers: a traceback shows the page's lines
            compiled = compile("\n" * (line - 1) + code, str(page), "exec")
            failure = None
            try:
                exec(compiled, namespace)
            except (Exception, SystemExit) as e:  # the traceback from the page's own frame on
                failure = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            if failure is not None:
                pytest.fail(f"{_ids(page)}: block {number} (line {line}) failed:\n{failure}", pytrace=False)
    finally:
        _clean_up(namespace, tmp_path)


def _clean_up(namespace: dict, folder: Path) -> None:
    """Close the iterators a page left open, and forget the modules it wrote and imported.

    The iterators stop here, not at the next page's garbage collection; a module of the page's
    folder (a config's transforms) must not be found by name by another test.
    """
    for value in list(namespace.values()):
        if type(value).__name__ in ("PipelineIterator", "GlobalIterator"):
            value.close()
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(folder)):
            del sys.modules[name]


def test_every_runnable_marker_is_on_a_python_block():
    if not ROOT.is_dir():
        pytest.skip(f"no docs folder at {ROOT} (the tests run from a checkout)")
    for page in sorted(ROOT.rglob("*.md")):
        runnable_blocks(page)  # raises naming the page and line of a misplaced marker
