"""Bounds on what a config file can make quern do: its size, values and nesting, and its messages' size.

What a config file can make quern do is bounded: a file is at most
:data:`MAX_BYTES` (1 MiB); its values, counted with YAML aliases and merge keys
expanded (``&a``/``*a``, ``<<:``), at most :data:`MAX_VALUES` (100,000), nested
at most :data:`MAX_DEPTH` (64) levels, without an alias that contains itself;
these are checked on YAML's node graph before any Python object is built (a
466-byte "billion laughs" fails at once, naming the limit), and on dicts. A
section has at most :data:`MAX_KEYS` keys and ``transforms``/
``batch_transforms`` at most :data:`MAX_STAGES` entries, a mixture at most
:data:`MAX_COMPONENTS` components and :data:`MAX_SCHEDULE` schedule stages, and a list of paths or
columns, or a ``kwargs``/``spec`` mapping, is reported by its first bad item:
the number of problems is bounded before pydantic looks. Messages quote a value
in at most :data:`MAX_SHOWN` characters, and list at most :data:`MAX_PROBLEMS`
problems of at most :data:`MAX_LINE` characters each.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Callable, Iterable
from typing import Any

import yaml

from ..core.errors import ConfigError

__all__ = [
    "MAX_BYTES",
    "MAX_VALUES",
    "MAX_DEPTH",
    "MAX_KEYS",
    "MAX_STAGES",
    "MAX_SHOWN",
    "MAX_PROBLEMS",
    "MAX_LINE",
    "clip",
    "show",
    "bounded",
    "measure",
    "node_children",
    "object_children",
    "Loader",
    "LOADER",
]

MAX_BYTES = 1 << 20
"""The largest config file read, in bytes."""
MAX_VALUES = 100_000
"""The most values (scalars, lists and mappings) a config holds, YAML aliases and merge keys expanded."""
MAX_DEPTH = 64
"""The deepest nesting of lists and mappings in a config."""
_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep (the limit is {MAX_DEPTH})"  # measure's and the loaders'
MAX_KEYS = 16
"""The most keys of one section (``source``, ``batch``, a transform...: none has more than 6)."""
MAX_STAGES = 256
"""The most entries of ``transforms`` and of ``batch_transforms``."""
MAX_COMPONENTS = MAX_STAGES
"""The most components of a mixture (``mix.components``)."""
MAX_SCHEDULE = 4096
"""The most stages of a mixture's schedule (``mix.schedule``)."""
MAX_SHOWN = 200
"""The most characters a message quotes of one value."""
MAX_PROBLEMS = 20
"""The most problems one message lists."""
MAX_LINE = 500
"""The most characters of one line of a message."""

# --------------------------------------------------------------------------- bounded messages

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_SHOWN
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8


def clip(text: str, limit: int = MAX_LINE) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out.

    Args:
        text: A message, or a part of one.
        limit: The most characters kept.

    Returns:
        ``text`` itself when it fits.

    Example:
        >>> clip("abcdefgh", 3)
        'abc... (5 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def show(value: Any) -> str:
    """``repr(value)`` in at most about :data:`MAX_SHOWN` characters, in time bounded by that too.

    Containers are shown with ``reprlib`` (not ``repr(value)[:n]``, which would build all of it).

    Args:
        value: Any value a config holds.

    Returns:
        Its short ``repr`` (``<type>`` when even that fails).

    Example:
        >>> show(list(range(100)))
        '[0, 1, 2, 3, 4, 5, 6, 7, ...]'
    """
    try:
        text = _REPR.repr(value)
    except Exception:  # an int past Python's digit limit, a __repr__ that raises
        text = f"<{type(value).__name__}>"
    return clip(text, MAX_SHOWN)


def bounded(message: str) -> str:
    """``message`` with at most :data:`MAX_PROBLEMS` lines after the first, each at most :data:`MAX_LINE` long.

    Args:
        message: A message, its first line a header and each other line one problem.

    Returns:
        The message, saying how many lines were left out.
    """
    lines = message.split("\n")
    more = len(lines) - 1 - MAX_PROBLEMS
    lines = [clip(line, MAX_LINE) for line in lines[: MAX_PROBLEMS + 1]]
    return "\n".join(lines + ([f"  ... and {more} more"] if more > 0 else []))


# --------------------------------------------------------------------------- bounded inputs


def measure(root: Any, children: Callable[[Any], Iterable[Any] | None], *, what: str) -> None:
    """Check that the tree ``root`` is within :data:`MAX_VALUES` values and :data:`MAX_DEPTH` levels.

    ``root`` is a graph whose shared parts (YAML aliases) count once per use.
    Memoised per node: the time is proportional to the distinct nodes, whatever
    they expand to.

    Args:
        root: A YAML node or a Python object.
        children: The children of a container, ``None`` for a leaf
            (:func:`node_children`, :func:`object_children`).
        what: The tree, as messages name it ("the document").

    Raises:
        ConfigError: It holds more than :data:`MAX_VALUES` values, is nested deeper
            than :data:`MAX_DEPTH`, or contains itself.

    Example:
        >>> measure({"a": [1, 2, 3]}, object_children, what="the config")
        >>> nested = []
        >>> for _ in range(100):
        ...     nested = [nested]
        >>> try:
        ...     measure(nested, object_children, what="the config")
        ... except ConfigError as e:
        ...     print(e)
        nested more than 64 levels deep (the limit is 64)
    """
    memo: dict[int, tuple[int, int]] = {}  # id -> (values, height)
    active: set[int] = set()

    def visit(node: Any, depth: int) -> tuple[int, int]:
        kids = children(node)
        if kids is None:
            return 1, 0
        key = id(node)
        if key not in memo:
            if key in active:
                raise ConfigError(f"{what} contains itself (an alias or reference inside its own value)")
            if depth >= MAX_DEPTH:
                raise ConfigError(_TOO_DEEP)
            active.add(key)
            size, height = 1, 1
            for kid in kids:
                n, h = visit(kid, depth + 1)
                size, height = size + n, max(height, h + 1)
                if size > MAX_VALUES:
                    raise ConfigError(
                        f"{what} holds more than {MAX_VALUES:,} values (the limit), "
                        "counting each use of an alias (or shared object) in full"
                    )
            active.discard(key)
            memo[key] = size, height
        size, height = memo[key]
        if depth + height > MAX_DEPTH:
            raise ConfigError(_TOO_DEEP)
        return size, height

    visit(root, 0)


def node_children(node: Any) -> Iterable[Any] | None:
    """The children of a YAML node, for :func:`measure`.

    Args:
        node: A composed YAML node.

    Returns:
        A sequence's items, a mapping's keys and values (in turn), or ``None`` for a scalar.
    """
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return itertools.chain.from_iterable(node.value)
    return None


def object_children(value: Any) -> Iterable[Any] | None:
    """The children of a Python value, for :func:`measure`.

    Args:
        value: A value of a config.

    Returns:
        A dict's keys then values, a list's or tuple's items, or ``None`` for anything else.
    """
    if isinstance(value, dict):
        return itertools.chain(value.keys(), value.values())
    if isinstance(value, list | tuple):
        return value
    return None


class _Limited:
    """The limits of this module in a YAML loader whose composer is PyYAML's Python one.

    Nesting is checked while the document is composed (recursively, so before
    Python's recursion limit), and the size with aliases expanded on the composed
    node graph, before any object is constructed (constructing merge keys would
    copy what they expand to).
    """

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose one node, refusing one nested deeper than :data:`MAX_DEPTH`.

        Args:
            parent: As ``yaml.composer.Composer.compose_node``.
            index: As ``yaml.composer.Composer.compose_node``.

        Returns:
            The node.

        Raises:
            ConfigError: The document is nested too deep.
        """
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:
                raise ConfigError(_TOO_DEEP)
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        """The document's value, built once its node graph is within the limits (:func:`measure`).

        Returns:
            The value (``None`` for an empty document).

        Raises:
            ConfigError: The document is over a limit.
        """
        try:
            node = self.get_single_node()  # type: ignore[attr-defined]
        except yaml.YAMLError as e:  # libyaml's own bound (1,000 levels), met while it scans ahead
            if getattr(e, "problem", None) == "exceeded maximum nesting depth":
                raise ConfigError(_TOO_DEEP) from None
            raise
        if node is None:
            return None
        measure(node, node_children, what="the document")
        return self.construct_document(node)  # type: ignore[attr-defined]


class Loader(_Limited, yaml.SafeLoader):
    """YAML's safe loader with the limits of this module, in Python.

    :data:`LOADER` is the one configs are read with: this one's limits, composer, constructor
    and resolver over libyaml's scanner and parser where PyYAML has them (about 5x faster on a
    large file), else this one. The two give the same values for what both accept; libyaml
    also takes a tab as the space after a colon or comma, refuses directives other
    than ``%YAML`` and ``%TAG``, and words its syntax errors more briefly (the message shows
    the line and a caret for both: :func:`quern.pipeline.config.load._yaml_error`).

    Args:
        stream: The YAML text (or a file).

    Example:
        >>> yaml.load("batch: 8", Loader=Loader)
        {'batch': 8}
    """


def _libyaml_loader() -> type | None:
    """PyYAML's ``CSafeLoader`` (libyaml's parser, the safe constructor, the resolver) under :class:`Loader`'s limits and composer.

    ``None`` where PyYAML was built without libyaml.
    """
    if not yaml.__with_libyaml__:  # pragma: no cover - PyYAML built without libyaml
        return None

    class CLoader(_Limited, yaml.composer.Composer, yaml.CSafeLoader):
        def __init__(self, stream: Any) -> None:
            yaml.CSafeLoader.__init__(self, stream)
            yaml.composer.Composer.__init__(self)

    return CLoader


LOADER: type = _libyaml_loader() or Loader
"""The YAML loader configs are read with (see :class:`Loader`)."""
