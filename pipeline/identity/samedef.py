"""Does the definition loaded in this process equal the one the parent built?

A fresh interpreter that computes for a pipeline (a filter or length scan
process, the fork server and workers, a Ray task) imports the transforms'
modules again and sees the values they set *at import*. Each such process
compares the definition it loaded (:func:`definition`: the pipeline's
description, transforms described afresh, the source's identity left out) with
the parent's (carried in the pickle, :func:`check_sent`; or sent with a job,
:func:`check`) and refuses to compute when they differ, naming the first
difference::

    filter[1] keep: global `mycfg.THR` is 0 here and 150000 in the parent: ...

Why, what it costs, and what is compared: ``docs/design/samedef.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import reprlib
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..core.errors import FingerprintError
from .fingerprint import Shown, describe_callable

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["IDENTITY", "SENT", "active", "definition", "sendable", "check", "check_sent", "first_difference"]

IDENTITY = "the source's identity (not compared)"
SENT = "_sent_definition"  # the key of the parent's definition in a pickled pipeline's state

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("quern_samedef_active", default=False)
_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()


def active() -> bool:
    """Whether a :func:`definition` is being computed in this thread.

    A pipeline's ``describe()`` then describes its transforms afresh (no cached
    description, digests as :class:`~quern.pipeline.identity.fingerprint.Shown`) and puts
    :data:`IDENTITY` for its source.

    Returns:
        ``True`` inside :func:`definition`.
    """
    return _ACTIVE.get()


@contextlib.contextmanager
def _definition_mode() -> Iterator[None]:
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _is_pipeline(obj: Any) -> bool:
    return callable(getattr(obj, "describe_until", None)) and hasattr(obj, "record_ops")


def definition(obj: Any, where: str = "transform") -> Any:
    """What is compared between this process and the parent.

    Args:
        obj: a pipeline, or a callable (``quern prepare``'s map).
        where: names a callable in errors.

    Returns:
        Plain data (picklable, JSON-able): a pipeline's description with its
        transforms described now and its source's identity replaced by
        :data:`IDENTITY`, or a callable's
        :func:`~quern.pipeline.identity.fingerprint.describe_callable` (with
        :class:`~quern.pipeline.identity.fingerprint.Shown` digests).

    Raises:
        FingerprintError: as ``describe()`` and ``describe_callable`` do.
    """
    if _is_pipeline(obj):
        with _definition_mode():
            return obj.describe()
    return describe_callable(obj, where, shown=True)


def sendable(pipe: Any) -> Any:
    """The definition to send with a pipeline; never raises.

    Args:
        pipe: the pipeline.

    Returns:
        :func:`definition` of ``pipe``, or ``None`` when it cannot be described
        (then nothing is compared: that pipeline has no fingerprint either).
    """
    try:
        return definition(pipe)
    except Exception:  # FingerprintError, or whatever a user's fingerprint() raises
        return None


def check_sent(pipe: Any, where: str) -> None:
    """:func:`check` an unpickled pipeline against the parent's definition it carries.

    Args:
        pipe: the pipeline as unpickled here (nothing to do when it carries no definition).
        where: names this process in the message (e.g. ``"a filter scan process"``).

    Raises:
        FingerprintError: as :func:`check`.
    """
    check(getattr(pipe, "__dict__", {}).get(SENT), pipe, where=where)


def check(expected: Any, obj: Any, *, where: str) -> None:
    """Refuse to compute with ``obj`` in this process if its :func:`definition` differs from the parent's.

    Args:
        expected: the parent's :func:`definition` of ``obj`` (``None``: not compared).
        obj: a pipeline or a callable, as loaded here.
        where: names this process in the message (e.g. ``"a filter scan process"``).

    Raises:
        FingerprintError: naming the first difference (which transform, which global,
            closure variable, default, attribute or argument, and its value here and in
            the parent) and saying how to make it the same everywhere.
    """
    if expected is None:
        return
    try:
        here = definition(obj, where)
    except FingerprintError as e:
        raise FingerprintError(
            f"{where}: the definition loaded here cannot be described, though the parent's could: {e}"
        ) from e
    diff = first_difference(expected, here)
    if diff is None:
        return
    raise FingerprintError(f"{where} loaded another definition than the parent process: {_message(obj, here, *diff)}")


def first_difference(a: Any, b: Any, *, path: tuple = ()) -> tuple[tuple, Any, Any] | None:
    """Where two descriptions first differ: dict keys in sorted order, list items in order.

    Leaves are equal when their JSON texts are.

    Args:
        a: a description.
        b: another.
        path: the path of ``a`` and ``b`` in the descriptions they belong to.

    Returns:
        ``(path, leaf of a, leaf of b)`` of the first leaf that differs (a
        missing leaf is a placeholder whose ``repr`` is ``<missing>``); ``None``
        if they are equal.

    Example:
        >>> first_difference({"a": [1, 2], "b": 3}, {"a": [1, 5], "b": 3})
        (('a', 1), 2, 5)
    """
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            found = first_difference(a.get(k, _MISSING), b.get(k, _MISSING), path=(*path, k))
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i in range(max(len(a), len(b))):
            found = first_difference(
                a[i] if i < len(a) else _MISSING, b[i] if i < len(b) else _MISSING, path=(*path, i)
            )
            if found is not None:
                return found
        return None
    return None if _text(a) == _text(b) else (path, a, b)


def _text(leaf: Any) -> str:
    if leaf is _MISSING:
        return "\0missing"
    try:
        return json.dumps(leaf, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError):
        return repr(leaf)


# --------------------------------------------------------------------------- saying what differs


def _message(obj: Any, tree: Any, path: tuple, there: Any, here: Any) -> str:
    """``label: what is X here and Y in the parent: advice`` for the first difference.

    The difference is at ``path`` in ``tree``, the definition here.
    """
    try:
        located = _locate(obj, path) if _is_pipeline(obj) else ("", obj, path)
    except Exception:
        located = None
    if located is None:  # not a transform: another part of the definition
        return f"{_path_text(path)} is {_leaf_text(here)} here and {_leaf_text(there)} in the parent"
    label, fn, rest = located
    try:
        thing, value, kind, module = _explain(fn, rest, _at(tree, path[: len(path) - len(rest)]))
    except Exception:
        thing, value, kind, module = f"{_path_text(rest)} of it", _MISSING, "", None
    head = f"{label}: " if label else ""
    if kind == "code":
        return (
            f"{head}{thing} differs here from the parent's: its module's source changed since the parent imported "
            "it, or the parent replaced the function at run time; restart the program, or pass the function as an "
            "argument (functools.partial, a dataclass field)"
        )
    shown_there = there.shown if isinstance(there, Shown) else _leaf_text(there)
    if here is _MISSING:
        what = f"{thing} is missing here and {shown_there} in the parent"
    elif there is _MISSING:
        what = f"{thing} is {_value_text(value, here)} here and missing in the parent"
    else:
        what = f"{thing} is {_value_text(value, here)} here and {shown_there} in the parent"
    imported = f"imports `{module}` again and so sees" if module else "imports the transform's module again and sees"
    return (
        f"{head}{what}: this process {imported} the values set at import, not a change made later; pass it as an "
        "argument (functools.partial, a dataclass field) or set it at import"
    )


def _value_text(value: Any, leaf: Any) -> str:
    if isinstance(leaf, Shown):
        return leaf.shown
    if value is not _MISSING and not callable(value):
        text = reprlib.repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return _leaf_text(leaf)


def _leaf_text(leaf: Any) -> str:
    if leaf is _MISSING:
        return "missing"
    if isinstance(leaf, Shown):
        return leaf.shown
    text = _text(leaf)
    return text if len(text) <= 80 else text[:77] + "..."


def _path_text(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "the definition"


def _locate(pipe: Pipeline, path: tuple) -> tuple[str, Any, tuple] | None:
    """The transform that ``path`` (in a pipeline's description) leads into.

    Returns ``(label, callable, the rest of the path in its description)``, or
    ``None`` if it leads elsewhere.
    """
    prefix: list[str] = []
    while path:
        key = path[0]
        if key in ("record_ops", "batch_ops") and len(path) >= 3 and path[2] == 1:
            k = path[1]
            op = getattr(pipe, key)[k]
            return " ".join([*prefix, op.label(k)]), op.fn, path[3:]
        inner = pipe.stream.locate(path)  # a path into a pipeline the stream is made of
        if inner is None:
            return None
        label, pipe, path = inner
        prefix.append(label)
    return None


def _name(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"functools.partial({_name(obj.func)}, ...)"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(name, str):
        module = getattr(obj, "__module__", None)
        return f"{module}.{name}" if isinstance(module, str) and module != "__main__" else name
    return f"a {type(obj).__qualname__} object"


def _at(tree: Any, path: tuple) -> Any:
    """The node of a description at ``path`` (``_MISSING`` if there is none)."""
    for key in path:
        try:
            tree = tree[key]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return tree


def _explain(fn: Any, rest: tuple, desc: Any) -> tuple[str, Any, str, str | None]:
    """Walk ``rest`` (a path in ``desc``, the description of ``fn``) through the live objects here.

    Returns ``(what it names, its value here or _MISSING, its kind, the module it lives in)``.
    """
    obj, thing, kind, module = fn, f"`{_name(fn)}`", "", getattr(fn, "__module__", None)
    i = 0
    while i < len(rest):
        key = rest[i]
        nxt = rest[i + 1] if i + 1 < len(rest) else None
        if isinstance(obj, types.FunctionType):
            qual = _name(obj)
            module = obj.__module__
            if key == "code" or key == "recursive":
                return f"the code of `{qual}`", _MISSING, "code", module
            if key == "globals" and nxt is not None:
                thing, kind = f"global `{obj.__module__}.{nxt}`", "global"
                obj, i = obj.__globals__.get(nxt, _MISSING), i + 2
                continue
            if key == "closure" and isinstance(nxt, int):
                names = obj.__code__.co_freevars
                thing, kind = f"closure variable `{names[nxt] if nxt < len(names) else nxt}` of `{qual}`", "closure"
                try:
                    obj = (obj.__closure__ or ())[nxt].cell_contents
                except (IndexError, ValueError):
                    obj = _MISSING
                i += 3  # [name, description]
                continue
            if key == "defaults" and isinstance(nxt, int):
                defaults = obj.__defaults__ or ()
                params = obj.__code__.co_varnames[: obj.__code__.co_argcount]
                at = len(params) - len(defaults) + nxt
                thing, kind = (
                    f"the default of argument `{params[at] if 0 <= at < len(params) else nxt}` of `{qual}`",
                    "default",
                )
                obj, i = defaults[nxt] if nxt < len(defaults) else _MISSING, i + 2
                continue
            if key == "kwdefaults" and nxt is not None:
                thing, kind = f"the default of argument `{nxt}` of `{qual}`", "default"
                obj, i = (obj.__kwdefaults__ or {}).get(nxt, _MISSING), i + 2
                continue
            if key == "attrs" and nxt is not None:
                thing, kind = f"attribute `{qual}.{nxt}`", "attribute"
                obj, i = vars(obj).get(nxt, _MISSING), i + 2
                continue
            break
        if isinstance(obj, functools.partial):
            if key == "partial":
                obj, i = obj.func, i + 1
                continue
            if key == "args" and isinstance(nxt, int):
                thing, kind = f"argument {nxt} of `{_name(obj)}`", "argument"
                obj, i = obj.args[nxt] if nxt < len(obj.args) else _MISSING, i + 2
                continue
            if key == "kwargs" and nxt is not None:
                thing, kind = f"argument `{nxt}` of `{_name(obj)}`", "argument"
                obj, i = obj.keywords.get(nxt, _MISSING), i + 2
                continue
            break
        if isinstance(obj, type):
            if key == "attrs" and nxt is not None:
                attr = vars(obj).get(nxt, _MISSING)
                if isinstance(attr, (staticmethod, classmethod)):
                    attr = attr.__func__
                if isinstance(attr, property):
                    attr = attr.fget
                thing, kind, module = f"class attribute `{obj.__qualname__}.{nxt}`", "attribute", obj.__module__
                obj, i = attr, i + 2
                continue
            if key == "bases" and isinstance(nxt, int):
                bases = [b for b in obj.__bases__ if b is not object]
                obj, i = bases[nxt] if nxt < len(bases) else _MISSING, i + 2
                continue
            break
        if key == "method" and isinstance(obj, types.MethodType):
            obj, i = obj.__func__, i + 1
            continue
        if key == "class" and obj is not _MISSING:
            owner = obj.__self__ if isinstance(obj, types.MethodType) else obj
            obj, i = type(owner), i + 1
            continue
        if key in ("self", "state") and nxt is not None and nxt != "reduce":
            owner = obj.__self__ if isinstance(obj, types.MethodType) else obj
            thing, kind, module = (
                f"attribute `{nxt}` of the {type(owner).__qualname__} object",
                "attribute",
                type(owner).__module__,
            )
            obj, i = getattr(owner, nxt, _MISSING), i + 2
            continue
        if key == "wrapped":
            obj, i = getattr(obj, "__wrapped__", _MISSING), i + 1
            continue
        if key in ("list", "tuple") and isinstance(nxt, int):
            thing = f"{thing}[{nxt}]"
            try:
                obj = obj[nxt]
            except Exception:
                obj = _MISSING
            i += 2
            continue
        if key == "dict" and isinstance(nxt, int) and i + 2 < len(rest) and rest[i + 2] == 1:
            shown = _at(desc, (*rest[:i], "dict", nxt, 0))  # the item's key, as described
            if not isinstance(shown, Shown):
                return f"an item of {thing}", _MISSING, kind, module
            thing = f"{thing}[{shown.shown}]"
            keys = [k for k in obj if reprlib.repr(k) == shown.shown] if isinstance(obj, dict) else []
            obj, i = obj[keys[0]] if len(keys) == 1 else _MISSING, i + 3
            continue
        if key in ("dict", "set"):
            return f"an item of {thing}", _MISSING, kind, module
        if key == "fingerprint":
            return f"what {thing}.fingerprint() returns", _MISSING, "fingerprint", module
        break
    if i < len(rest):
        thing = f"{thing} ({_path_text(rest[i:])})"
    return thing, obj, kind, module
