"""A :class:`Pipeline` from a config: a YAML or JSON file, or a dict.

:func:`load_config` reads the config (bounded: :mod:`quern.pipeline.config.limits`),
checks it (:func:`~quern.pipeline.config.validate.validate`), resolves its
transforms under the trust rule of :mod:`quern.pipeline.config.trust`, and
builds the pipeline with the public API. The pipeline depends on the config, the
files it names (relative paths against the config file's folder, the current
directory for a dict) and the code of the transforms it names. The format is
the schema's: :mod:`quern.pipeline.config.schema`.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import yaml

from .. import sources
from ..core.errors import ConfigError, ScanError, SourceError
from ..core.registry import REGISTRY
from ..definition.dataset import Pipeline
from ..definition.mix import mix
from ..order import components as _mixture
from ..order.index import host_rows
from .edits import apply_edits
from .limits import LOADER, MAX_BYTES, bounded, clip, measure, object_children, show
from .schema import (
    ArrayRecordConfig,
    BatchConfig,
    BucketConfig,
    BucketPipelineConfig,
    ComponentConfig,
    FileSourceConfig,
    JsonlConfig,
    MixConfig,
    MixPipelineConfig,
    PackConfig,
    ParquetConfig,
    PipelineConfig,
    ShuffleConfig,
    TFRecordConfig,
    TransformConfig,
    WebDatasetConfig,
)
from .trust import Policy, prefixes
from .validate import validate

__all__ = ["load_config"]


def _read(config: Any) -> tuple[dict, str, str | None]:
    """The config as a dict, the folder relative paths are resolved against, and the file's path.

    The path is ``None`` for a dict. Messages name the file. Bounded: see :mod:`quern.pipeline.config.limits`.
    """
    if isinstance(config, dict):
        measure(config, object_children, what="the config")
        return config, os.getcwd(), None
    path = os.fspath(config)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_BYTES:,} bytes (the limit for a config file)")
        text = raw.decode("utf-8-sig")  # a byte-order mark is not text: no parser counts it in a column
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {clip(str(e))}") from e
    try:
        if path.endswith(".json"):
            data = json.loads(text)
            measure(data, object_children, what="the document")
        else:
            data = yaml.load(text, Loader=LOADER)  # a SafeLoader's values, with the limits
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:  # a syntax error at a place in the file
        raise ConfigError(f"{path}: cannot parse: {_yaml_error(e, text)}") from e
    except Exception as e:  # another YAML error, JSON nested past Python's recursion limit
        raise ConfigError(f"{path}: cannot parse: {clip(str(e))}") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys (source or mix, batch, ...), got {type(data).__name__}"
        )
    return data, os.path.dirname(os.path.abspath(path)), path


def _yaml_error(error: yaml.MarkedYAMLError, text: str) -> str:
    r"""A YAML syntax error's message: what was wrong, where, and the line of ``text`` with a caret there.

    PyYAML's Python parser shows the line of each place it names; libyaml's (the loader quern
    uses where PyYAML has it) names the line and column only. This message is laid out the same
    for both parsers' errors (their wording differs): each place once, as ``at line L, column
    C:``, then the line and a caret under the column. A line is shown in at most :data:`_SHOWN`
    characters around the column (``...`` where it is cut, a character that cannot be printed
    as ``?``; the caret counts characters, as both parsers' columns do), and a place past the last
    line as ``(the end of the text)``. The parser's own sentences may quote the file (an alias,
    an anchor, a tag): :func:`load_config` bounds every line of a message, this one's too.

    Args:
        error: the parser's error (line and column count from 0 in it).
        text: the document parsed.

    Returns:
        The message, several lines.

    Example:
        >>> import yaml
        >>> try:
        ...     yaml.safe_load("a: [1, 2\nb: 3\n")
        ... except yaml.MarkedYAMLError as e:
        ...     print(_yaml_error(e, "a: [1, 2\nb: 3\n"))
        while parsing a flow sequence
          at line 1, column 4:
            a: [1, 2
               ^
        expected ',' or ']', but got ':'
          at line 2, column 2:
            b: 3
             ^
    """
    lines = text.splitlines()
    out: list[str] = []
    places = [(error.context, error.context_mark), (error.problem, error.problem_mark)]
    for i, (what, mark) in enumerate(places):
        if what:
            out.append(what)
        problem = error.problem_mark
        same = problem is not None and mark is not None and (mark.line, mark.column) == (problem.line, problem.column)
        if mark is None or (i == 0 and same and error.problem is not None):  # a place said once
            continue
        out.append(f"  at line {mark.line + 1}, column {mark.column + 1}:")
        if mark.line >= len(lines):
            out.append("    (the end of the text)")
            continue
        line = lines[mark.line]
        start = max(0, min(mark.column - _SHOWN // 2, len(line) - _SHOWN))
        shown = "".join(c if c.isprintable() or c == "\t" else "?" for c in line[start : start + _SHOWN])
        before, after = ("..." if start else ""), ("..." if start + _SHOWN < len(line) else "")
        pad = "".join(c if c == "\t" else " " for c in before + shown[: mark.column - start])  # a tab stays a tab
        out += [f"    {before}{shown}{after}", f"    {pad}^"]
    if error.note:
        out.append(error.note)
    return "\n".join(out)


_SHOWN = 76
"""The most characters of a line :func:`_yaml_error` shows."""


def _prefixed(key: str, error: BaseException) -> str:
    """``"key: message"`` of ``error``, with ``key`` said once.

    ``key`` is not added when the message already starts with it (``source 'x' is
    empty``); a ``KeyError``'s message is without the quotes its ``str`` adds.
    Bounded (a list of paths).
    """
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return bounded(text if text.startswith((f"{key}:", f"{key} ")) else f"{key}: {text}")


def _resolve(cfg: TransformConfig, where: str, policy: Policy) -> Callable:
    """The callable of one transform entry.

    A registered factory called with ``kwargs``, or the imported ``fn`` (if
    ``policy`` allows it) with ``kwargs`` bound by ``functools.partial``.
    """
    if cfg.name is not None:
        registry = REGISTRY
        if cfg.name not in registry:
            near = difflib.get_close_matches(cfg.name, registry, n=1) if len(cfg.name) < 60 else []
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"{where}.name: no registered transform {show(cfg.name)} (known: {sorted(registry)}){hint}"
            )
        try:
            return registry[cfg.name](**cfg.kwargs)
        except Exception as e:
            raise ConfigError(
                f"{where}.kwargs: {cfg.name}(**{show(cfg.kwargs)}) failed: {type(e).__name__}: {clip(str(e))}"
            ) from e
    assert cfg.fn is not None  # the schema asks for exactly one of name and fn
    try:
        fn = policy.resolve(cfg.fn)
    except ConfigError as e:
        raise ConfigError(f"{where}.fn: {e}") from None
    except Exception as e:  # whatever importing user code raises (a SyntaxError too) is a config error
        raise ConfigError(f"{where}.fn: cannot import {cfg.fn!r}: {type(e).__name__}: {clip(str(e))}") from e
    if not callable(fn):
        raise ConfigError(f"{where}.fn: {cfg.fn!r} is a {type(fn).__name__}, not a function")
    try:
        policy.check_origin(cfg.fn, fn)
    except ConfigError as e:
        raise ConfigError(f"{where}.fn: {e}") from None
    return functools.partial(fn, **cfg.kwargs) if cfg.kwargs else fn


def _path(p: str, base: str) -> str:
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) or "://" in p else os.path.join(base, p)


def _source(cfg: FileSourceConfig, base: str, key: str = "source") -> sources.Source:
    """The source a ``source`` section (at key path ``key``) describes, its relative paths against ``base``."""
    try:
        if isinstance(cfg, ArrayRecordConfig):
            paths = [_path(p, base) for p in ([cfg.paths] if isinstance(cfg.paths, str) else cfg.paths)]
            return sources.ArrayRecordSource(
                paths, name=cfg.name, max_open_files=cfg.max_open_files, fields=tuple(cfg.fields)
            )
        if isinstance(cfg, ParquetConfig):
            paths = [_path(p, base) for p in ([cfg.paths] if isinstance(cfg.paths, str) else cfg.paths)]
            return sources.ParquetSource(
                paths,
                columns=cfg.columns,
                name=cfg.name,
                cache_bytes=cfg.cache_bytes,
                cache_row_groups=cfg.cache_row_groups,
                unify_schemas=cfg.unify_schemas,
            )
        if isinstance(cfg, (WebDatasetConfig, TFRecordConfig, JsonlConfig)):
            paths = [_path(p, base) for p in ([cfg.paths] if isinstance(cfg.paths, str) else cfg.paths)]
            if isinstance(cfg, JsonlConfig):
                return sources.JsonlSource(paths, cfg.field, name=cfg.name)
            kind = sources.WebDatasetSource if isinstance(cfg, WebDatasetConfig) else sources.TFRecordSource
            return kind(paths, name=cfg.name)
        spec = _path(cfg.spec, base) if isinstance(cfg.spec, str) else cfg.spec
        return sources.TensorStoreSource(spec, name=cfg.name)
    except (OSError, KeyError, ValueError, SourceError) as e:
        raise ConfigError(_prefixed(key, e)) from e


def load_config(config: Any, *, process_count: int = 1, allow: str | Iterable[str] | None = None) -> Pipeline:
    """A :class:`Pipeline` from a config.

    The format is :mod:`quern.pipeline.config.schema`'s. Relative data paths are found
    from the config file's folder (the current directory for a dict). A ``filter``
    stage scans its records once (or finds its cached survivors, see
    :meth:`Pipeline.filter`).

    Args:
        config: A YAML or JSON file's path, or a dict.
        process_count: The number of hosts the pipeline will run on, checked to divide
            the batch size.
        allow: Module prefixes whose functions ``fn`` entries may name (``["mypkg"]``
            allows ``mypkg`` and ``mypkg.sub``), added to those of the ``QUERN_ALLOW``
            environment variable; without them a config names only registered
            transforms and functions of modules in its own folder (the rule of
            :mod:`quern.pipeline.config.trust`).

    Returns:
        The pipeline the config describes; it depends on the config, the files it
        names and the code of the transforms it names.

    Raises:
        ConfigError: Naming every problem, and the file first when ``config`` is one
            (each prefix said once).
        ScanError: A filter's predicate raised on a record; it names the stage's key path.

    Example:
        >>> import numpy as np
        >>> spec = {"driver": "array", "array": np.arange(10), "dtype": "int64"}  # an in-memory TensorStore
        >>> pipe = load_config({"source": {"type": "tensorstore", "spec": spec}, "batch": 4})
        >>> pipe.batch_at(0).tolist()
        [0, 1, 2, 3]
    """
    allowed = prefixes(allow)
    path = None if isinstance(config, dict) else os.fspath(config)
    try:
        data, base, path = _read(config)
        policy = Policy(allowed, base if path is not None else None)
        return _build(data, base, process_count, policy)
    except ConfigError as e:
        message = bounded(str(e))
        if path is not None and not message.startswith(f"{path}: "):
            message = f"{path}: {message}"
        raise ConfigError(message).with_traceback(e.__traceback__) from e.__cause__
    except ScanError as e:  # a filter's predicate failed on a record: the data's error, said with the file
        if path is None:
            raise
        raise ScanError(f"{path}: {e}").with_traceback(e.__traceback__) from e.__cause__


def _build(data: dict, base: str, process_count: int, policy: Policy) -> Pipeline:
    """The pipeline of a config read by :func:`_read` (messages without the file)."""
    cfg = validate(data)
    if isinstance(cfg, BucketPipelineConfig):
        for i, size in enumerate(cfg.bucket.batch_sizes):  # the one host-slice check, per bucket
            try:
                host_rows(size, 0, process_count)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"bucket.batch_sizes.{i}: {e}") from None
        _no_random_map_before(
            cfg.transforms, "", "bucket", "put it under batch_transforms (random_map_batch, on the padded batches)"
        )
        pipe = _bucketed(_leaf(cfg, base, policy, ""), cfg.bucket, base)
    else:
        batch = BatchConfig(size=cfg.batch) if isinstance(cfg.batch, int) else cfg.batch
        size = batch.size
        try:  # the one host-slice check
            host_rows(size, 0, process_count)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"batch: {e}") from None
        if isinstance(cfg, MixPipelineConfig):
            pipe = _mixture_of(cfg.mix, base, policy)
            pipe = _add_stages(pipe, cfg.transforms, "transforms", ("map", "random_map"), "batch_transforms", policy)
        else:
            pipe = _rows(cfg, base, policy, "")
        try:
            pipe = pipe.batch(
                size, drop_remainder=batch.drop_remainder, pad_remainder=batch.pad_remainder, pad_value=batch.pad_value
            )
        except ValueError as e:
            raise ConfigError(_prefixed("batch", e)) from e
    pipe = _add_stages(
        pipe,
        cfg.batch_transforms,
        "batch_transforms",
        ("map_batch", "random_map_batch", "map_device", "random_map_device"),
        "transforms",
        policy,
    )
    return apply_edits(pipe, cfg.skip, cfg.exclude, base)


def _rows(cfg: PipelineConfig | ComponentConfig, base: str, policy: Policy, where: str) -> Pipeline:
    """The records of one source without batch, or its packed rows.

    ``transforms``, then ``pack`` and ``row_transforms`` if there is a ``pack``; of
    a config's top level or a mixture's component (``where``: its key path and a
    dot, ``""`` for the top level).
    """
    if cfg.pack is None:
        if cfg.row_transforms:
            raise ConfigError(
                f"{where}row_transforms: transforms of packed rows need a pack: section; "
                f"put the transforms of records under {where}transforms"
            )
        return _leaf(cfg, base, policy, where)
    pack = PackConfig(seq_len=cfg.pack) if isinstance(cfg.pack, int) else cfg.pack
    _no_random_map_before(cfg.transforms, where, "pack", f"put it under {where}row_transforms (on packed rows)")
    pipe = _packed(_leaf(cfg, base, policy, where), pack, base, f"{where}pack")
    return _add_stages(
        pipe,
        cfg.row_transforms,
        f"{where}row_transforms",
        ("map", "random_map"),
        "batch_transforms",
        policy,
        filter_hint=f"filter the records before pack (under {where}transforms)",
    )


def _no_random_map_before(stages: list[TransformConfig], where: str, what: str, instead: str) -> None:
    """A :class:`ConfigError` for a ``random_map`` among the record ``stages`` before ``what``.

    ``what`` (``pack`` or ``bucket``) plans with the records' lengths; checked before any scan.
    """
    for i, t in enumerate(stages):
        if t.kind == "random_map":
            raise ConfigError(
                f"{where}transforms.{i}.kind: a random_map before {what}: the lengths {what}ing plans with must not "
                f"depend on the stream position; {instead}"
            )


def _leaf(
    cfg: PipelineConfig | ComponentConfig | BucketPipelineConfig, base: str, policy: Policy, where: str
) -> Pipeline:
    """The pipeline of one source, without batch: a config's top level or a mixture's component.

    ``where``: its key path and a dot, ``""`` for the top level.
    """
    source = _source(cfg.source, base, f"{where}source")
    try:
        pipe = Pipeline.from_source(source, seed=cfg.seed, num_epochs=cfg.num_epochs)
    except ValueError as e:
        raise ConfigError(_prefixed(f"{where}source", e)) from e
    if cfg.shuffle is not None:
        sh = ShuffleConfig.model_validate({"mode": cfg.shuffle}) if isinstance(cfg.shuffle, str) else cfg.shuffle
        pipe = pipe.shuffle(sh.mode, block_size=sh.block, window=sh.window)
    kinds = ("map", "random_map", "filter", "flat_map")
    return _add_stages(pipe, cfg.transforms, f"{where}transforms", kinds, "batch_transforms", policy)


def _lengths_file(lengths: str | None, base: str, where: str) -> str | None:
    """The absolute path of a length index's file (``lengths`` against ``base``), checked to exist.

    ``where``: the key path of its section (``pack``, ``bucket``).
    """
    if lengths is None:
        return None
    path = os.path.abspath(_path(lengths, base))
    if not os.path.isfile(path):
        raise ConfigError(f"{where}.lengths: no file {show(path)} (a .npy file of one integer per record)")
    return path


def _planned(make: Callable[[], Pipeline], lengths: str | None, where: str) -> Pipeline:
    """``make()``, its errors said with their key path.

    ``make`` is a ``pack`` or ``bucket`` of the section at key path ``where``, with
    the length index file ``lengths``.
    """
    try:
        return make()
    except ScanError as e:  # a record without tokens (no key, not 1-D): the data's error, said with its key
        raise ScanError(f"{where}: {e}") from e.__cause__
    except (OSError, ValueError) as e:  # the file's (unreadable, or not this data's index), or no token at all
        text = str(e)
        if lengths is None or "hold no token" in text or text.startswith(("pack():", "bucket():")):
            raise ConfigError(_prefixed(where, e)) from e
        if "length index" in text:  # length_index's own check: names the file
            raise ConfigError(_prefixed(f"{where}.lengths", e)) from e
        raise ConfigError(
            f"{where}.lengths: cannot read {show(lengths)} as a .npy array: {type(e).__name__}: {clip(text)}"
        ) from e


def _packed(pipe: Pipeline, cfg: PackConfig, base: str, where: str = "pack") -> Pipeline:
    """``pipe`` packed as the ``pack`` section at key path ``where`` says (its ``lengths`` file against ``base``)."""
    lengths = _lengths_file(cfg.lengths, base, where)
    return _planned(
        lambda: pipe.pack(
            cfg.seq_len,
            mode=cfg.mode,
            key=cfg.key,
            lengths=lengths,
            num_bins=cfg.num_bins,
            max_sequences_per_bin=cfg.max_sequences_per_bin,
            pad_value=cfg.pad_value,
        ),
        lengths,
        where,
    )


def _bucketed(pipe: Pipeline, cfg: BucketConfig, base: str) -> Pipeline:
    """``pipe`` in length buckets as the ``bucket`` section says (its ``lengths`` file against ``base``)."""
    lengths = _lengths_file(cfg.lengths, base, "bucket")
    return _planned(
        lambda: pipe.bucket(
            cfg.boundaries, cfg.batch_sizes, key=cfg.key, pad_value=cfg.pad_value, lengths=lengths, block=cfg.block
        ),
        lengths,
        "bucket",
    )


def _weights_error(e: Exception, key: str) -> ConfigError:
    """A weights error of :func:`quern.mix` (``"weights: ..."``) as a :class:`ConfigError` at ``key``."""
    text = str(e)
    return ConfigError(bounded(f"{key}: {text.removeprefix('weights: ')}"))


def _mixture_of(cfg: MixConfig, base: str, policy: Policy) -> Pipeline:
    """The mixture (without batch) of a ``mix`` section."""
    names = list(cfg.components)  # the weights first: a component's filter may scan its records
    weights: dict[str, Any] | None = None
    schedule: list[tuple[int, dict[str, Any]]] | None = None
    if cfg.weights is not None:
        weights = cfg.weights
        try:
            _mixture.check_schedule(names, weights=weights)
        except (TypeError, ValueError) as e:
            raise _weights_error(e, "mix.weights") from e
    else:
        assert cfg.schedule is not None  # the schema asks for exactly one of weights and schedule
        schedule = []
        for t, stage in enumerate(cfg.schedule):
            try:
                _mixture.check_schedule(names, weights=stage.weights)
            except (TypeError, ValueError) as e:
                raise _weights_error(e, f"mix.schedule.{t}.weights") from e
            if t == 0 and stage.start_step != 0:
                raise ConfigError(
                    f"mix.schedule.0.start_step: the first stage must start at step 0, got {stage.start_step}"
                )
            if t and stage.start_step <= schedule[-1][0]:
                raise ConfigError(
                    f"mix.schedule.{t}.start_step: {stage.start_step} is not after the start of stage {t - 1} "
                    f"({schedule[-1][0]}); stages must be in increasing order of start_step"
                )
            schedule.append((stage.start_step, stage.weights))
    components = {
        name: _rows(c, base, policy, f"mix.components.{clip(name, 60)}.") for name, c in cfg.components.items()
    }
    try:
        return mix(components, weights=weights, schedule=schedule, seed=cfg.seed, block=cfg.block, stop=cfg.stop)
    except (TypeError, ValueError) as e:  # components named "": what the checks above do not cover
        raise ConfigError(_prefixed("mix", e)) from e


def _add_stages(
    pipe: Pipeline,
    stages: list[TransformConfig],
    section: str,
    kinds: tuple[str, ...],
    other: str,
    policy: Policy,
    filter_hint: str = "a mixture's records are filtered in its components (mix.components.<name>.transforms)",
) -> Pipeline:
    """``pipe`` with the stages of one config section (at key path ``section``).

    ``kinds``: the kinds that belong there, the first the default; ``other``: the
    section to suggest for a stage of another kind (``filter_hint`` for a filter,
    when ``other`` is ``batch_transforms``).
    """
    for i, t in enumerate(stages):
        kind = t.kind or kinds[0]
        if kind not in kinds:
            hint = filter_hint if kind == "filter" and other == "batch_transforms" else f"put it under {other}"
            raise ConfigError(f"{section}.{i}.kind: {kind!r} does not belong here; {hint}")
        fn = _resolve(t, f"{section}.{i}", policy)
        try:
            pipe = getattr(pipe, kind)(fn)
        except ScanError as e:  # the predicate failed on a record: the data's error, said with its key
            raise ScanError(f"{section}.{i}: {e}") from e.__cause__
        except ValueError as e:  # a filter that keeps nothing
            raise ConfigError(_prefixed(f"{section}.{i}", e)) from e
    return pipe
