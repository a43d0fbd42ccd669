"""Pipelines as configuration: YAML, JSON or a dict <-> :class:`Pipeline`.

A config names a source, the shuffle, the record transforms, the batch and the
batch transforms::

    source: {type: array_record, paths: "data/train-*.array_record"}
    seed: 0
    num_epochs: null            # endless
    shuffle: global             # or {mode: block, block: 1024, window: 8}, or null
    transforms:                 # record level, in order
      - {name: decode, kwargs: {dtype: int32}}
      - {fn: "mytransforms:long_enough", kind: filter, kwargs: {min_tokens: 16}}
      - {name: pad, kwargs: {length: 512}}
      - {fn: "mytransforms:mask_some", kind: random_map, kwargs: {rate: 0.1}}
    batch: {size: 256, drop_remainder: true}
    batch_transforms:           # batch level, in order (kind map_batch or random_map_batch)
      - {fn: "mypackage.lm:shift"}

``name`` is a registered transform (:data:`REGISTRY`, extend it with
:func:`register`); ``fn`` is user code as ``"package.module:function"``, called
with ``kwargs`` through ``functools.partial``. ``kind`` is ``map`` (the default
under ``transforms``), ``random_map`` or ``filter`` for a record transform,
``map_batch`` (the default under ``batch_transforms``) or ``random_map_batch``
for a batch transform. A ``filter`` keeps the records for which
``fn(record, **kwargs)`` is true (:meth:`Pipeline.filter`): loading the config
scans the records once, or finds the survivors in the cache
(``$QUERN_CACHE_DIR``, else ``~/.cache/quern``); it comes before any
``random_map``. Relative paths are relative to
the config file (the current directory for a dict). Validation (pydantic)
reports every problem with its key path, the bad value and what was expected,
and suggests the nearest key for an unknown one; it raises :class:`ConfigError`,
whose message starts with the file's path when the config is a file, and says
each prefix (file, key path, source) once.

**Mixtures.** Instead of ``source:``, a ``mix:`` section makes the records come
from named components in given proportions (:func:`quern.mix`)::

    mix:
      seed: 0                   # the assignment of positions to components
      block: 1024               # positions per block (optional; see quern.pipeline.plan.mixture)
      components:               # name: a config without batch, batch_transforms, bucket or mix
        web:  {source: {type: array_record, paths: "web-*.array_record"}, seed: 1, shuffle: global,
               transforms: [{fn: "mytransforms:english", kind: filter}]}
        code: {source: {type: parquet, paths: "code/*.parquet"}, seed: 2}
      weights: {web: 0.7, code: 0.3}          # relative; or, weights that change at steps:
      # schedule: [{start_step: 0, weights: {web: 0.9, code: 0.1}},
      #            {start_step: 2000, weights: {web: 0.5, code: 0.5}}]
    transforms: [{name: decode, kwargs: {dtype: int32}}, {name: pad, kwargs: {length: 512}}]
    batch: 64
    batch_transforms: [{fn: "mypackage.lm:shift"}]

Each component has the keys of a single-source config but ``batch``,
``batch_transforms``, ``bucket`` and ``num_epochs`` (null if given: a component
is endless, with its own epochs); its ``transforms`` may filter, and it may be
packed (``pack`` and ``row_transforms``, see below). ``components`` may also be
a list of components with a ``name`` each (the form :func:`to_config` writes):
the components' order is part of the mixture, and a list keeps it whatever
sorts a mapping's keys. Give exactly one of ``weights`` and ``schedule`` (its
first stage at step 0, then increasing ``start_step``; each stage names every
component). The top level of a mixture has no ``source``, ``seed`` (the
mixture's is ``mix.seed``), ``shuffle``, ``num_epochs``, ``pack``,
``row_transforms`` or ``bucket``; its ``transforms``
(``map``, ``random_map``) apply to the mixed records. Bad weights or stages are
reported at their key path (``mix.schedule.1.weights: the weight of 'web' is
-1.0; weights must be >= 0``). A mixture has at most :data:`MAX_COMPONENTS`
components and :data:`MAX_SCHEDULE` stages.

**Packing.** A ``pack:`` section packs the records (after ``transforms``) into
rows of ``seq_len`` tokens (:meth:`Pipeline.pack`); ``row_transforms`` then run
on the packed rows, and ``batch`` counts rows::

    source: {type: parquet, paths: "docs/*.parquet", columns: [tokens, loss_mask]}
    seed: 0
    shuffle: global
    transforms: [{fn: "mytransforms:long_enough", kind: filter}]   # records, before packing
    pack: {seq_len: 2048, mode: best_fit, key: tokens}             # or pack: 2048 (best_fit, records are token arrays)
    row_transforms: [{fn: "mytransforms:mask_rows", kind: random_map}]  # packed rows: map or random_map
    batch: 64
    batch_transforms: [{fn: "mypackage.lm:shift"}]

``seq_len`` (>= 1) is the row length; ``mode`` is ``best_fit`` (the default:
whole documents placed by best-fit decreasing, rows in a keyed random order) or
``concat`` (documents concatenated in stream order and cut); ``key`` names the
value of a dict record that holds its tokens (null, the default: each record
is a 1-D token array). A row is ``{tokens, segment_ids, positions}`` plus the
packed copies of the record's other per-token arrays. The plan comes from the
records' *length index*: by default scanned once when the config is loaded and
cached like a filter's survivors (``$QUERN_CACHE_DIR``, folder ``lengths/``),
so the config needs nothing for it; ``lengths: path/to/lengths.npy`` (relative
to the config file) gives it instead, one integer per record of the source
(records a filter drops: any value), checked against a sample of records. The
index's content is part of the fingerprint, not where it came from: a file
holding the scanned values gives the same pipeline. The record ``transforms``
before ``pack`` may filter but not ``random_map`` (lengths must not depend on
the stream position: put a ``random_map`` under ``row_transforms``); a
``row_transforms`` section needs ``pack``. ``quern inspect`` and ``quern run``
print the fill (real tokens / (rows x ``seq_len``)) and padding of the steps
shown or run, and ``quern explain`` every document of each row.

A mixture's components may be packed, each with its own ``pack`` (and
``row_transforms``, its key path ``mix.components.<name>.row_transforms``): the
mixture then mixes packed rows by weight (:func:`quern.mix`), and ``batch``
counts rows::

    mix:
      seed: 0
      components:
        web:  {source: {type: parquet, paths: "web/*.parquet", columns: [tokens]}, seed: 1, shuffle: global,
               transforms: [{fn: "mytransforms:english", kind: filter}],
               pack: {seq_len: 2048, key: tokens}}
        code: {source: {type: parquet, paths: "code/*.parquet", columns: [tokens]}, seed: 2, shuffle: global,
               pack: {seq_len: 2048, mode: concat, key: tokens},
               row_transforms: [{fn: "mytransforms:mask_rows", kind: random_map}]}
      weights: {web: 0.7, code: 0.3}
    batch: 64

The components' rows must have the same keys, dtypes and ``seq_len`` (a
packed and an unpacked component, or two row lengths, fail when a batch is
collated). The mixture itself is not packed: a top-level ``pack`` (or
``row_transforms``) with ``mix:`` is refused.

**Length buckets.** Instead of ``batch:``, a ``bucket:`` section makes every step
a batch of records from one bucket of lengths, padded to the bucket's upper
bound (:meth:`Pipeline.bucket`: few static shapes, one per bucket)::

    source: {type: parquet, paths: "docs/*.parquet", columns: [tokens]}
    seed: 0
    shuffle: global
    transforms: [{fn: "mytransforms:long_enough", kind: filter}]   # records, before bucketing
    bucket:
      boundaries: [256, 512, 1024]     # bucket b: lengths in (boundaries[b-1], boundaries[b]]
      batch_sizes: [64, 32, 16]        # rows per step of each bucket
      key: tokens                      # the tokens of a dict record (null: records are token arrays)
      pad_value: 0
      block: 1024                      # steps per block of the assignment to buckets (optional)
      lengths: lengths.npy             # the length index (optional: scanned and cached, as for pack)
    batch_transforms: [{fn: "mypackage.lm:shift"}]

``boundaries`` are increasing lengths >= 1 (records longer than the last go to
the last bucket, truncated to it), ``batch_sizes`` one per bucket (each
divisible by the host count); a step's batch is ``{tokens, length}`` (shape
``(batch_size, bound)``; :func:`quern.transforms.pad`) plus the records'
other fields as they are, so drop or pad a record's other variable-length
fields before (``columns:``, or a transform). Steps go to buckets in
proportion to records per batch, so every bucket goes through its records at
the same pace; each bucket has its own epochs, so the stream is endless
(``num_epochs`` null if given). ``lengths`` is read as for ``pack``. A bucketed
config is single-source: ``bucket`` with ``batch``, ``pack``,
``row_transforms`` or ``mix:`` is refused, and, as for ``pack``, the record
``transforms`` may filter but not ``random_map`` (randomize the padded batches
with a ``random_map_batch`` under ``batch_transforms``). ``quern inspect``,
``quern run`` and ``quern explain`` print the bucket of the step(s) and their
padding (padded slots / (rows x bound)).

What a config may import is :mod:`quern.pipeline.trust`'s rule (for a filter's
``fn`` as for any other); the limits on what a config file can make quern do are
:mod:`quern.pipeline.limits`'.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import yaml

from . import sources
from .config_schema import (
    ArrayRecordConfig,
    BucketConfig,
    BucketPipelineConfig,
    ComponentConfig,
    MixConfig,
    MixPipelineConfig,
    PackConfig,
    ParquetConfig,
    PipelineConfig,
    ShuffleConfig,
    TensorStoreConfig,
    TransformConfig,
    validate,
)
from .dataset import Pipeline
from .dump import to_config
from .errors import ConfigError, ScanError, SourceError
from .index import host_rows
from .limits import (
    MAX_BYTES,
    Loader,
    bounded,
    clip,
    measure,
    object_children,
    show,
)
from .mix import mix
from .plan import mixture as _mixture
from .registry import REGISTRY, register
from .trust import Policy, prefixes

__all__ = ["REGISTRY", "ConfigError", "load_config", "register", "to_config"]


# --------------------------------------------------------------------------- loading


def _read(config: Any) -> tuple[dict, str, str | None]:
    """The config as a dict, the folder relative paths are resolved against, and
    the file's path (``None`` for a dict). Messages name the file. Bounded: see
    "Limits" in the module docstring."""
    if isinstance(config, dict):
        measure(config, object_children, "the config")
        return config, os.getcwd(), None
    path = os.fspath(config)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_BYTES:,} bytes (the limit for a config file)")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {clip(str(e))}") from e
    try:
        if path.endswith(".json"):
            data = json.loads(text)
            measure(data, object_children, "the document")
        else:
            data = yaml.load(text, Loader=Loader)  # a SafeLoader, with the limits
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except Exception as e:  # a syntax error, JSON nested past Python's recursion limit
        raise ConfigError(f"{path}: cannot parse: {clip(str(e))}") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys (source or mix, batch, ...), got {type(data).__name__}"
        )
    return data, os.path.dirname(os.path.abspath(path)), path


def _prefixed(key: str, error: BaseException) -> str:
    """``"key: message"`` of ``error``, with ``key`` said once: not added when the
    message already starts with it (``source 'x' is empty``); a ``KeyError``'s
    message without the quotes its ``str`` adds. Bounded (a list of paths)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return bounded(text if text.startswith((f"{key}:", f"{key} ")) else f"{key}: {text}")


def _resolve(cfg: TransformConfig, where: str, policy: Policy) -> Callable:
    """The callable of one transform entry: a registered factory called with
    ``kwargs``, or the imported ``fn`` (if ``policy`` allows it) with ``kwargs``
    bound by ``functools.partial``."""
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


def _source(
    cfg: ArrayRecordConfig | ParquetConfig | TensorStoreConfig, base: str, key: str = "source"
) -> sources.Source:
    """The source a ``source`` section (at key path ``key``) describes, its relative paths against ``base``."""
    try:
        if isinstance(cfg, ArrayRecordConfig):
            paths = [_path(p, base) for p in ([cfg.paths] if isinstance(cfg.paths, str) else cfg.paths)]
            return sources.ArrayRecordSource(paths, name=cfg.name, max_open_files=cfg.max_open_files)
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
        spec = _path(cfg.spec, base) if isinstance(cfg.spec, str) else cfg.spec
        return sources.TensorStoreSource(spec, name=cfg.name)
    except (OSError, KeyError, ValueError, SourceError) as e:
        raise ConfigError(_prefixed(key, e)) from e


def load_config(config: Any, process_count: int = 1, allow: str | Iterable[str] | None = None) -> Pipeline:
    """A :class:`Pipeline` from a config (a YAML or JSON file path, or a dict).

    ``process_count``: the number of hosts the pipeline will run on, checked to
    divide the batch size. ``allow``: module prefixes whose functions ``fn``
    entries may name (``["mypkg"]`` allows ``mypkg`` and ``mypkg.sub``), added
    to those of the ``QUERN_ALLOW`` environment variable; without them a config
    names only registered transforms and functions of modules in its own folder
    (see "What a config may run" in the module docstring). Raises
    :class:`ConfigError` naming every problem, and the file first when
    ``config`` is one (each prefix said once). Relative data paths are found from
    the config file's folder (the current directory for a dict). A ``filter``
    stage scans its records once (or finds its cached survivors, see
    :meth:`Pipeline.filter`); a predicate that raises is a
    :class:`~quern.pipeline.errors.ScanError` naming the stage's key path."""
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
        size, drop = (cfg.batch, True) if isinstance(cfg.batch, int) else (cfg.batch.size, cfg.batch.drop_remainder)
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
            pipe = pipe.batch(size, drop_remainder=drop)
        except ValueError as e:
            raise ConfigError(_prefixed("batch", e)) from e
    return _add_stages(
        pipe, cfg.batch_transforms, "batch_transforms", ("map_batch", "random_map_batch"), "transforms", policy
    )


def _rows(cfg: PipelineConfig | ComponentConfig, base: str, policy: Policy, where: str) -> Pipeline:
    """The records of one source without batch, or its packed rows: ``transforms``, then
    ``pack`` and ``row_transforms`` if there is a ``pack``; a config's top level or a
    mixture's component (``where``: its key path and a dot, ``""`` for the top level)."""
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
    """A :class:`ConfigError` for a ``random_map`` among the record ``stages`` before ``what``
    (``pack`` or ``bucket``), which plans with the records' lengths; checked before any scan."""
    for i, t in enumerate(stages):
        if t.kind == "random_map":
            raise ConfigError(
                f"{where}transforms.{i}.kind: a random_map before {what}: the lengths {what}ing plans with must not "
                f"depend on the stream position; {instead}"
            )


def _leaf(
    cfg: PipelineConfig | ComponentConfig | BucketPipelineConfig, base: str, policy: Policy, where: str
) -> Pipeline:
    """The pipeline of one source, without batch: a config's top level or a mixture's
    component (``where``: its key path and a dot, ``""`` for the top level)."""
    source = _source(cfg.source, base, f"{where}source")
    try:
        pipe = Pipeline.from_source(source, seed=cfg.seed, num_epochs=cfg.num_epochs)
    except ValueError as e:
        raise ConfigError(_prefixed(f"{where}source", e)) from e
    if cfg.shuffle is not None:
        sh = ShuffleConfig.model_validate({"mode": cfg.shuffle}) if isinstance(cfg.shuffle, str) else cfg.shuffle
        pipe = pipe.shuffle(sh.mode, block=sh.block, window=sh.window)
    kinds = ("map", "random_map", "filter")
    return _add_stages(pipe, cfg.transforms, f"{where}transforms", kinds, "batch_transforms", policy)


def _lengths_file(lengths: str | None, base: str, where: str) -> str | None:
    """The absolute path of a length index's file (``lengths`` against ``base``), checked to
    exist; ``where``: the key path of its section (``pack``, ``bucket``)."""
    if lengths is None:
        return None
    path = os.path.abspath(_path(lengths, base))
    if not os.path.isfile(path):
        raise ConfigError(f"{where}.lengths: no file {show(path)} (a .npy file of one integer per record)")
    return path


def _planned(make: Callable[[], Pipeline], lengths: str | None, where: str) -> Pipeline:
    """``make()`` (a ``pack`` or ``bucket`` of the section at key path ``where``, with the
    length index file ``lengths``), its errors said with their key path."""
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
    return _planned(lambda: pipe.pack(cfg.seq_len, mode=cfg.mode, key=cfg.key, lengths=lengths), lengths, where)


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
        return mix(components, weights=weights, schedule=schedule, seed=cfg.seed, block=cfg.block)
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
    """``pipe`` with the stages of one config section (at key path ``section``); ``kinds``:
    the kinds that belong there, the first the default; ``other``: the section to suggest
    for a stage of another kind (``filter_hint`` for a filter, when ``other`` is
    ``batch_transforms``)."""
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
