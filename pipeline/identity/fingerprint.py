"""What changes the bytes of a batch, described and hashed.

:func:`describe_callable` turns a transform into a JSON-able description that
depends only on what it computes (a function by its code, defaults, closure and
the module values it reads; a ``functools.partial``, a bound method, a callable
object by their parts and state; quern's own registered transforms by name,
``VERSION`` and arguments). :func:`fingerprint_of` hashes a pipeline description
into the 32-hex-digit fingerprint. A value it cannot describe by content raises
:class:`~quern.pipeline.core.errors.FingerprintError`; so does a read the description
cannot see (the environment, ``globals()``). What is described, and the
documented limits: ``docs/design/fingerprint.md``.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import inspect
import json
import os
import reprlib
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..core.errors import FingerprintError
from ..core.registry import builtin_name
from .hashing import HOW_TO_DECLARE, digest

__all__ = ["describe_callable", "describe_value", "fingerprint_of", "tokenizer_model", "Shown"]

_MAX_DEPTH = 200


def fingerprint_of(description: dict[str, Any]) -> str:
    """The 32-hex-digit fingerprint of a JSON-able description.

    Args:
        description: plain data (dicts, lists, strings, numbers); dict order does
            not matter (keys are sorted).

    Returns:
        The first 32 hex digits of the SHA-256 of its JSON text: it depends only
        on the description's content.

    Raises:
        FingerprintError: ``description`` holds a value JSON cannot hold.

    Example:
        >>> fingerprint_of({"a": 1, "b": 2}) == fingerprint_of({"b": 2, "a": 1})
        True
    """
    try:
        text = json.dumps(description, sort_keys=True, allow_nan=True)
    except TypeError as e:  # a source identity with a value JSON cannot hold: never hashed by its repr
        raise FingerprintError(f"the pipeline description is not plain data: {e}") from e
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe_callable(fn: Any, where: str = "transform", *, shown: bool = False) -> Any:
    """A JSON-able description of what ``fn`` computes.

    It depends only on ``fn``'s code, arguments and the values it reads, the same
    in every process (see ``docs/design/fingerprint.md`` for each kind of callable).

    Args:
        fn: the transform.
        where: names ``fn`` in errors (e.g. ``"map[0] double"``).
        shown: make each value's digest a :class:`Shown`, which also keeps a short
            text of the value (for messages that say what differs; equal
            descriptions stay equal).

    Returns:
        Plain data (dicts, lists, strings).

    Raises:
        FingerprintError: ``fn`` reads a value that cannot be described by its
            content, or reads the environment or ``globals()``; the message names
            the transform and the value.

    Example:
        >>> describe_callable(len)
        'builtin builtins.len'
    """
    return _Describer(where, shown).callable(fn, 0)


def describe_value(value: Any, where: str = "value") -> Any:
    """A JSON-able description of a value a transform reads.

    Args:
        value: the value: functions and classes are described by their code,
            modules by name, containers item by item, anything else by content
            (:func:`~quern.pipeline.identity.hashing.digest`).
        where: names the value in errors.

    Returns:
        Plain data that depends only on the value's content.

    Raises:
        FingerprintError: the value cannot be described by its content.
    """
    return _Describer(where).value(value, where, 0)


class Shown(str):
    """A digest that also keeps, in ``shown``, a short text of its value, for messages.

    It compares, hashes and serialises as the digest's text.
    """

    shown: str = ""


def _shown(d: str, value: Any) -> Shown:
    out = Shown(d)
    try:
        text = reprlib.repr(value)
    except Exception:
        text = f"a {type(value).__qualname__}"
    out.shown = text if len(text) <= 80 else text[:77] + "..."
    return out


class _Describer:
    """Describes a callable and what it reads.

    ``seen`` breaks cycles (recursive functions, self-referencing containers).
    ``depth`` counts nesting, bounded by :data:`_MAX_DEPTH`. ``shown``: digests
    are :class:`Shown` (see :func:`describe_callable`).
    """

    def __init__(self, where: str, shown: bool = False) -> None:
        self.where = where
        self.shown = shown
        self.seen: dict[int, str] = {}
        self.active: set[int] = set()  # containers being described (a cycle is an error)

    def cannot(self, value: Any, where: str) -> FingerprintError:
        return FingerprintError(
            f"{self.where} reads {where}, a {type(value).__module__}.{type(value).__qualname__}, which quern "
            f"cannot describe by its content; {HOW_TO_DECLARE}"
        )

    def value(self, value: Any, where: str, depth: int) -> Any:
        """A value a transform reads, described.

        Containers element by element (so functions and classes inside them are
        described too), callables by code, the rest by content.
        """
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
        model = tokenizer_model(value)
        if model is not None:  # a tokenizer: by its serialized model, not by its (library) object
            return model
        try:
            d = digest(value, where)
        except FingerprintError:
            if callable(value):
                return self.callable(value, depth + 1)
            raise self.cannot(value, where) from None
        return _shown(d, value) if self.shown else d

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
        builtin = builtin_name(fn)
        if builtin is not None:  # quern's own transform: by name, version and arguments, not by its code
            return {"transform": builtin, "version": type(fn).VERSION, "args": self.state(fn, depth + 1)}
        fp = getattr(fn, "fingerprint", None)
        if callable(fp) and not isinstance(fn, type):
            d = digest(fn, self.where)
            return {"fingerprint": _shown(d, fn) if self.shown else d}
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

    def function(self, fn: types.FunctionType, depth: int, runs_later: bool = True) -> Any:
        """A user function by its code and what it reads.

        ``runs_later=False``: a method that builds an object (``__init__``, a
        classmethod), whose reads end up in the object's state (described): it
        may read the environment.
        """
        if not _is_user_module(getattr(fn, "__module__", None) or ""):
            return f"function {fn.__module__}.{fn.__qualname__}"  # the standard library's, numpy's...: by name
        key = id(fn)
        if key in self.seen:  # recursion: the description is being built further up
            return {"recursive": self.seen[key]}
        if runs_later:
            _refuse_hidden_reads(fn, self.where)
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
        out: dict[str, Any] = {
            "code": code,
            "globals": used,
            "closure": closure,
            "defaults": defaults,
            "kwdefaults": kwdefaults,
        }
        attrs = {k: v for k, v in vars(fn).items() if not (k.startswith("__") and k.endswith("__"))}
        if attrs:  # keep.threshold = 5: state its code may read (only then a key: other descriptions stay as they were)
            out["attrs"] = {
                k: self.value(v, f"attribute {fn.__qualname__}.{k}", depth + 1) for k, v in sorted(attrs.items())
            }
        return out

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
            builds = name in _BUILDERS or isinstance(attr, classmethod)
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, property):
                attr = attr.fget
            if isinstance(attr, types.FunctionType):
                attrs[name] = self.function(attr, depth + 1, runs_later=not builds)
            elif (name.startswith("__") and name.endswith("__")) or name.startswith("_abc_"):
                continue  # __dict__, __doc__, __module__, dataclass fields, ABC caches: not behaviour
            elif hasattr(type(attr), "__get__") and not callable(attr):
                attrs[name] = f"descriptor {type(attr).__qualname__}"  # slots, namedtuple fields: plumbing
            else:
                attrs[name] = self.value(attr, f"{cls.__qualname__}.{name}", depth + 1)
        bases = [self.cls(b, depth + 1) for b in cls.__bases__ if b is not object]
        return {"class": cls.__qualname__, "bases": bases, "attrs": attrs}

    def state(self, obj: Any, depth: int) -> Any:
        """An object's state: ``vars()`` and slots, each value described by content.

        For an object with neither (``operator.itemgetter('x')``, say): what it pickles to.
        """
        if isinstance(obj, type) or inspect.ismodule(obj):
            return self.value(obj, "self", depth)
        model = tokenizer_model(obj)
        if model is not None:  # tok.encode of a tokenizer: the tokenizer's model
            return model
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


def tokenizer_model(value: Any) -> dict[str, Any] | None:
    """A tokenizer of the field described by its own serialized model, or ``None`` for anything else.

    ``tokenizers.Tokenizer`` by its JSON (``to_str()``: vocabulary, merges, normalizer,
    pre-tokenizer, post-processor with its BOS/EOS template, truncation and padding);
    a ``transformers`` fast tokenizer by its backend's JSON, its special tokens and
    its padding and truncation sides and maximum length; a ``sentencepiece``
    ``SentencePieceProcessor`` by its serialized model proto. Each as a SHA-256, so
    a change of vocabulary or settings changes the fingerprint and nothing else is
    needed (no ``fingerprint()`` method).

    Args:
        value: any object.

    Returns:
        ``{"tokenizer": kind, "model": sha256 hex, ...}``, or ``None``.
    """
    module = type(value).__module__ or ""
    root = module.split(".")[0]
    if root == "tokenizers" and callable(getattr(value, "to_str", None)):
        return {"tokenizer": "tokenizers.Tokenizer", "model": _sha(value.to_str().encode())}
    if root == "sentencepiece" and callable(getattr(value, "serialized_model_proto", None)):
        return {"tokenizer": "sentencepiece.SentencePieceProcessor", "model": _sha(value.serialized_model_proto())}
    backend = getattr(value, "backend_tokenizer", None) if root == "transformers" else None
    if backend is not None and callable(getattr(backend, "to_str", None)):
        settings = {k: getattr(value, k, None) for k in ("padding_side", "truncation_side", "model_max_length")}
        special = getattr(value, "special_tokens_map", {})
        extra = json.dumps([settings, special], sort_keys=True, default=str).encode()
        return {
            "tokenizer": f"transformers.{type(value).__qualname__}",
            "model": _sha(backend.to_str().encode()),
            "settings": _sha(extra),
        }
    return None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    """Whether functions and classes of ``module`` are described by their code, not by name.

    By code: user code. By name: the standard library, the libraries above (their
    code is theirs, and upgrading them is not a change of definition) and quern's
    own modules, whose outputs are versioned instead (the index-format version in
    every description, a registered transform's ``VERSION``): an edit of a quern
    docstring or a refactor changes no fingerprint.
    """
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in _LIBRARY_ROOTS and top != _PACKAGE


_PACKAGE = __name__.split(".")[0]  # quern

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


def _hash_code(code: types.CodeType, h: Any, where: str) -> set[str]:
    """Feed a code object (bytecode, constants by content, names, nested code) into ``h``.

    Returns the global names it and its nested code read (not attribute names).
    Names and line numbers of the function itself are not included.
    """
    h.update(code.co_code)
    h.update(
        json.dumps([code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, code.co_flags]).encode()
    )
    names = set(_scan_code(code).names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _hash_code(c, h, where)
        else:
            h.update(digest(c, f"{where}: a constant of its code").encode())
    return names


_BUILDERS = frozenset({"__init__", "__new__", "__post_init__", "__init_subclass__"})  # what they read is state
_ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb"})
_LOOKUP_BUILTINS = ("globals", "vars")
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_LOAD_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


class _CodeFacts(NamedTuple):
    names: frozenset[str]  # the global names it reads or writes (not attribute names)
    loads: frozenset[tuple[str, str | None]]  # (global name loaded, the attribute read from it next, if any)
    imports_env: bool  # an ``import os`` with an environment name among its attribute names


@functools.lru_cache(maxsize=8192)
def _scan_code(code: types.CodeType) -> _CodeFacts:
    """What the fingerprint needs from one code object's instructions (not its nested code's).

    Computed once per code: disassembling is most of what describing costs.
    """
    ins = list(dis.get_instructions(code))
    names = frozenset(x.argval for x in ins if x.opname in _GLOBAL_OPS)
    loads = frozenset(
        (x.argval, ins[i + 1].argval if i + 1 < len(ins) and ins[i + 1].opname in _ATTR_OPS else None)
        for i, x in enumerate(ins)
        if x.opname in _LOAD_OPS
    )
    imports_os = any(x.opname == "IMPORT_NAME" and x.argval == "os" for x in ins)
    return _CodeFacts(names, loads, imports_os and bool(_ENV_NAMES & set(code.co_names)))


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions, lambdas and comprehensions nested in it."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _refuse_hidden_reads(fn: types.FunctionType, where: str) -> None:
    """Raise :class:`FingerprintError` if ``fn``'s code reads values its description cannot see.

    Those are the environment, and names looked up at run time (``globals()``, ``vars()``).
    """
    glb = fn.__globals__
    env_values = [os.environ, os.getenv, getattr(os, "environb", None), getattr(os, "getenvb", None)]
    for code in _codes(fn.__code__):
        facts = _scan_code(code)
        if facts.imports_env:
            raise _env_error(fn, where)
        for name, attr in facts.loads:
            if name in _LOOKUP_BUILTINS and name not in glb:
                raise FingerprintError(
                    f"{where}: {fn.__qualname__} calls {name}(), which looks values up by a name computed at "
                    "run time: the fingerprint cannot see what it reads (and another process would read "
                    "another value); pass the value to the transform as an argument (functools.partial, a "
                    "dataclass field) instead"
                )
            value = glb.get(name)
            if any(value is v for v in env_values if v is not None) or (value is os and attr in _ENV_NAMES):
                raise _env_error(fn, where)


def _env_error(fn: types.FunctionType, where: str) -> FingerprintError:
    return FingerprintError(
        f"{where}: {fn.__qualname__} reads the environment (os.environ): the fingerprint cannot see the value "
        "it reads, so a cached filter, a resumed run or a worker process would silently use another one; "
        "pass the value to the transform as an argument (functools.partial, a dataclass field) instead"
    )
