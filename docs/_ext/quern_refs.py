"""Sphinx extension of quern's docs: the reference pages generated from the code, and its checks.

- ``{quern-internals}`` (a fence in a page, expanded when the page is read): one
  section per module of the package that no other reference page declares,
  found by walking the package, so a new module appears without editing a page.
  Objects documented on the API pages are left out of it.
- ``quern-config-reference``: every section and key of the config format, from
  the pydantic models of :mod:`quern.pipeline.config.schema`.
- ``quern-metrics``: the Prometheus series, from :data:`quern.metrics.METRICS`.
- Cross-references to any import path of a documented object (``quern.pipeline.
  dataset.Pipeline``, ``quern.sources.ArrayRecordSource``, a method through a
  re-export) resolve to its entry.
- Every public name (the ``__all__`` of quern and of its public subpackages) must
  have a rendered entry and a docstring: each one that has not is a warning, so a
  strict build (``-W``) fails.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import json
import pkgutil
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst.states import RSTState
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.pycode import ModuleAnalyzer
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode
from sphinx.util.parsing import nested_parse_to_nodes

log = logging.getLogger(__name__)

PACKAGE = "quern"
PUBLIC = (
    "quern",
    "quern.sources",
    "quern.transforms",
    "quern.sharding",
    "quern.prepare",
    "quern.metrics",
    "quern.verify",
)  # whose __all__ is the API
GENERATED = ("reference/internals", "reference/config", "reference/metrics")  # read again on every build
INTERNALS_FENCE = re.compile(r"^```\{quern-internals\}\s*\n```\s*$", re.M)
DECLARED = re.compile(r"^\s*\.\. (?:auto|py:)module:: (\S+)", re.M)
# Other projects' top-level modules (no intersphinx: the build is offline); references to them stay plain text.
EXTERNAL = set(sys.stdlib_module_names) | {
    *("numpy", "np", "jax", "jaxlib", "orbax", "ocp", "pyarrow", "pa", "tensorstore", "ts"),
    *("pydantic", "pydantic_core", "prometheus_client", "ray", "fsspec", "yaml", "array_record", "tqdm"),
}


# --------------------------------------------------------------------------- objects by import path


@functools.cache
def lookup(path: str) -> Any:
    """The object at a dotted path inside the package (``None`` if there is none).

    Each part is an attribute of the one before (so ``quern.transforms.pad`` is the
    function) or else a submodule (``quern.pipeline.core.collate.CollatedRows``, though the
    package's attribute ``collate`` is a function). Remembered: a build imports the
    package once, and the same paths are looked up for every reference.
    """
    parts = path.split(".")
    if parts[0] != PACKAGE:
        return None
    return _walk(importlib.import_module(PACKAGE), PACKAGE, parts[1:])


def _walk(obj: Any, name: str, rest: list[str]) -> Any:
    if not rest:
        return obj
    part, options = rest[0], []
    if inspect.isclass(obj) and part in vars(obj):
        options.append(vars(obj)[part])  # the function, property or classmethod itself
    elif hasattr(obj, part):
        options.append(getattr(obj, part))
    if inspect.ismodule(obj):
        try:
            options.append(importlib.import_module(f"{name}.{part}"))
        except ImportError:
            pass
    for option in options:
        found = _walk(option, f"{name}.{part}", rest[1:])
        if found is not None:
            return found
    return None


def _key(obj: Any) -> int | None:
    """The identity of a documented thing (classes, functions, properties, modules); None for plain values."""
    if isinstance(obj, classmethod | staticmethod):
        obj = obj.__func__
    if inspect.ismethod(obj):
        obj = obj.__func__
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj) or isinstance(obj, property):
        return id(obj)
    return None


_DOCUMENTED: dict[str, Any] = {}


def documented(env: BuildEnvironment) -> dict[int, str]:
    """Object identity -> the name of its entry (the shortest, a real entry before an alias)."""
    py = env.domains["py"]
    size = (id(env), len(py.objects) + len(py.modules))
    if _DOCUMENTED.get("size") == size:
        return _DOCUMENTED["names"]
    keep, out = [], {}
    names = [(name, entry.aliased) for name, entry in py.objects.items()] + [(name, False) for name in py.modules]
    for name, _aliased in sorted(names, key=lambda n: (n[1], len(n[0]), n[0])):
        obj = lookup(name)
        key = _key(obj)
        if key is not None and key not in out:
            keep.append(obj)  # an id is only valid while its object lives
            out[key] = name
    _DOCUMENTED.update(size=size, names=out, keep=keep)  # not on env: it is pickled
    return out


def _has_attribute(cls: Any, name: str) -> bool:
    """Whether instances of ``cls`` have the attribute ``name`` (set in its code or annotated)."""
    if not inspect.isclass(cls):
        return False
    if hasattr(cls, name) or any(name in getattr(c, "__annotations__", {}) for c in cls.__mro__):
        return True
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{re.escape(name)}\b\s*(:[^=\n]*)?=", source) is not None


def resolve_alias(app: Sphinx, env: BuildEnvironment, node: nodes.Element, contnode: nodes.Element) -> Any:
    """A Python reference to another import path of a documented object: a link to its entry.

    A reference to another project's object (the standard library's, numpy's, ...: the
    build is offline, with no intersphinx), or to a private object or type variable of
    the package that exists but has no entry, is left as plain text.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    if target.partition(".")[0] in EXTERNAL:
        return contnode
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates += [f"{module}.{cls}.{target}"] if cls else []
        candidates += [f"{module}.{target}"]
    owner = lookup(f"{module}.{cls}") if module and cls else None
    for base in owner.__mro__ if inspect.isclass(owner) else ():  # names as the defining modules see them
        if base.__module__.startswith(PACKAGE + "."):
            candidates.append(f"{base.__module__}.{target}")
    names = documented(env)
    py = env.domains["py"]
    for path in candidates:
        key = _key(lookup(path))
        name = names.get(key) if key is not None else None
        if name is None:
            continue
        if name in py.modules:
            mod = py.modules[name]
            return make_refnode(app.builder, node["refdoc"], mod.docname, mod.node_id, contnode, name)
        entry = py.objects[name]
        return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)
    if node.get("reftype") == "attr" and id(owner) in names and _has_attribute(owner, target):
        entry = py.objects[names[id(owner)]]  # an instance attribute: its class's entry
        return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, target)
    if not target.startswith(PACKAGE + "."):  # a name unique among the entries: ``Pipeline.shuffle``
        found = [n for n in py.objects if n.endswith("." + target) and not py.objects[n].aliased]
        if len(found) == 1:
            entry = py.objects[found[0]]
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, found[0])
    for path in candidates:
        obj = lookup(path)
        if isinstance(obj, typing.TypeVar) or (obj is not None and path.rpartition(".")[2].startswith("_")):
            return contnode
    return None


BUILTINS = {*dir(builtins), "None"}


class PlainExternalReferences(SphinxPostTransform):
    """Type references to built-ins and other projects' objects that no entry matches, left as text early.

    A ``class`` or ``obj`` reference (the types of every documented signature: ``int``, ``str``,
    ``numpy.ndarray``...) to a built-in or to a name of a project in :data:`EXTERNAL`, which no entry
    matches exactly or by its last parts, ends as its text: Sphinx's resolver of built-ins or
    :func:`resolve_alias` gives it so. Made text here, it skips Sphinx's fuzzy search of all the entries
    first (about 15,000 searches of 8,000 entries). Every other reference is left to Sphinx, so a broken
    one still fails a strict build.
    """

    default_priority = 5  # before the references are resolved (10)

    def run(self, **kwargs: Any) -> None:
        """Replace each such reference by its content."""
        objects = self.env.domains["py"].objects
        matched: dict[str, bool] = {}  # target -> whether an entry's name ends with ".TARGET"
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("refdomain") != "py" or node.get("reftype") not in ("class", "obj") or not node.children:
                continue
            if isinstance(node[0], addnodes.pending_xref_condition):  # Sphinx chooses the text of those
                continue
            target = node["reftarget"].lstrip(".~")
            if target not in BUILTINS and target.partition(".")[0] not in EXTERNAL:
                continue
            module, cls = node.get("py:module"), node.get("py:class")
            exact = [target, f"{module}.{target}" if module else "", f"{module}.{cls}.{target}" if cls else ""]
            if any(name in objects for name in exact if name):
                continue
            if target not in matched:
                matched[target] = any(name.endswith("." + target) for name in objects)
            if not matched[target]:
                node.replace_self(node[0].deepcopy())


# --------------------------------------------------------------------------- the public names are documented


def public_names() -> list[tuple[str, Any]]:
    """``(module.name, object)`` for every name in the ``__all__`` of the public modules."""
    out = []
    for modname in PUBLIC:
        module = lookup(modname)
        for name in module.__all__:
            out.append((f"{modname}.{name}", getattr(module, name)))
    return out


def check_public(app: Sphinx, env: BuildEnvironment) -> None:
    """Warn for each public name with no rendered entry or no docstring (a strict build fails)."""
    names = documented(env)
    py = env.domains["py"]
    for path, obj in public_names():
        key = _key(obj)
        if key is None:  # a plain value (``__version__``): its own entry
            if path not in py.objects:
                log.warning("public name %s has no entry in the API reference", path, type="quern", subtype="api")
            continue
        if key not in names:
            log.warning("public name %s has no entry in the API reference", path, type="quern", subtype="api")
        doc = obj.__doc__ if inspect.isclass(obj) or inspect.ismodule(obj) else inspect.getdoc(obj)
        if not (doc or "").strip():
            log.warning("public name %s has no docstring", path, type="quern", subtype="api")


# --------------------------------------------------------------------------- internals


def modules() -> list[str]:
    """Every module of the package, by walking it (``__main__`` modules left out)."""
    package = importlib.import_module(PACKAGE)
    found = [PACKAGE] + [m.name for m in pkgutil.walk_packages(package.__path__, PACKAGE + ".")]
    return sorted(m for m in found if not m.endswith(".__main__"))


def _shadowed(name: str, public: set[str]) -> bool:
    """A module whose name is that of a public object (``quern.transforms.pad``, the function)."""
    return name in public


def _defined(module: Any) -> set[str]:
    """The names a module's own top-level code binds (definitions and assignments, not imports)."""
    names: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(stmt.name)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(stmt, ast.If | ast.Try):
                for block in (stmt.body, stmt.orelse, *(h.body for h in getattr(stmt, "handlers", []))):
                    walk(block)

    walk(ast.parse(inspect.getsource(module)).body)
    return names


def _plain_data(module: Any, name: str) -> bool:
    """A public constant with no docstring, which ``automodule`` would leave out."""
    if name.startswith("_") or name not in vars(module):
        return False
    value = vars(module)[name]
    if inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value):
        return False
    if isinstance(value, typing.TypeVar) or typing.get_origin(value) is not None:
        return False  # type variables and aliases (``Sample = tuple[...]``)
    analyzer = ModuleAnalyzer.for_module(module.__name__)
    return ("", name) not in analyzer.find_attr_docs()


def _comments(module: Any) -> dict[str, str]:
    """The trailing comment of each one-line top-level assignment (``QUANTUM = 1 << 32  # ...``)."""
    lines = inspect.getsource(module).splitlines()
    out = {}
    for stmt in ast.parse("\n".join(lines)).body:
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.lineno == stmt.end_lineno:
            comment = re.search(r"#\s*(.+)$", lines[stmt.lineno - 1][stmt.end_col_offset :])
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name) and comment:
                    out[target.id] = comment[1]
    return out


def _data(module: Any, name: str, comments: dict[str, str]) -> str:
    """A ``py:data`` entry: the value when it is short, and the line's comment as its description.

    (``autodata`` would describe an undocumented dict with ``dict``'s docstring.)
    """
    value = repr(vars(module)[name])
    text = f".. py:data:: {name}\n   :module: {module.__name__}\n"
    text += f"   :value: {value}\n" if len(value) <= 80 and "\n" not in value else ""
    if name in comments:
        text += f"\n   {comments[name][0].upper()}{comments[name][1:]}\n"
    return text


def internals_text(srcdir: Path) -> str:
    """MyST text: a section with an ``automodule`` per module the other reference pages do not declare.

    Each shows all its public names, with or without a docstring. Left out: modules named
    as a public object is (``quern.transforms.pad``: its contents are public), and in each module
    the objects of the API pages and the names it imports (documented where defined).
    """
    declared: set[str] = set()
    for page in (srcdir / "reference").glob("*.md"):
        if page.stem != "internals":
            declared.update(DECLARED.findall(page.read_text()))
    public = {(path.rpartition(".")[2], id(obj)) for path, obj in public_names()}
    paths = {path for path, _ in public_names()}
    parts = []
    for name in modules():
        if name in declared or _shadowed(name, paths):
            continue
        module = importlib.import_module(name)
        own = _defined(module)
        left = [m for m, v in vars(module).items() if (m, id(v)) in public or (m not in own and not m.startswith("_"))]
        options = "   :undoc-members:\n   :ignore-module-all:\n   :imported-members:\n" + (
            f"   :exclude-members: {', '.join(sorted(left))}\n" if left else ""
        )
        comments = _comments(module)
        data = "".join(f"\n{_data(module, m, comments)}" for m in sorted(own - set(left)) if _plain_data(module, m))
        parts.append(f"## `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n{options}{data}```\n")
    return "\n".join(parts)


def expand_internals(app: Sphinx, docname: str, source: list[str]) -> None:
    """Replace a page's ``{quern-internals}`` fence by the modules' sections."""
    if INTERNALS_FENCE.search(source[0]):
        text = internals_text(Path(app.srcdir))
        source[0] = INTERNALS_FENCE.sub(lambda _: text, source[0])


def always_read(app: Sphinx, env: BuildEnvironment, added: set, changed: set, removed: set) -> list[str]:
    """The generated pages are read on every build: the code they come from may have changed."""
    return [d for d in GENERATED if d in env.found_docs]


# --------------------------------------------------------------------------- generated rST


class _Generated(SphinxDirective):
    """A directive whose content is reST made from the code (also inside a MyST page)."""

    def rst(self) -> str:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        if not isinstance(self.state, RSTState):  # a MyST fence: its content would be read as Markdown
            log.warning("%s: use it inside an eval-rst block", self.name, location=self.get_location())
            return []
        return nested_parse_to_nodes(self.state, self.rst())


def _google(doc: str | None, config: Any) -> str:
    return str(GoogleDocstring(inspect.cleandoc(doc or ""), config))


def type_text(ann: Any, label: dict[type, str]) -> str:
    """reST for a config key's type: ``int``, ``"global" | "block"``, a link to a section."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None) or ann is None:
        return "``null``"
    if origin is typing.Annotated:
        return type_text(args[0], label)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_text(a, label) for a in args)
    if origin is typing.Literal:
        return " | ".join(f"``{json.dumps(a)}``" for a in args)
    if origin in (list, tuple):
        return f"list of {type_text(args[0], label)}" if args else "``list``"
    if origin is dict:
        return f"mapping of ``str`` to {type_text(args[1], label)}" if args else "mapping"
    if ann is typing.Any:
        return "any"
    if ann in label:
        return f":ref:`{ann.__name__} <{label[ann]}>`"
    return f"``{getattr(ann, '__name__', ann)}``"


def config_models(schema: Any) -> list[type]:
    """The config models: the top-level forms first, then each section as the keys reach it, then the rest."""
    from pydantic import BaseModel

    seen: list[type] = []

    def walk(ann: Any) -> None:
        if inspect.isclass(ann) and issubclass(ann, BaseModel):
            if ann not in seen:
                seen.append(ann)
                for field in ann.model_fields.values():
                    walk(field.annotation)
        for arg in typing.get_args(ann):
            walk(arg)

    for top in (schema.PipelineConfig, schema.MixPipelineConfig, schema.BucketPipelineConfig):
        seen.append(top)
    for top in list(seen):
        for field in top.model_fields.values():
            walk(field.annotation)
    for name in schema.__all__:
        walk(getattr(schema, name))
    return seen


class ConfigReference(_Generated):
    """``quern-config-reference``: every config section and key, from :mod:`quern.pipeline.config.schema`."""

    def rst(self) -> str:
        schema = importlib.import_module("quern.pipeline.config.schema")
        models = config_models(schema)
        label = {m: f"config-{m.__name__.lower()}" for m in models}
        out = [".. currentmodule:: quern.pipeline.config.schema", ""]
        for model in models:
            title = model.__name__
            # a page label for the section (an rST label inside a MyST page's eval-rst is lost)
            std = self.env.domains.standard_domain
            std.note_hyperlink_target(label[model], self.env.docname, nodes.make_id(title), title)
            out += [title, "-" * len(title), ""]
            out += [_google(model.__doc__, self.config), ""]
            out += [".. list-table::", "   :header-rows: 1", "   :widths: 15 25 12 48", ""]
            out += ["   * - key", "     - type", "     - default", "     - meaning"]
            for key, field in model.model_fields.items():
                if field.is_required():
                    default = "required"
                else:
                    value = field.get_default(call_default_factory=True)
                    default = f"``{json.dumps(value)}``"
                desc = (field.description or "").replace("\n", " ")
                out += [f"   * - ``{field.alias or key}``", f"     - {type_text(field.annotation, label)}"]
                out += [f"     - {default}", f"     - {desc}"]
            out.append("")
        return "\n".join(out)


class MetricsReference(_Generated):
    """``quern-metrics``: the Prometheus series, from :data:`quern.metrics.METRICS`."""

    def rst(self) -> str:
        metrics = importlib.import_module("quern.pipeline.iterate.prometheus")
        specs = {spec[0]: spec for spec in metrics._SPECS}  # name, type, unit, extra labels, help
        out = [".. list-table::", "   :header-rows: 1", "   :widths: 34 8 8 12 38", ""]
        out += ["   * - name", "     - type", "     - unit", "     - extra labels", "     - meaning"]
        for name in metrics.METRICS:
            _, kind, unit, extra, doc = specs[name]
            labels = ", ".join(f"``{x}``" for x in extra)
            out += [f"   * - ``{name}``", f"     - {kind}", f"     - {unit}", f"     - {labels}", f"     - {doc}"]
        out += ["", "Every series has the labels " + ", ".join(f"``{x}``" for x in metrics.LABELS) + "."]
        return "\n".join(out)


# --------------------------------------------------------------------------- docstrings

TYPE_WORD = re.compile(r"[\w.~`:]+")
_MISSING = object()
_ATTRIBUTES: dict[type, set[str]] = {}  # class -> the members its docstring describes (``Attributes:``)


def _typelike(text: str) -> bool:
    """Whether napoleon's "type" before a colon is a type (``np.ndarray``, ``list[int] | None``), not prose."""
    flat = re.sub(r"\[[^\]]*\]", "", text)
    return all(TYPE_WORD.fullmatch(p.strip()) for p in re.split(r"[|,]| or ", flat))


def prose_before_colon(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """After napoleon: a ``Returns:`` or property line such as ``The batch: a dict ...`` is prose, not a type.

    Napoleon reads what comes before the first colon as the type; when that is not a
    type expression, put the words back in front of the description. Also note the
    attributes a class's ``Attributes:`` section documents (see :func:`skip_member`).
    """
    if what in ("class", "exception") and inspect.isclass(obj):
        names = {m[1] for line in lines if (m := re.match(r"\s*\.\. attribute:: (\w+)", line))}
        _ATTRIBUTES[obj] = names | (set(obj.model_fields) | {"model_config"} if _is_model(obj) else set())
    i = len(lines)
    while i > 0:
        i = min(i, len(lines)) - 1
        m = re.fullmatch(r"(\s*):(rtype|type): (.+)", lines[i])
        if m and not _typelike(m[3]):
            _untype(lines, i, m[1], m[2], m[3])


def _untype(lines: list[str], i: int, indent: str, field: str, words: str) -> None:
    """Drop the ``:rtype:``/``:type:`` line ``i`` and put ``words:`` back in front of its description."""
    if field == "rtype":
        found = [k for k in range(i) if lines[k].lstrip().startswith(":returns:")]
        if not found:
            return
        lines[found[-1]] = lines[found[-1]].replace(":returns: ", f":returns: {words}: ", 1)
        del lines[i]
        return
    start = 0  # the description: of the attribute directive it belongs to, or of the docstring
    for k in range(i - 1, -1, -1):
        if (
            indent
            and re.match(r"\s*\.\. attribute::", lines[k])
            and len(lines[k]) - len(lines[k].lstrip()) < len(indent)
        ):
            start = k + 1
            break
    field = re.compile(r"\s*:[^`:]+:(\s|$)")  # an option or field line, not a role such as :func:`x`
    body = [k for k in range(start, i) if lines[k].strip() and not field.match(lines[k])]
    if not body:
        return
    j = body[0]
    pad = len(lines[j]) - len(lines[j].lstrip())
    lines[j] = f"{lines[j][:pad]}{words}: {lines[j][pad:]}"
    del lines[i]
    if i == len(lines) and i > 0 and not lines[i - 1].strip():
        del lines[i - 1]


def _is_model(obj: Any) -> bool:
    try:
        from pydantic import BaseModel
    except ImportError:
        return False
    return inspect.isclass(obj) and issubclass(obj, BaseModel)


def model_signature(app: Sphinx, what: str, name: str, obj: Any, options: Any, args: str, ret: str) -> Any:
    """A config model's entry shows no parameters and no types: its keys are on the config page.

    (Pydantic's signature spells each key's constraints as ``FieldInfo`` reprs.)
    """
    if what == "class" and _is_model(obj):
        app.env.current_document.autodoc_annotations.pop(name, None)
        return "", None
    return None


def skip_member(app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """Leave out a class's members that its docstring's ``Attributes:`` already describes.

    Dataclass and named-tuple fields would otherwise be described twice (once with the
    docstring of their default value), and a config model's fields are on the config page.
    """
    if what not in ("class", "exception"):
        return None
    for cls, names in _ATTRIBUTES.items():
        if name not in names:
            continue
        if vars(cls).get(name, _MISSING) is obj:  # a named-tuple field, or a field's default value
            return True
        if name in getattr(cls, "__annotations__", {}) and not (inspect.isroutine(obj) or isinstance(obj, property)):
            return True  # a field without a default, or a slot
    return None


_TOCTREES: dict[tuple[Any, ...], str] = {}


def same_source_toctree(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    """The navigation of viewcode's source pages (``_modules/...``) made once per folder depth.

    The theme renders the whole table of contents on every page; the source pages are in no
    toctree, so theirs differs only by the depth of the links. Made once per depth, not once per
    page, that is about a fifth of the build's time less.
    """
    real = context.get("toctree")
    if not pagename.startswith("_modules/") or real is None:
        return

    def toctree(**kwargs: Any) -> str:
        key = (pagename.count("/"), *sorted(kwargs.items()))
        if key not in _TOCTREES:
            _TOCTREES[key] = real(**kwargs)
        return _TOCTREES[key]

    context["toctree"] = toctree


def forget_toctrees(app: Sphinx) -> None:
    """A new build (another builder, or a build again in this process) makes its own navigation."""
    _TOCTREES.clear()


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directives, the hooks and the checks."""
    app.add_directive("quern-config-reference", ConfigReference)
    app.add_directive("quern-metrics", MetricsReference)
    app.connect("autodoc-process-docstring", prose_before_colon, priority=600)  # after napoleon (500)
    app.connect("autodoc-skip-member", skip_member)
    app.connect("autodoc-process-signature", model_signature)
    app.connect("source-read", expand_internals)
    app.connect("env-get-outdated", always_read)
    app.connect("missing-reference", resolve_alias)
    app.connect("env-check-consistency", check_public)
    app.connect("builder-inited", forget_toctrees)
    app.connect("html-page-context", same_source_toctree, priority=100)  # before the theme's (500)
    app.add_post_transform(PlainExternalReferences)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
