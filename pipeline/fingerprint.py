"""What changes the bytes of a batch, described and hashed.

:func:`describe_callable` turns a transform into a JSON-able description that
depends only on what it computes:

* a function: a hash of its code (bytecode, constants, the names it uses,
  nested functions), its defaults, its closure values, and the module-level
  values it reads (by content, see :mod:`quern.pipeline.digest`; functions and
  classes recursively; modules by name). Not its module name, file, line
  numbers or own name: the same function run as ``python train.py``
  (``__main__``) and imported as ``train`` gives the same description;
* ``functools.partial``: its function, arguments and keyword arguments;
* a bound method: its function and the state of the object it is bound to;
* a library wrapper with ``__wrapped__`` (``jax.jit``, ``functools.lru_cache``):
  the wrapper's type and the wrapped function;
* a callable instance (a class with ``__call__``, a dataclass transform): its
  class (the code of its methods) and its state (``vars()``, slots);
* an object with a ``fingerprint()`` method: what that returns.

A value it cannot describe by content raises
:class:`~quern.pipeline.errors.FingerprintError` naming the transform and the
value, and saying how to declare it; nothing is ever hashed by its type name.

Not covered (documented limits): code of other modules that a transform calls
through a module attribute (``mylib.helper(x)`` is described as "uses module
mylib"), and library versions (numpy's, say): upgrading a library that a
transform calls does not change the fingerprint.

:func:`fingerprint_of` hashes a pipeline description (a JSON-able dict) into the
32-hex-digit fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import types
from typing import Any

from .digest import HOW_TO_DECLARE, digest
from .errors import FingerprintError

__all__ = ["describe_callable", "describe_value", "fingerprint_of"]

_MAX_DEPTH = 16


def fingerprint_of(description: dict[str, Any]) -> str:
    """The 32-hex-digit fingerprint of a JSON-able ``description`` (keys sorted, so
    dict order does not matter)."""
    try:
        text = json.dumps(description, sort_keys=True, allow_nan=True)
    except TypeError as e:  # a source identity with a value JSON cannot hold: never hashed by its repr
        raise FingerprintError(f"the pipeline description is not plain data: {e}") from e
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe_callable(fn: Any, where: str = "transform") -> Any:
    """A JSON-able description of what ``fn`` computes (see the module docstring).

    ``where`` names ``fn`` in errors (e.g. ``"map[0] double"``). Depends only on
    ``fn``'s code, arguments and the values it reads: the same in every process."""
    return _Describer(where).callable(fn, 0)


def describe_value(value: Any, where: str = "value") -> Any:
    """A JSON-able description of a value a transform reads: functions and classes
    by their code, modules by name, anything else by content (:func:`digest`)."""
    return _Describer(where).value(value, where, 0)


class _Describer:
    """Describes a callable and what it reads; ``seen`` breaks cycles (recursive functions)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: dict[int, str] = {}

    def value(self, value: Any, where: str, depth: int) -> Any:
        if inspect.ismodule(value):
            return f"module {value.__name__}"
        if isinstance(value, type):
            return self.cls(value, depth)
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            return self.callable(value, depth + 1)
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) or type(value).__name__ == "ufunc":
            if getattr(value, "__self__", None) is not None and not inspect.ismodule(value.__self__):
                return {
                    "builtin": getattr(value, "__qualname__", value.__name__),
                    "self": self.value(value.__self__, f"{where}.__self__", depth + 1),
                }
            return f"builtin {getattr(value, '__module__', None) or ''}.{value.__name__}"
        try:
            return digest(value, where)
        except FingerprintError:
            if callable(value) and depth < _MAX_DEPTH:
                return self.callable(value, depth + 1)
            raise FingerprintError(
                f"{self.where} reads {where}, a {type(value).__module__}.{type(value).__qualname__}, which quern "
                f"cannot describe by its content; {HOW_TO_DECLARE}"
            ) from None

    def callable(self, fn: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise FingerprintError(f"{self.where}: functions nested more than {_MAX_DEPTH} levels deep")
        fp = getattr(fn, "fingerprint", None)
        if callable(fp) and not isinstance(fn, type):
            return {"fingerprint": digest(fn, self.where)}
        if isinstance(fn, functools.partial):
            return {
                "partial": self.callable(fn.func, depth + 1),
                "args": [self.value(a, f"{self.where} argument {i}", depth + 1) for i, a in enumerate(fn.args)],
                "kwargs": {
                    k: self.value(v, f"{self.where} argument {k!r}", depth + 1) for k, v in sorted(fn.keywords.items())
                },
            }
        if isinstance(fn, types.MethodType):
            return {"method": self.callable(fn.__func__, depth + 1), "self": self.state(fn.__self__, depth + 1)}
        if isinstance(fn, types.FunctionType):
            return self.function(fn, depth)
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None and callable(wrapped) and not isinstance(fn, type):
            # jax.jit, functools.lru_cache, ...: a library wrapper computes what the function does
            return {
                "wrapper": f"{type(fn).__module__}.{type(fn).__qualname__}",
                "wrapped": self.callable(wrapped, depth + 1),
            }
        if isinstance(fn, type):
            return self.cls(fn, depth)
        if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)) or type(fn).__name__ == "ufunc":
            return self.value(fn, self.where, depth)
        if callable(fn):  # an instance of a class with __call__
            return {"class": self.cls(type(fn), depth + 1), "state": self.state(fn, depth + 1)}
        raise FingerprintError(f"{self.where}: {fn!r} is not callable")

    def function(self, fn: types.FunctionType, depth: int) -> Any:
        key = id(fn)
        if key in self.seen:  # recursion: the description is being built further up
            return {"recursive": self.seen[key]}
        h = hashlib.blake2b(digest_size=16)
        names = _hash_code(fn.__code__, h)
        code = h.hexdigest()
        self.seen[key] = code
        glb = fn.__globals__
        builtins = glb.get("__builtins__")
        used = {}
        for n in sorted(names):
            if n in glb:
                used[n] = self.value(glb[n], f"global {n!r}", depth + 1)
            elif n in _builtin_names(builtins):
                continue  # a builtin: part of the language
        closure = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
                closure.append([name, None])
                continue
            closure.append([name, self.value(contents, f"closure variable {name!r}", depth + 1)])
        defaults = [self.value(d, f"default {i}", depth + 1) for i, d in enumerate(fn.__defaults__ or ())]
        kwdefaults = {
            k: self.value(v, f"default {k!r}", depth + 1) for k, v in sorted((fn.__kwdefaults__ or {}).items())
        }
        return {"code": code, "globals": used, "closure": closure, "defaults": defaults, "kwdefaults": kwdefaults}

    def cls(self, cls: type, depth: int) -> Any:
        """A class by its methods' code and plain class attributes; library classes by name."""
        module = getattr(cls, "__module__", "") or ""
        if module == "builtins" or not _is_user_module(module):
            return f"class {module}.{cls.__qualname__}"
        key = id(cls)
        if key in self.seen:
            return {"recursive": self.seen[key]}
        self.seen[key] = cls.__qualname__
        attrs: dict[str, Any] = {}
        for name, attr in sorted(vars(cls).items()):
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, property):
                attr = attr.fget
            if isinstance(attr, types.FunctionType):
                attrs[name] = self.function(attr, depth + 1)
            elif (name.startswith("__") and name.endswith("__")) or name.startswith("_abc_"):
                continue  # __dict__, __doc__, __module__, dataclass fields, ABC caches: not behaviour
            elif hasattr(type(attr), "__get__") and not callable(attr):
                attrs[name] = f"descriptor {type(attr).__qualname__}"  # slots, namedtuple fields: plumbing
            else:
                attrs[name] = self.value(attr, f"{cls.__qualname__}.{name}", depth + 1)
        bases = [self.cls(b, depth + 1) for b in cls.__bases__ if b is not object]
        return {"class": cls.__qualname__, "bases": bases, "attrs": attrs}

    def state(self, obj: Any, depth: int) -> Any:
        """An object's state: ``vars()`` and slots, each value described by content."""
        if isinstance(obj, type) or inspect.ismodule(obj):
            return self.value(obj, f"{self.where} self", depth)
        fields: dict[str, Any] = {}
        for name in sorted(_state_names(obj)):
            try:
                v = getattr(obj, name)
            except AttributeError:
                continue
            fields[name] = self.value(v, f"{type(obj).__qualname__}.{name}", depth + 1)
        return fields


def _state_names(obj: Any) -> set[str]:
    names = set(getattr(obj, "__dict__", {}) or {})
    for klass in type(obj).__mro__:
        slots = vars(klass).get("__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
    names.discard("__dict__")
    names.discard("__weakref__")
    return names


_LIBRARY_ROOTS = frozenset(
    {
        "numpy",
        "jax",
        "jaxlib",
        "pyarrow",
        "tensorstore",
        "array_record",
        "grain",
        "pydantic",
        "yaml",
        "cloudpickle",
        "orbax",
        "typing",
        "collections",
        "abc",
        "enum",
        "dataclasses",
        "functools",
    }
)


def _is_user_module(module: str) -> bool:
    """Whether classes of ``module`` are described by their code (user code, quern's own
    transforms) rather than by name (the standard library and the big libraries)."""
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in _LIBRARY_ROOTS


def _builtin_names(builtins: Any) -> Any:
    return builtins if isinstance(builtins, dict) else vars(builtins) if builtins is not None else {}


def _hash_code(code: types.CodeType, h: Any) -> set[str]:
    """Feed a code object (bytecode, constants by content, names, nested code) into ``h``;
    return the global names it and its nested code use. Names and line numbers of the
    function itself are not included."""
    h.update(code.co_code)
    h.update(
        json.dumps([code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, code.co_flags]).encode()
    )
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _hash_code(c, h)
        else:
            h.update(digest(c, "a constant").encode())
    return names
