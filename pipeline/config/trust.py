"""What a config may import: the trust model of ``fn: "module:function"`` entries.

A config is data: loading one runs only code that its reader trusts, never code
its author merely names. An ``fn`` entry may name

1. a function of a module that lies in the config file's own folder:
   ``fn: "mytransforms:f"`` with ``mytransforms.py`` beside the config, or
   ``fn: "mypkg.sub:f"`` with a package folder ``mypkg/`` (with
   ``__init__.py``) beside it. Whoever can put a ``.py`` file in that folder is
   trusted like the config's author (keep configs you did not write out of
   folders that hold Python files, such as a downloads folder). Only Python
   source counts: a module there that is a compiled file (``sneaky.pyc``, an
   extension module ``.so``, a package whose ``__init__`` is one) is refused
   with a :class:`ConfigError` naming it and nothing of it runs, a
   ``__pycache__/*.pyc`` without its ``.py`` is not a module, and the modules of
   the folder (those the named one imports while the config loads included) are
   compiled from their ``.py`` source, never from ``__pycache__`` (whose files a
   reader does not inspect: an unchecked hash-based ``.pyc`` would run whatever
   the ``.py`` says). The module's
   top-level name must not also name a module of the standard library or any
   other importable or imported module (``os.py``, ``numpy.py`` beside a config
   would shadow it): such a file is refused, rename it. A dict config has no
   folder.
2. a function of a module under a prefix the user allowed, outside the config:
   ``quern ... --allow PREFIX`` (repeatable; before or after the command),
   ``QUERN_ALLOW=PREFIX,PREFIX`` in the environment, or
   ``load_config(..., allow=["PREFIX"])`` from Python (the three add up). A
   prefix is a dotted module name, matched by whole components: ``mypkg``
   allows ``mypkg`` and ``mypkg.sub``, not ``mypkgevil``; there is no wildcard
   (``""``, ``"*"``, ``"mypkg.*"`` are refused), and a config cannot allow
   anything itself. The standard library gets no exception: ``os``,
   ``builtins``, ``subprocess``, ``importlib``, ``pickle``... are refused like
   any module until a prefix names them (``--allow os``). Allowing ``a.b`` lets
   importing it run ``a/__init__.py`` too. Such modules are imported from
   ``sys.path``, searched after the config file's folder and the current
   directory (so no ``PYTHONPATH`` is needed for them).

(and ``name:`` entries name :data:`REGISTRY`, which only Python code extends.)
Anything else is refused before anything is imported, so no import-time code of
a refused module runs: a :class:`ConfigError` (exit status 2 from ``quern``)
names the entry and says how to allow it.

The rest of an ``fn`` is checked too. Before any import: the module is a dotted
path of ASCII identifiers (no relative ``.mod``, no dunder part such as
``__main__``), and the part after ``:`` a dotted path of ASCII identifiers of
which none starts with ``_`` (``mod:_helper``, ``mod:__builtins__.exec``,
``mod:f.__globals__`` are refused: private and special attributes are not a
module's transforms). After the import (as Hydra learned, a name is not an
identity: ``logging:os.system`` is ``os.system``), the path must not pass
through a module (``mod:os.system``), and the object it finds must be defined
in a trusted module by rule 1 or 2: its ``__module__`` (a function's, a
class's, an instance's class's, through ``functools.partial``) is checked, so
``from os import system`` in an allowed module does not make ``mod:system``
allowed, nor a method a class inherits from the standard library. An instance
of a registered transform class is accepted wherever it is defined.

Modules loaded from the config's folder or the current directory (off
``sys.path``) are registered with ``cloudpickle.register_pickle_by_value``:
worker processes, which start with the parent's ``sys.path``, receive their
code with the pipeline. A module that is already imported is used as it is
(module names are global to a process: two configs cannot use two different
``mytransforms.py``; the second is refused, as it would shadow the first).


"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

import cloudpickle

from ..errors import ConfigError
from ..limits import show
from ..registry import REGISTRY

__all__ = ["ALLOW_VARIABLE", "FN", "FN_FORM", "IDENT", "MODULE", "Policy", "import_object", "prefixes"]

ALLOW_VARIABLE = "QUERN_ALLOW"
"""The environment variable of allowed module prefixes, comma-separated (see the module docstring)."""


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_PART = r"(?!__)[A-Za-z_][A-Za-z0-9_]*"  # no dunder part: __main__, __init__
_PUBLIC = r"[A-Za-z][A-Za-z0-9_]*"  # no leading underscore: private and special attributes
MODULE = re.compile(rf"{_MODULE_PART}(?:\.{_MODULE_PART})*")
FN = re.compile(rf"(?P<module>{MODULE.pattern}):(?P<qualname>{_PUBLIC}(?:\.{_PUBLIC})*)")
FN_FORM = "fn must look like 'package.module:function'"


# --------------------------------------------------------------------------- what a config may import


def prefixes(allow: str | Iterable[str] | None) -> tuple[str, ...]:
    """The allowed module prefixes: those of ``allow`` and of :data:`ALLOW_VARIABLE`, checked."""
    given = [allow] if isinstance(allow, str) else list(allow or ())
    found = []
    for prefix in given:
        if not isinstance(prefix, str) or not MODULE.fullmatch(prefix):
            raise ConfigError(
                f"allow: {show(prefix)} is not a module prefix: give a dotted module name such as 'mypkg' or "
                "'mypkg.transforms' (it allows that module and those under it; there is no wildcard)"
            )
        found.append(prefix)
    for prefix in os.environ.get(ALLOW_VARIABLE, "").split(","):
        prefix = prefix.strip()
        if prefix and not MODULE.fullmatch(prefix):
            raise ConfigError(
                f"{ALLOW_VARIABLE}: {show(prefix)} is not a module prefix: give dotted module names separated "
                "by commas, such as 'mypkg,otherpkg.transforms' (there is no wildcard)"
            )
        if prefix:
            found.append(prefix)
    return tuple(dict.fromkeys(found))


def _under(module: str, prefixes: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or under one (``mypkg`` covers ``mypkg.sub``, not ``mypkgevil``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _inside(path: str, folder: str) -> bool:
    """Whether the file ``path`` lies under the absolute path ``folder``."""
    return os.path.abspath(path).startswith(folder.rstrip(os.sep) + os.sep)


def _on_sys_path(folder: str) -> bool:
    """Whether the absolute path ``folder`` is on ``sys.path`` (``""`` counting as the current directory)."""
    return any(os.path.abspath(p or os.curdir) == folder for p in sys.path)


def _origin(spec: importlib.machinery.ModuleSpec | None) -> str | None:
    """Where a module spec's code lies: its file, or its package's folder; ``None`` for none (built-in, namespace)."""
    if spec is None or not spec.has_location or not spec.origin:
        return None
    return os.path.dirname(spec.origin) if spec.submodule_search_locations is not None else spec.origin


class Policy:
    """What one config may import: modules under the allowed ``prefixes``, and
    modules whose top-level module or package lies in ``folder`` (the config
    file's; ``None`` for a dict). See the module docstring."""

    def __init__(self, prefixes: Sequence[str], folder: str | None):
        self.prefixes = tuple(prefixes)
        self.folder = folder

    def _spec_in_folder(self, module: str) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``module``'s top-level name directly in the config's folder, or
        ``None``. Found without importing anything."""
        if self.folder is None:
            return None
        top = module.partition(".")[0]
        try:
            spec = importlib.machinery.PathFinder.find_spec(top, [self.folder])
        except (ImportError, ValueError, OSError):
            return None
        origin = _origin(spec)
        return spec if origin is not None and _inside(origin, self.folder) else None

    def _in_folder(self, module: str) -> str | None:
        """The file or package folder that ``module``'s top-level name has directly in
        the config's folder, or ``None``. Found without importing anything."""
        return _origin(self._spec_in_folder(module))

    def how_to_allow(self, module: str) -> str:
        """What a config may name, and how to allow ``module`` (a sentence for messages)."""
        top = module.partition(".")[0]
        stdlib = (
            f" ({top!r} is Python's standard library: allow it only if configs may call anything in it.)"
            if top in sys.stdlib_module_names
            else ""
        )
        may = (
            "registered transforms ({name: ...}), functions of modules in its own folder, "
            if self.folder is not None
            else "registered transforms ({name: ...}) (a dict config has no folder of its own) "
        )
        return (
            f"a config may name {may}and functions of modules under prefixes you allow: "
            f"quern --allow {module}, {ALLOW_VARIABLE}={module}, or load_config(..., allow=[{module!r}]){stdlib}"
        )

    def check_module(self, module: str) -> bool:
        """Whether ``module`` may be imported: ``True`` under an allowed prefix,
        ``False`` from the config's folder; else a :class:`ConfigError`. Imports nothing."""
        if _under(module, self.prefixes):
            return True
        top = module.partition(".")[0]
        spec = self._spec_in_folder(module)
        origin = _origin(spec)
        if spec is None or origin is None:
            raise ConfigError(
                f"module {module!r} is not allowed: {self._compiled_only(top)}{self.how_to_allow(module)}"
            )
        if not _is_source(spec):
            raise ConfigError(_not_source(module, str(spec.origin), self.folder))
        if top in sys.stdlib_module_names or top in sys.builtin_module_names:
            raise ConfigError(
                f"{os.path.basename(origin)} in the config's folder has the name of the standard library's "
                f"module {top!r}: it is refused (it would shadow it); rename it"
            )
        try:  # what importing the name would give without the folder: the imported module, or sys.path's
            found = importlib.util.find_spec(top)
            elsewhere = None if found is None else (_origin(found) or "built in")
        except (ImportError, ValueError):  # an imported module without a spec (__main__)
            elsewhere = "an imported module without a file"
        if elsewhere is not None and os.path.realpath(elsewhere) != os.path.realpath(origin):
            raise ConfigError(
                f"{os.path.basename(origin)} in the config's folder has the name of another module, {top!r} "
                f"({elsewhere}): it is refused (one name, two modules); rename it"
            )
        return False

    def _compiled_only(self, top: str) -> str:
        """What the config's folder holds of ``top`` that is not a module (compiled files
        in ``__pycache__`` without their ``.py``), as the start of a message, or ``""``."""
        if self.folder is None:
            return ""
        cache = os.path.join(self.folder, "__pycache__")
        try:
            found = sorted(n for n in os.listdir(cache) if n.startswith(top + ".") and n.endswith(".pyc"))
        except OSError:
            return ""
        if not found:
            return ""
        return (
            f"the config's folder has only compiled code of it ({os.path.join('__pycache__', found[0])}), "
            "which is not trusted: only .py source files (and package folders with an __init__.py) are; "
        )

    def trusted(self, module: Any) -> bool:
        """Whether code defined in the module named ``module`` (an object's ``__module__``) is trusted."""
        if not isinstance(module, str):
            return False
        if _under(module, self.prefixes):
            return True
        loaded = sys.modules.get(module)
        origin = self._in_folder(module)
        file = getattr(loaded, "__file__", None)
        top_file = getattr(sys.modules.get(module.partition(".")[0]), "__file__", None)
        return (
            origin is not None
            and isinstance(file, str)
            and isinstance(top_file, str)
            and (file == origin or _inside(file, origin))
            and (top_file == origin or _inside(top_file, origin))
        )

    def resolve(self, spec: str) -> Any:
        """The object ``spec`` (``"module:qualname"``, its form already checked) names,
        imported only when :meth:`check_module` allows; see :func:`import_object`."""
        module_name, _, qualname = spec.partition(":")
        allowed = self.check_module(module_name)
        folders = ([self.folder] if self.folder else []) + ([os.getcwd()] if allowed else [])
        obj = import_object(module_name, folders, source_only=[self.folder] if self.folder else [])
        if not allowed and not self.trusted(module_name):  # imported from elsewhere after all (a race)
            raise ConfigError(f"module {module_name!r} was not imported from the config's folder")
        for part in qualname.split("."):
            obj = getattr(obj, part)
            if isinstance(obj, types.ModuleType):  # mod:os.system, where mod imported os
                raise ConfigError(
                    f"{spec!r} reaches the module {obj.__name__!r} through {module_name!r}: name a function in "
                    f"the module that defines it, which must be allowed: {self.how_to_allow(obj.__name__)}"
                )
        return obj

    def check_origin(self, spec: str, obj: Any) -> None:
        """Refuse ``obj`` (what ``spec`` found) unless it is defined in a trusted module."""
        inner = obj
        while isinstance(inner, functools.partial):
            inner = inner.func
        if any(isinstance(factory, type) and type(inner) is factory for factory in REGISTRY.values()):
            return  # an instance of a registered transform
        module = getattr(inner, "__module__", None)
        if not self.trusted(module):
            name = module if isinstance(module, str) else "an unknown module"
            hint = self.how_to_allow(module) if isinstance(module, str) else "name a function defined in its module"
            raise ConfigError(f"{spec!r} is defined in {name}, which is not allowed (only imported there): {hint}")


def _is_source(spec: importlib.machinery.ModuleSpec) -> bool:
    """Whether ``spec`` loads a ``.py`` source file (a module, or a package's ``__init__.py``)."""
    return (
        isinstance(spec.loader, importlib.machinery.SourceFileLoader)
        and isinstance(spec.origin, str)
        and spec.origin.endswith(".py")
    )


def _not_source(module: str, file: str, folder: str | None) -> str:
    """The message refusing ``module``, found as the compiled ``file`` in the config's folder."""
    shown = os.path.relpath(file, folder) if folder else file
    return (
        f"module {module!r} is {shown} in the config's folder, which is not Python source: only .py files "
        "(and package folders with an __init__.py) are trusted modules, compiled code (.pyc, .so, ...) is "
        "refused and not run; put its .py source there, or install it and allow it (quern --allow)"
    )


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles the ``.py`` file itself: never reads nor writes ``__pycache__``."""

    def get_code(self, fullname: str) -> types.CodeType:
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _SourceOnlyFinder:
    """On ``sys.meta_path`` (before the ``PathFinder``) while :func:`import_object` runs:
    a module whose top-level module or package lies directly in one of ``folders``
    is loaded by :class:`_SourceOnlyLoader` from its ``.py`` file, and refused with a
    :class:`ConfigError` when it is compiled code. Other modules are left to the
    finders after it."""

    def __init__(self, folders: Sequence[str]) -> None:
        self.folders = [os.path.abspath(f) for f in folders]

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.has_location or not isinstance(spec.origin, str):
            return None
        top = fullname.partition(".")[0]
        folder = next((f for f in self.folders if _top_lies_in(spec.origin, f, top)), None)
        if folder is None:
            return None
        if not _is_source(spec):
            raise ConfigError(_not_source(fullname, spec.origin, folder))
        spec.loader = _SourceOnlyLoader(fullname, spec.origin)
        return spec


def _top_lies_in(file: str, folder: str, top: str) -> bool:
    """Whether ``file`` is the module ``top`` in ``folder`` (``top.py``, ``top.*.so``) or lies in its package folder."""
    if not _inside(file, folder):
        return False
    first = os.path.relpath(os.path.abspath(file), folder).split(os.sep)[0]
    return first == top or first.partition(".")[0] == top


def import_object(module_name: str, folders: Sequence[str], source_only: Sequence[str] = ()) -> Any:
    """The module ``module_name``, imported as usual except that ``folders`` are
    searched first: those not already on ``sys.path`` are put at its front while
    the import runs and taken off again, so the process's ``sys.path`` is left as
    it was. Modules whose top-level module or package lies directly in a folder of
    ``source_only`` (the config's) are compiled from their ``.py`` source only,
    never from ``__pycache__``, and compiled code there is refused with a
    :class:`ConfigError`. Modules that the import loaded from such a folder are registered with
    ``cloudpickle.register_pickle_by_value``: worker processes, which start with
    the parent's ``sys.path`` and could not import them, receive their code with
    the pipeline. A module that is already imported is used as it is. Not
    thread-safe against imports running concurrently. The one place a config
    imports code, and only after :meth:`Policy.check_module` allowed it."""
    added = [f for f in dict.fromkeys(os.path.abspath(f) for f in folders) if not _on_sys_path(f)]
    before = set(sys.modules)
    finder = _SourceOnlyFinder(source_only)
    at = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
    sys.path[:0] = added
    if source_only:
        sys.meta_path.insert(at, finder)
    try:
        module = importlib.import_module(module_name)
    finally:
        for folder in added:
            sys.path.remove(folder)
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None)
        if file and any(_inside(file, f) for f in added):
            cloudpickle.register_pickle_by_value(sys.modules[name])
    return module
