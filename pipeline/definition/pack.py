"""``Pipeline.pack``: documents into rows of ``seq_len`` tokens.

The method and its arguments; the stream is :mod:`quern.pipeline.streams.packed`, the
plan :mod:`quern.pipeline.order.packing`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..core.batching import need_no_batch
from ..core.deprecation import renamed
from ..identity.hashing import digest
from ..order import index as _index
from ..order import packing as _packing
from ..streams.capabilities import SingleSource, require
from ..streams.packed import PackedStream
from . import scan
from .identify import records_key
from .lazy_lengths import LazyLengths

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = ["pack", "packed_stream"]


@renamed(workers="num_workers")
def pack(  # noqa: D417  (a method of Pipeline: self is the pipeline)
    self: Pipeline,
    seq_len: int | Mapping[str, int],
    mode: Literal["best_fit", "concat", "first_fit"] = "best_fit",
    *,
    key: str | None = None,
    num_bins: int | None = None,
    max_sequences_per_bin: int | None = None,
    pad_value: Any = 0,
    lengths: Any = None,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> Pipeline:
    """Pack the records into rows of ``seq_len`` tokens.

    The rows are ``{"tokens", "segment_ids", "positions"}`` (shape ``(seq_len,)``;
    tokens keep the records' dtype, the other two are int32), plus packed copies
    of a dict record's other per-token arrays. ``segment_ids`` number a row's pieces
    1..k, 0 marks padding (the tokens there are ``pad_value``). The modes:

    - ``best_fit`` places whole documents (best-fit decreasing over each epoch; a
      document longer than ``seq_len`` is cut into rows), and an epoch's rows come in
      a keyed random order; ``positions`` restart at 0 per piece.
    - ``concat`` concatenates the documents in stream order and cuts rows;
      ``positions`` count from the piece's offset in its document.
    - ``first_fit`` places whole documents in stream order, each into the first of
      ``num_bins`` rows with room (and fewer than ``max_sequences_per_bin`` documents,
      a cap ``best_fit`` takes too),
      and emits the ``num_bins`` rows when one does not fit: grain's
      ``FirstFitPackIterDataset(shuffle_bins=False)`` row for row, each epoch on its own.
      It never cuts a document: one longer than its row is an error naming it
      (truncate or :meth:`~quern.pipeline.definition.dataset.Pipeline.flat_map` first). ``positions`` restart at 0 per document.

    Several columns: ``seq_len={"inputs": 512, "targets": 512}`` packs the columns of
    a dict record together (a document goes into a row where each of its columns
    has room) into ``KEY``, ``KEY_segment_ids`` and ``KEY_positions`` per column
    (grain's names), padded with ``pad_value`` (one number or one per column); the
    others are dropped. ``best_fit`` and ``concat`` cut the columns together, so
    they need one row length and columns of one length per record (an error names
    the column, the record and both lengths); ``first_fit`` takes each its own.

    The plan is index arithmetic over the documents' lengths and reads nothing
    (:mod:`quern.pipeline.order.packing`). ``best_fit`` plans a whole epoch at once from
    the :meth:`~quern.pipeline.definition.dataset.Pipeline.length_index` (one per column;
    a scan before the first batch unless cached). ``first_fit`` and ``concat`` place a
    document after the ones before it only, so they use the index when one is given
    (``lengths=``, or a prepared folder's ``length``) and otherwise measure documents as
    the plan reaches them, cached by chunk of records: no pass over the data before the
    first batch, and a resume at step ``k`` measures the documents up to ``k``'s rows
    once. Their fingerprint names the records measured, not how their lengths were found.

    Args:
        seq_len: tokens per row, or a dict of tokens per row of each column.
        mode: ``"best_fit"``, ``"concat"`` or ``"first_fit"``.
        key: the field of a dict record holding its tokens (one column).
        num_bins: ``first_fit``'s rows per packing batch (required there).
        max_sequences_per_bin: ``first_fit``'s and ``best_fit``'s documents per row at most (default: no limit).
        pad_value: the tokens of the padding: a number, or a dict of one per column.
        lengths: as for :meth:`~quern.pipeline.definition.dataset.Pipeline.length_index` (several columns: a dict of one per column).
        cache_dir: as for :meth:`~quern.pipeline.definition.dataset.Pipeline.length_index`.
        num_workers: as for :meth:`~quern.pipeline.definition.dataset.Pipeline.length_index` (``workers=`` is deprecated).

    Returns:
        A pipeline of packed rows; chain ``.map`` (on rows) and ``.batch(B)``.

    Raises:
        ValueError: a bad ``seq_len``, mode or setting, a stream that cannot be packed, a batch, no token,
            a ``first_fit`` document longer than its row, or columns of different lengths where they must agree.
    """
    stream = packed_stream(
        self, seq_len, mode, key, lengths, cache_dir, num_workers, num_bins, max_sequences_per_bin, pad_value
    )
    return type(self)(stream=stream)


def packed_stream(
    pipe: Pipeline,
    seq_len: int | Mapping[str, int],
    mode: str,
    key: str | None,
    lengths: Any,
    cache_dir: str | os.PathLike | None,
    num_workers: int | None,
    num_bins: int | None = None,
    max_sequences_per_bin: int | None = None,
    pad_value: Any = 0,
) -> PackedStream:
    """The stream of :func:`pack` (whose docstring says what it does).

    Raises:
        ValueError: a bad ``seq_len``, mode or setting, a stream that cannot be packed, a batch, no token, a
            ``first_fit`` document longer than its row, columns whose lengths disagree where they must agree.
    """
    if mode not in _packing.MODES:
        raise ValueError(f"pack(): mode must be one of {_packing.MODES}, got {mode!r}")
    columns: tuple[tuple[str, int], ...] = ()
    if isinstance(seq_len, Mapping):
        if key is not None:
            raise ValueError("pack(seq_len={...}, key=...): the keys of seq_len name the columns; leave key out")
        if not seq_len:
            raise ValueError("pack(seq_len={}): name at least one column and its row length")
        # sorted by key: the order of the dict changes nothing (a config file's keys come sorted)
        columns = tuple(sorted((str(k), _index.check_int(v, f"seq_len[{k!r}]", 1)) for k, v in seq_len.items()))
        if mode != "first_fit" and len({n for _, n in columns}) > 1:
            raise ValueError(
                f"pack(mode={mode!r}) cuts documents, so its columns need one row length; got {dict(columns)} "
                "(first_fit places whole documents and takes one per column)"
            )
        seq_len = max(n for _, n in columns)
    seq_len = _index.check_int(seq_len, "seq_len", 1)
    if mode == "first_fit":
        if num_bins is None:
            raise ValueError("pack(mode='first_fit') needs num_bins: the rows of each packing batch (e.g. the batch)")
        num_bins = _index.check_int(num_bins, "num_bins", 1)
    elif num_bins is not None:
        raise ValueError(f"pack(num_bins=...) is first_fit's setting; mode {mode!r} takes none")
    if max_sequences_per_bin is not None:
        max_sequences_per_bin = _index.check_int(max_sequences_per_bin, "max_sequences_per_bin", 1)
        if mode == "concat":
            raise ValueError("pack(max_sequences_per_bin=...) places whole documents: mode 'first_fit' or 'best_fit'")
    names = [k for k, _ in columns] or ["tokens"]
    pads = _pad_values(pad_value, names)
    pipe.stream.check("pack")
    require(pipe.stream, SingleSource, "pack")
    need_no_batch(pipe, "pack", "a pipeline before batch()")
    src = pipe.stream.source
    assert src is not None
    table = None
    names_or_key: list[str | None] = list(names) if columns else [key]
    common: dict[str, Any] = {
        "inner": pipe,
        "seq_len": seq_len,
        "mode": mode,
        "key": key,
        "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
        "seed": pipe.stream.seed,
        "num_epochs": pipe.stream.num_epochs,
        "source": src,
        "columns": columns,
        "num_bins": num_bins,
        "max_per_bin": max_sequences_per_bin,
        "pad_values": pads,
    }
    # first_fit and concat: rows depend only on the documents before them, so the lengths are described by the
    # records they are measured from, and without an index the plan measures the documents it reaches
    cache_key = records_key(pipe, lazy_length_keys=names_or_key)
    records = f"the lengths of records {cache_key}"
    cached: dict[str | None, np.ndarray] = {}
    if mode != "best_fit" and lengths is None and not _length_metadata(pipe, columns):
        for k in names_or_key:  # a length index scanned before (by length_index() or best_fit) is used as it is
            found = scan.cached_index(records_key(pipe, length_key=k), len(src), cache_dir)
            if found is not None:
                cached[k] = found
        if len(cached) < len(names_or_key):
            lazy = LazyLengths(pipe, names_or_key, cache_key, len(src), cache_dir)
            return PackedStream(**common, lengths=np.zeros(0, dtype=np.int64), lengths_digest=records, lazy=lazy)

    def index(k: str | None, given: Any) -> np.ndarray:
        if k in cached:
            return cached[k]
        return np.asarray(pipe.length_index(k, lengths=given, cache_dir=cache_dir, num_workers=num_workers))

    if columns:
        given = lengths if isinstance(lengths, Mapping) else {}
        if lengths is not None and not isinstance(lengths, Mapping):
            raise ValueError("pack(seq_len={...}, lengths=...): give the lengths as a dict, one index per column")
        table = np.stack([index(k, given.get(k)) for k in names], axis=1)
        lens = table[:, 0]
        if mode != "first_fit":
            _packing.check_agree(table, np.arange(len(table)), names, src.name)
    else:
        lens = index(key, lengths)
    survivors = pipe.stream.survivors
    live = lens[np.asarray(survivors)] if survivors is not None else lens
    if not int(np.asarray(live).sum()):
        raise ValueError(f"pack(): the records of source {src.name!r} hold no token")
    if mode == "first_fit":
        whole = np.asarray(lens if table is None else table).reshape(len(lens), -1)
        _packing.check_fit(whole, np.arange(len(lens)), names, [n for _, n in columns] or [seq_len], src.name)
    file = os.path.abspath(os.fspath(lengths)) if isinstance(lengths, (str, os.PathLike)) else None
    digest_of = digest(np.asarray(lens if table is None else table)) if mode == "best_fit" else records
    return PackedStream(**common, lengths=lens, lengths_digest=digest_of, lengths_file=file, column_lengths=table)


def _pad_values(pad_value: Any, names: list[str]) -> tuple[tuple[str, int | float], ...]:
    """``pad_value`` (one number, or a dict of one per column) as ``(key, value)`` pairs, the zeros left out."""
    given = pad_value if isinstance(pad_value, Mapping) else dict.fromkeys(names, pad_value)
    unknown = sorted(set(map(str, given)) - set(names))
    if unknown:
        raise ValueError(f"pack(pad_value=...): no packed column {unknown[0]!r} (the columns: {names})")
    out = []
    for name in names:
        value = given.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"pack(pad_value=...): the padding of {name!r} must be a number, got {value!r}")
        if value != 0:
            out.append((name, value.item() if isinstance(value, np.generic) else value))
    return tuple(out)


def _length_metadata(pipe: Pipeline, columns: tuple[tuple[str, int], ...]) -> bool:
    """Whether the source has a length index of its own (a prepared folder's ``length``) for one column."""
    src = pipe.stream.source
    return (
        not columns and bool(getattr(src, "has_metadata", False)) and "length" in (getattr(src, "metadata", None) or {})
    )
