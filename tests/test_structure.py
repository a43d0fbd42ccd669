"""Tests of pipeline/errors.py and the import graph.

The package's structure: its import graph has no cycle, and errors have one home. An import that
runs is an edge of the graph wherever it is (top level, in a function, lazily); one under
``if TYPE_CHECKING:`` never runs (it is for annotations only) and is not an edge."""

from __future__ import annotations

import ast
import pathlib

import quern
from quern.pipeline.core import errors

ROOT = pathlib.Path(quern.__file__).resolve().parent
PACKAGE_DIRS = ("pipeline", "transforms", "sharding", "prepare")


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file for every module of the installed package (tests, examples, benchmarks excluded)."""
    out = {"quern": ROOT / "__init__.py"}
    if (ROOT / "__main__.py").exists():
        out["quern.__main__"] = ROOT / "__main__.py"
    for d in PACKAGE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            parts = ["quern", *path.relative_to(ROOT).with_suffix("").parts]
            out[".".join(parts[:-1] if path.stem == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if``'s test is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` that can run: the bodies of ``if TYPE_CHECKING:`` are left out (their ``else:`` kept)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The quern modules ``name`` imports anywhere in its file that runs (top level, in functions, lazily)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle_even_counting_lazy_imports():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["quern.pipeline.definition.dataset"], "the parser found no imports: the test itself is broken"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_imports_under_type_checking_are_not_edges(tmp_path):
    modules = _modules()
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "from quern.pipeline.core import errors\n"
        "if TYPE_CHECKING:\n"
        "    from quern.pipeline.definition.dataset import Pipeline\n"
        "else:\n"
        "    from quern.pipeline.order import index\n"
        "if typing.TYPE_CHECKING:\n"
        "    import quern.pipeline.execute\n"
        "def late():\n"
        "    from quern.pipeline.core import steps\n"
    )
    assert _imports("probe", path, modules) == {
        "quern.pipeline.core.errors",
        "quern.pipeline.order.index",
        "quern.pipeline.core.steps",
    }


def _layer(module: str) -> str | None:
    """The folder of ``pipeline/`` that ``module`` lives in (``quern.pipeline.core.errors`` -> ``core``), else ``None``."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[1] == "pipeline" else None


LAYERS = ("core", "order", "identity", "remote", "sources", "execute", "streams", "integrity", "iterate", "definition")
"""``pipeline/``'s folders from the bottom up, as docs/design/layout.md lists them; config and cli are on top."""


def test_the_folders_of_pipeline_are_layers_that_import_only_downwards():
    modules = _modules()
    up = []
    for name, path in modules.items():
        here = _layer(name)
        for target in _imports(name, path, modules):
            there = _layer(target)
            if here in LAYERS and there is not None and there != here:
                if there not in LAYERS or LAYERS.index(there) > LAYERS.index(here):
                    up.append(f"{name} -> {target}")
    assert _layer("quern.pipeline.core.errors") == "core" and _layer("quern.pipeline") is None
    assert _layer("quern.pipeline.streams") == "streams"  # a folder's package is in its layer too
    assert sorted(up) == [], "a lower layer imports a higher one"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_bottom_modules_import_no_other_quern_module_above_them():
    modules = _modules()
    assert _imports("quern.pipeline.core.errors", modules["quern.pipeline.core.errors"], modules) == set()
    assert _imports("quern.pipeline.order.index", modules["quern.pipeline.order.index"], modules) == set()
    for name in (
        "quern.pipeline.iterate.iterator",
        "quern.pipeline.iterate.workers.pool",
        "quern.pipeline.iterate.workers.forkserver",
        "quern.pipeline.iterate.workers.worker",
        "quern.pipeline.execute",
        "quern.pipeline.identity.fingerprint",
    ):
        assert "quern.pipeline.definition.dataset" not in _imports(name, modules[name], modules), name


def test_every_error_class_is_defined_in_errors_only():
    defined = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                defined.setdefault(node.name, []).append(name)
    assert defined, "no error classes found: the test itself is broken"
    assert {n: m for n, m in defined.items() if m != ["quern.pipeline.core.errors"]} == {}
    for cls in (quern.StepError, quern.SourceError, quern.WorkerError, quern.ConfigError):
        assert getattr(errors, cls.__name__) is cls
