"""The public API's shape: options keyword-only, the iterator's options declared once, errors at the top."""

from __future__ import annotations

import inspect
import typing

import quern
from quern.pipeline.core import errors
from quern.pipeline.iterate.iterator import IteratorOptions, PipelineIterator

# the addressing calls of the design's contract stay positional: (step, process_index, process_count)
ADDRESSING = {"batch_at", "batches_at", "explain", "positions", "row_digests"}


def _public_callables():
    """(name, callable) of every public function of the top level and method of its public classes."""
    for name in quern.__all__:
        obj = getattr(quern, name)
        if inspect.isclass(obj):
            for m, fn in vars(obj).items():
                if not m.startswith("_") and inspect.isfunction(fn):
                    yield f"{name}.{m}", fn
        elif inspect.isfunction(obj):
            yield name, obj


def test_options_are_keyword_only():
    """A public function or method with more than two parameters takes the rest as keyword-only."""
    loose = []
    for name, fn in _public_callables():
        if name.split(".")[-1] in ADDRESSING:
            continue
        params = [p for p in inspect.signature(inspect.unwrap(fn)).parameters.values() if p.name not in ("self", "cls")]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) > 2 and len(positional) > 2:
            loose.append(f"{name}{inspect.signature(fn)}")
    assert not loose, loose


def test_the_iterator_options_are_declared_once():
    """``IteratorOptions`` (the typed ``**options`` of ``Pipeline.iterator`` and ``resume``) names exactly the
    keyword-only parameters of ``PipelineIterator``, and neither Pipeline method repeats them."""
    sig = inspect.signature(PipelineIterator.__init__)
    keyword = [n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert list(typing.get_type_hints(IteratorOptions)) == keyword
    for method in (quern.Pipeline.iterator, quern.Pipeline.resume):
        kinds = [p.kind for p in inspect.signature(method).parameters.values()]
        assert inspect.Parameter.VAR_KEYWORD in kinds and inspect.Parameter.KEYWORD_ONLY not in kinds


def test_every_error_class_is_at_the_top_level():
    public = set(errors.__all__)  # RecordError is internal to quern prepare (raised as a PrepareError)
    names = [
        n for n, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, BaseException) and n in public
    ]
    missing = [n for n in names if getattr(quern, n, None) is not vars(errors)[n] or n not in quern.__all__]
    assert names and not missing, missing
