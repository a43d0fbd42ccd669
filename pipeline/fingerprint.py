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

import dis
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

_MAX_DEPTH = 200


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
    """Describes a callable and what it reads; ``seen`` breaks cycles (recursive functions,
    self-referencing containers). ``depth`` counts nesting, bounded by :data:`_MAX_DEPTH`."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: dict[int, str] = {}
        self.active: set[int] = set()  # containers being described (a cycle is an error)

    def cannot(self, value: Any, where: str) -> FingerprintError:
        return FingerprintError(
            f"{self.where} reads {where}, a {type(value).__module__}.{type(value).__qualname__}, which quern "
            f"cannot describe by its content; {HOW_TO_DECLARE}"
        )

    def value(self, value: Any, where: str, depth: int) -> Any:
        """A value a transform reads: containers element by element (so functions and
        classes inside them are described too), callables by code, the rest by content."""
        if depth > _MAX_DEPTH:
            raise FingerprintError(f"{self.where}: {where} is nested more than {_MAX_DEPTH} levels deep")
        if inspect.ismodule(value):
            return f"module {value.__name__}"
        if isinstance(value, type):
            return self.cls(value, depth + 1)
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            if id(value) in self.active:
                raise FingerprintError(f"{self.where} reads {where}, which contains itself")
            self.active.add(id(value))
            try:
                return self.container(value, where, depth)
            finally:
                self.active.discard(id(value))
        try:
            return digest(value, where)
        except FingerprintError:
            if callable(value):
                return self.callable(value, depth + 1)
            raise self.cannot(value, where) from None

    def container(self, value: Any, where: str, depth: int) -> Any:
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [self.value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, dict):
            items = [
                [self.value(k, f"{where} key {k!r}", depth + 1), self.value(v, f"{where}[{k!r}]", depth + 1)]
                for k, v in value.items()
            ]
            return {"dict": sorted(items, key=lambda kv: json.dumps(kv, sort_keys=True))}
        described = [self.value(v, f"{where} item", depth + 1) for v in value]
        return {"set": sorted(described, key=lambda d: json.dumps(d, sort_keys=True))}

    def callable(self, fn: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise FingerprintError(f"{self.where}: functions nested more than {_MAX_DEPTH} levels deep")
        fp = getattr(fn, "fingerprint", None)
        if callable(fp) and not isinstance(fn, type):
            return {"fingerprint": digest(fn, self.where)}
        if isinstance(fn, functools.partial):
            return {
                "partial": self.callable(fn.func, depth + 1),
                "args": [self.value(a, f"argument {i}", depth + 1) for i, a in enumerate(fn.args)],
                "kwargs": {k: self.value(v, f"argument {k!r}", depth + 1) for k, v in sorted(fn.keywords.items())},
            }
        if isinstance(fn, types.MethodType):
            return {
                "method": self.callable(fn.__func__, depth + 1),
                "class": self.cls(type(fn.__self__), depth + 1),
                "self": self.state(fn.__self__, depth + 1),
            }
        if isinstance(fn, types.FunctionType):
            return self.function(fn, depth)
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None and callable(wrapped) and not isinstance(fn, type):
            # jax.jit, functools.lru_cache, ...: a library wrapper computes what the function does
            return {"wrapper": _qualified(type(fn)), "wrapped": self.callable(wrapped, depth + 1)}
        if isinstance(fn, type):
            return self.cls(fn, depth)
        if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)) or type(fn).__name__ == "ufunc":
            owner = getattr(fn, "__self__", None)
            if owner is not None and not inspect.ismodule(owner):  # a method of an object: its state matters
                return {"builtin": fn.__qualname__, "self": self.value(owner, f"{fn.__qualname__}.__self__", depth + 1)}
            return f"builtin {getattr(fn, '__module__', None) or ''}.{fn.__name__}"
        if callable(fn):  # an instance of a class with __call__
            return {"class": self.cls(type(fn), depth + 1), "state": self.state(fn, depth + 1)}
        raise FingerprintError(f"{self.where}: {fn!r} is not callable")

    def function(self, fn: types.FunctionType, depth: int) -> Any:
        if not _is_user_module(getattr(fn, "__module__", None) or ""):
            return f"function {fn.__module__}.{fn.__qualname__}"  # the standard library's, numpy's...: by name
        key = id(fn)
        if key in self.seen:  # recursion: the description is being built further up
            return {"recursive": self.seen[key]}
        h = hashlib.blake2b(digest_size=16)
        names = _hash_code(fn.__code__, h, self.where)
        code = h.hexdigest()
        self.seen[key] = code
        glb = fn.__globals__
        used = {n: self.value(glb[n], f"global {n!r}", depth + 1) for n in sorted(names) if n in glb}
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
        if not _is_user_module(getattr(cls, "__module__", "") or ""):
            return f"class {_qualified(cls)}"
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
        """An object's state: ``vars()`` and slots, each value described by content; for an
        object with neither (``operator.itemgetter('x')``, say), what it pickles to."""
        if isinstance(obj, type) or inspect.ismodule(obj):
            return self.value(obj, "self", depth)
        names = _state_names(obj)
        if not names:
            try:
                reduced = obj.__reduce_ex__(4)
            except Exception:
                raise self.cannot(obj, "an object") from None
            if isinstance(reduced, tuple) and len(reduced) >= 2:
                return {
                    "reduce": [self.value(part, f"{type(obj).__qualname__} state", depth + 1) for part in reduced[1:3]]
                }
            raise self.cannot(obj, "an object")
        fields: dict[str, Any] = {}
        for name in sorted(names):
            try:
                v = getattr(obj, name)
            except AttributeError:
                continue
            fields[name] = self.value(v, f"{type(obj).__qualname__}.{name}", depth + 1)
        return fields


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


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
        "numpy", "jax", "jaxlib", "pyarrow", "tensorstore", "array_record", "grain", "pydantic", "yaml",
        "cloudpickle", "orbax", "scipy", "pandas", "ml_dtypes", "optax", "flax", "torch", "tensorflow",
    }
)  # fmt: skip


def _is_user_module(module: str) -> bool:
    """Whether functions and classes of ``module`` are described by their code (user code,
    quern's own transforms) rather than by name (the standard library and the libraries
    above: their code is theirs, and upgrading them is not a change of definition)."""
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in _LIBRARY_ROOTS


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


def _hash_code(code: types.CodeType, h: Any, where: str) -> set[str]:
    """Feed a code object (bytecode, constants by content, names, nested code) into ``h``;
    return the global names it and its nested code read (not attribute names). Names
    and line numbers of the function itself are not included."""
    h.update(code.co_code)
    h.update(
        json.dumps([code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, code.co_flags]).encode()
    )
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_OPS}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _hash_code(c, h, where)
        else:
            h.update(digest(c, f"{where}: a constant of its code").encode())
    return names
