"""What a config may import: the trust model of ``fn: "module:function"`` entries.

A config is data: loading one runs only code that its reader trusts, never code
its author merely names. An ``fn`` entry may name a function of a module in the
config file's own folder (Python source only, not shadowing another module), or
of a module under a prefix the user allowed (``quern --allow PREFIX``,
``QUERN_ALLOW``, ``load_config(allow=...)``); ``name:`` entries name
:data:`REGISTRY`. Anything else is refused with a :class:`ConfigError` before
anything is imported, and the object found must be defined in a trusted module.
The whole rule, and why: ``docs/design/config-trust.md``.
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

from ..core.errors import ConfigError
from ..core.registry import REGISTRY
from .limits import show

__all__ = ["ALLOW_VARIABLE", "FN", "FN_FORM", "IDENT", "MODULE", "Policy", "import_object", "prefixes"]

ALLOW_VARIABLE = "QUERN_ALLOW"
"""The environment variable of allowed module prefixes, comma-separated (``docs/design/config-trust.md``)."""


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_PART = r"(?!__)[A-Za-z_][A-Za-z0-9_]*"  # no dunder part: __main__, __init__
_PUBLIC = r"[A-Za-z][A-Za-z0-9_]*"  # no leading underscore: private and special attributes
MODULE = re.compile(rf"{_MODULE_PART}(?:\.{_MODULE_PART})*")
FN = re.compile(rf"(?P<module>{MODULE.pattern}):(?P<qualname>{_PUBLIC}(?:\.{_PUBLIC})*)")
FN_FORM = "fn must look like 'package.module:function'"


# --------------------------------------------------------------------------- what a config may import


def prefixes(allow: str | Iterable[str] | None) -> tuple[str, ...]:
    """The allowed module prefixes: those of ``allow`` and of :data:`ALLOW_VARIABLE`, checked.

    Args:
        allow: A prefix, prefixes, or ``None``.

    Returns:
        Each prefix once, in order: ``allow``'s, then the environment variable's.

    Raises:
        ConfigError: A prefix is not a dotted module name (there is no wildcard).
    """
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
    """What one config may import (the rule of ``docs/design/config-trust.md``).

    Args:
        prefixes: The allowed module prefixes (:func:`prefixes`): modules under them may be imported.
        folder: The config file's folder: modules whose top-level module or package
            lies there may be imported too (``None`` for a dict config).
    """

    def __init__(self, prefixes: Sequence[str], folder: str | None):
        self.prefixes = tuple(prefixes)
        self.folder = folder

    def _spec_in_folder(self, module: str) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``module``'s top-level name directly in the config's folder, or ``None``.

        Found without importing anything.
        """
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
        """The file or package folder that ``module``'s top-level name has directly in the config's folder, or ``None``.

        Found without importing anything.
        """
        return _origin(self._spec_in_folder(module))

    def how_to_allow(self, module: str) -> str:
        """What a config may name, and how to allow ``module``: a sentence for messages.

        Args:
            module: A module name.

        Returns:
            The sentence, with a warning when ``module`` is in the standard library.
        """
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
        """Check that ``module`` may be imported, and say from where; imports nothing.

        Args:
            module: A dotted module name.

        Returns:
            ``True`` when it is under an allowed prefix, ``False`` when it is in the
            config's folder.

        Raises:
            ConfigError: It may not be imported: neither, compiled code in the folder,
                or a file in the folder that would shadow another module.
        """
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
        """What the config's folder holds of ``top`` that is not a module, as the start of a message, or ``""``.

        Compiled files in ``__pycache__`` without their ``.py``.
        """
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
        """Whether code defined in the module named ``module`` is trusted.

        Args:
            module: An object's ``__module__`` (anything: only a string can be trusted).

        Returns:
            ``True`` under an allowed prefix, or when the module was imported from the config's folder.
        """
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
        """The object ``spec`` names, its module imported only when :meth:`check_module` allows.

        Args:
            spec: ``"module:qualname"``, its form already checked (the schema's :data:`FN`).

        Returns:
            The object (not yet checked for where it is defined: :meth:`check_origin`).

        Raises:
            ConfigError: The module may not be imported, or the name reaches another module.
        """
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
        """Refuse ``obj`` unless it is defined in a trusted module (or is a registered transform).

        Args:
            spec: The ``fn`` entry that found it (for the message).
            obj: What :meth:`resolve` found; a ``functools.partial`` is looked through.

        Raises:
            ConfigError: Its ``__module__`` is not trusted.
        """
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
    """Loads the modules of ``folders`` from their ``.py`` source only; on ``sys.meta_path`` during an import.

    It is placed before the ``PathFinder`` while :func:`import_object` runs: a
    module whose top-level module or package lies directly in one of ``folders``
    is loaded by :class:`_SourceOnlyLoader` from its ``.py`` file, and refused with a
    :class:`ConfigError` when it is compiled code. Other modules are left to the
    finders after it.
    """

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


def import_object(module_name: str, folders: Sequence[str], *, source_only: Sequence[str] = ()) -> Any:
    """Import the module ``module_name`` as usual, except that ``folders`` are searched first.

    The one place a config imports code, and only after :meth:`Policy.check_module`
    allowed it. Folders not already on ``sys.path`` are put at its front while the
    import runs and taken off again, so the process's ``sys.path`` is left as it
    was. Modules that the import loaded from such a folder are registered with
    ``cloudpickle.register_pickle_by_value``: worker processes, which start with
    the parent's ``sys.path`` and could not import them, receive their code with
    the pipeline. A module that is already imported is used as it is. Not
    thread-safe against imports running concurrently.

    Args:
        module_name: The dotted module name.
        folders: Folders searched before ``sys.path``.
        source_only: Folders (the config's) whose modules are compiled from their
            ``.py`` source only, never from ``__pycache__``.

    Returns:
        The module.

    Raises:
        ConfigError: A module of a ``source_only`` folder is compiled code.
        ImportError: The module cannot be imported (or whatever its code raises).
    """
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
