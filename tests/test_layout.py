"""The package's shape, checked: the layout page names every module, no module name repeats, none is long.

``docs/design/layout.md`` names every module of the package (``pipeline/core/errors.py``) and every
folder (``pipeline/core/``) on a list line of its own, each once; a module added, moved or removed
without its line fails here. The modules are those of the installed wheel, which is the checkout's
package: every ``.py`` file below the package root except tests, examples, benchmarks and docs.
"""

from __future__ import annotations

import pathlib
import re

import quern

PACKAGE = pathlib.Path(quern.__file__).resolve().parent
LAYOUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "design" / "layout.md"
MAX_LINES = 600
_NOT_PACKAGE = {"tests", "examples", "benchmarks", "docs", "site", "build", "dist"}
ITEM = re.compile(r"^\s*- `([A-Za-z0-9_/.]+)`")


def package_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module and folder of the package below ``root``: ``"pipeline/core/errors.py"``, ``"pipeline/core/"``.

    The modules are the root's ``.py`` files and those below its top folders that are packages (hold an
    ``__init__.py``), except tests, examples, benchmarks and docs. A folder's ``__init__.py`` is the folder's
    entry; ``__main__.py`` files are modules.
    """
    out: dict[str, pathlib.Path] = {}
    tops = [p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file() and p.name not in _NOT_PACKAGE]
    for path in sorted([*root.glob("*.py"), *(p for top in tops for p in top.rglob("*.py"))]):
        rel = path.relative_to(root)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if path.name == "__init__.py":
            if rel.parent.parts:
                out[rel.parent.as_posix() + "/"] = path
            else:
                out["__init__.py"] = path
        else:
            out[rel.as_posix()] = path
    return out


def layout_items(text: str) -> list[str]:
    """The paths named at the start of the page's list lines (`` - `pipeline/core/errors.py`: ...``), in order."""
    return [m.group(1) for line in text.splitlines() if (m := ITEM.match(line))]


def test_the_layout_page_names_every_module_and_folder_once():
    named = layout_items(LAYOUT.read_text())
    assert len(named) > 50, "the parser found few items: the page's format or the test is broken"
    repeated = sorted({n for n in named if named.count(n) > 1})
    assert repeated == [], f"named more than once in {LAYOUT.name}: {repeated}"
    present = set(package_files(PACKAGE))
    assert sorted(present - set(named)) == [], f"modules or folders missing from {LAYOUT.name}"
    assert sorted(set(named) - present) == [], f"{LAYOUT.name} names modules or folders the package does not have"


def test_the_layout_parser_sees_list_lines_only(tmp_path):
    page = "# t\n\nsome `pipeline/x.py` in prose\n- `a.py`: one\n  - `b/`: two\n-`c.py` no space\n"
    assert layout_items(page) == ["a.py", "b/"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "t.py").write_text("")
    (tmp_path / ".venv" / "x").mkdir(parents=True)
    (tmp_path / ".venv" / "x" / "__init__.py").write_text("")
    assert sorted(package_files(tmp_path)) == ["a.py", "b/"]


def test_no_module_name_appears_twice():
    names: dict[str, list[str]] = {}
    for rel, path in package_files(PACKAGE).items():
        if path.name not in {"__init__.py", "__main__.py"}:
            names.setdefault(path.stem, []).append(rel)
    assert len(names) > 50, "few modules found: the test is broken"
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_no_module_passes_600_lines():
    long = {}
    for rel, path in package_files(PACKAGE).items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[rel] = lines
    assert long == {}, f"split these by idea (at most {MAX_LINES} lines a module)"
