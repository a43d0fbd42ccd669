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
      components:               # name: a config without batch, batch_transforms or mix
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
``batch_transforms`` and ``num_epochs`` (null if given: a component is endless,
with its own epochs); its ``transforms`` may filter. ``components`` may also be
a list of components with a ``name`` each (the form :func:`to_config` writes):
the components' order is part of the mixture, and a list keeps it whatever
sorts a mapping's keys. Give exactly one of ``weights`` and ``schedule`` (its
first stage at step 0, then increasing ``start_step``; each stage names every
component). The top level of a mixture has no ``source``, ``seed`` (the
mixture's is ``mix.seed``), ``shuffle`` or ``num_epochs``; its ``transforms``
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
``row_transforms`` section needs ``pack``. Packing is for single-source configs:
a ``pack`` with ``mix:`` or in a mixture's component is refused (mixtures of
packed components are not supported yet). ``quern inspect`` and ``quern run``
print the fill (real tokens / (rows x ``seq_len``)) and padding of the steps
shown or run, and ``quern explain`` every document of each row.

What a config may import is :mod:`quern.pipeline.trust`'s rule (for a filter's
``fn`` as for any other); the limits on what a config file can make quern do are
:mod:`quern.pipeline.limits`'.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from . import sources
from .dataset import Pipeline
from .dump import to_config
from .errors import ConfigError, ScanError, SourceError
from .index import host_rows
from .limits import (
    MAX_BYTES,
    MAX_COMPONENTS,
    MAX_KEYS,
    MAX_SCHEDULE,
    MAX_SHOWN,
    MAX_STAGES,
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
from .trust import FN, FN_FORM, IDENT, MODULE, Policy, prefixes

__all__ = ["REGISTRY", "ConfigError", "load_config", "register", "to_config"]


# --------------------------------------------------------------------------- schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _few_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(data) > MAX_KEYS:  # one error, instead of one per unknown key
            raise ValueError(
                f"{len(data):,} keys, more than any section has (the limit is {MAX_KEYS}); "
                f"this one's are {sorted(cls.model_fields)}"
            )
        return data


def _strings(value: Any) -> Any:
    """A list of strings as it is; otherwise an error naming the first item that is not one
    (pydantic would report each: as many errors as items)."""
    if isinstance(value, list):
        bad = [i for i, v in enumerate(value) if not isinstance(v, str)]
        if bad:
            raise ValueError(
                f"item {bad[0]} is not a string: {show(value[bad[0]])}"
                + (f" ({len(bad):,} items are not strings)" if len(bad) > 1 else "")
            )
    return value


def _string_keys(value: Any) -> Any:
    """A mapping with string keys as it is; otherwise an error naming the first other key."""
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(
                f"keys must be strings, got {show(bad[0])}"
                + (f" ({len(bad):,} keys are not strings)" if len(bad) > 1 else "")
            )
    return value


class ArrayRecordConfig(_Model):
    type: Literal["array_record"]
    paths: str | list[str]
    name: str | None = None
    max_open_files: StrictInt = Field(256, ge=1)

    _paths = field_validator("paths", mode="before")(_strings)


class ParquetConfig(_Model):
    type: Literal["parquet"]
    paths: str | list[str]
    columns: list[str] | None = None
    name: str | None = None
    cache_bytes: StrictInt = Field(1 << 30, ge=1)
    cache_row_groups: StrictInt | None = Field(None, ge=1)
    unify_schemas: StrictBool = False

    _paths = field_validator("paths", "columns", mode="before")(_strings)


class TensorStoreConfig(_Model):
    type: Literal["tensorstore"]
    spec: str | dict[str, Any]
    name: str | None = None

    _spec = field_validator("spec", mode="before")(_string_keys)


SourceConfig = Annotated[ArrayRecordConfig | ParquetConfig | TensorStoreConfig, Field(discriminator="type")]


class ShuffleConfig(_Model):
    mode: Literal["global", "block"] = "global"
    block: StrictInt | None = Field(None, ge=1)
    window: StrictInt = Field(8, ge=1)


class TransformConfig(_Model):
    name: str | None = None
    fn: str | None = None
    kind: Literal["map", "random_map", "filter", "map_batch", "random_map_batch"] | None = None
    kwargs: dict[str, Any] = {}

    _kwargs = field_validator("kwargs", mode="before")(_string_keys)

    @model_validator(mode="after")
    def _one_of(self) -> TransformConfig:
        if (self.name is None) == (self.fn is None):
            raise ValueError("give exactly one of 'name' (a registered transform) or 'fn' ('package.module:function')")
        if self.fn is not None:
            if len(self.fn) > MAX_SHOWN:
                raise ValueError(f"{FN_FORM}, got {show(self.fn)} (at most {MAX_SHOWN} characters)")
            if FN.fullmatch(self.fn) is None:
                module, colon, qualname = self.fn.partition(":")
                if colon and MODULE.fullmatch(module) and re.fullmatch(rf"{IDENT}(?:\.{IDENT})*", qualname):
                    raise ValueError(
                        f"fn {show(self.fn)}: a name after ':' starting with '_' (a private or special attribute) "
                        "is not allowed; name a public function"
                    )
                raise ValueError(
                    f"{FN_FORM}, got {show(self.fn)} (dotted ASCII names; no relative import, no dunder module)"
                )
        return self


class BatchConfig(_Model):
    size: StrictInt = Field(ge=1)
    drop_remainder: bool = True


Stages = Annotated[list[TransformConfig], Field(max_length=MAX_STAGES)]
Shuffle = Literal["global", "block"] | ShuffleConfig | None
Batch = Annotated[StrictInt, Field(ge=1)] | BatchConfig


class PackConfig(_Model):
    seq_len: StrictInt = Field(ge=1)
    mode: Literal["best_fit", "concat"] = "best_fit"
    key: str | None = None
    lengths: str | None = None

    @field_validator("lengths")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        if value is not None and (not value or len(value) > 4096):
            raise ValueError(f"must be the path of a .npy file, got {show(value)}")
        return value


Pack = Annotated[StrictInt, Field(ge=1)] | PackConfig


class PipelineConfig(_Model):
    source: SourceConfig
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    num_epochs: StrictInt | None = Field(None, ge=1)
    shuffle: Shuffle = None
    transforms: Stages = []
    pack: Pack | None = None
    row_transforms: Stages = []
    batch: Batch
    batch_transforms: Stages = []


def _bounded_mapping(value: Any) -> Any:
    """A mapping with string keys and at most :data:`MAX_COMPONENTS` of them, as it is."""
    value = _string_keys(value)
    if isinstance(value, dict) and len(value) > MAX_COMPONENTS:
        raise ValueError(f"{len(value):,} entries, more than {MAX_COMPONENTS} (the most components of a mixture)")
    return value


def _numbers(value: Any) -> Any:
    """Weights by name as they are; otherwise an error naming the first weight that is not a number."""
    value = _bounded_mapping(value)
    if isinstance(value, dict):
        bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int | float)]
        if bad:
            raise ValueError(
                f"the weight of {show(bad[0])} must be a number, got {show(value[bad[0]])}"
                + (f" ({len(bad):,} weights are not numbers)" if len(bad) > 1 else "")
            )
    return value


_PACK_ALONE = "pack a single-source config (source:, pack:, batch:)"


class ComponentConfig(_Model):
    """One component of a mixture: a pipeline without batch, endless."""

    source: SourceConfig
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    num_epochs: None = None
    shuffle: Shuffle = None
    transforms: Stages = []
    pack: None = None

    @field_validator("num_epochs", mode="before")
    @classmethod
    def _endless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                f"must be null, got {show(value)}: the components of a mixture are endless "
                "(each repeats and reshuffles on its own epochs)"
            )
        return value

    @field_validator("pack", mode="before")
    @classmethod
    def _unpacked(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(f"mixtures of packed components are not supported yet; {_PACK_ALONE}")
        return value


class StageConfig(_Model):
    """One stage of a schedule: from ``start_step`` on, these weights."""

    start_step: StrictInt = Field(ge=0)
    weights: dict[str, Any]

    _weights = field_validator("weights", mode="before")(_numbers)


class MixConfig(_Model):
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    block: StrictInt = Field(_mixture.BLOCK, ge=1)
    components: dict[str, ComponentConfig] = Field(min_length=1)
    weights: dict[str, Any] | None = None
    schedule: Annotated[list[StageConfig], Field(min_length=1, max_length=MAX_SCHEDULE)] | None = None

    @field_validator("components", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """The components by name, in order: a mapping as it is, a list of components
        with a ``name`` each as the mapping of their names."""
        if isinstance(value, list):
            if len(value) > MAX_COMPONENTS:
                raise ValueError(f"{len(value):,} components, more than {MAX_COMPONENTS} (the most of a mixture)")
            by_name: dict[Any, Any] = {}
            for i, item in enumerate(value):
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    got = show(item.get("name")) if isinstance(item, dict) else show(item)
                    raise ValueError(f"item {i}: a component of the list form needs a name (a string), got {got}")
                if item["name"] in by_name:
                    raise ValueError(f"item {i}: component {show(item['name'])} is named twice")
                by_name[item["name"]] = {k: v for k, v in item.items() if k != "name"}
            value = by_name
        value = _bounded_mapping(value)
        if isinstance(value, dict) and "" in value:
            raise ValueError("a component's name must not be empty")
        return value

    _weights = field_validator("weights", mode="before")(_numbers)

    @model_validator(mode="after")
    def _one_of(self) -> MixConfig:
        if (self.weights is None) == (self.schedule is None):
            raise ValueError(
                "give exactly one of 'weights' ({component: weight, ...}) or "
                "'schedule' ([{start_step: 0, weights: {...}}, {start_step: S, weights: {...}}, ...])"
            )
        return self


class MixPipelineConfig(_Model):
    """A config whose records come from a mixture (``mix:``) instead of one ``source:``."""

    mix: MixConfig
    transforms: Stages = []
    batch: Batch
    batch_transforms: Stages = []


_NOT_WITH_MIX = {
    "source": "give either source (one source) or mix (a mixture of components), not both",
    "seed": "with mix, the mixture's seed is mix.seed (and each component has its own seed)",
    "num_epochs": "a mixture is endless: its components repeat on their own epochs; leave num_epochs out",
    "shuffle": "a mixture is not shuffled itself: shuffle its components (mix.components.<name>.shuffle)",
    "pack": f"packing a mixture is not supported yet; {_PACK_ALONE}",
    "row_transforms": "transforms of packed rows; a mixture is not packed (put its transforms under transforms)",
}
"""Top-level keys of a single-source config that a ``mix:`` config refuses, and why
(``pack: null`` and ``row_transforms: []`` are no packing: let through)."""


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


_COMPONENT = "mix.components.<name>"
_SECTIONS = {
    "": (PipelineConfig, MixPipelineConfig),
    "shuffle": ShuffleConfig,
    "batch": BatchConfig,
    "transforms": TransformConfig,
    "batch_transforms": TransformConfig,
    "source": (ArrayRecordConfig, ParquetConfig, TensorStoreConfig),
    "mix": MixConfig,
    "pack": PackConfig,
    "row_transforms": TransformConfig,
    _COMPONENT: ComponentConfig,
    "mix.schedule": StageConfig,
}
"""Section -> its model(s): a section's keys, for hints about unknown keys ("did you mean",
"it belongs under"). A component's ``shuffle``, ``source``... are those sections too."""
_TAGS = {"array_record", "parquet", "tensorstore", "ShuffleConfig", "BatchConfig", "PackConfig"}
_TYPE_TAGS = {"int", "str", "constrained-int"}  # names pydantic gives union branches in error locations


def _keys_of(section: str) -> list[str]:
    models = _SECTIONS.get(section, ())
    models = models if isinstance(models, tuple) else (models,)
    return sorted({k for m in models for k in m.model_fields})


def _section(parent: list) -> str:
    """The section (a key of :data:`_SECTIONS`) of the mapping at key path ``parent``."""
    if parent[:2] == ["mix", "components"] and len(parent) >= 3:
        if len(parent) == 3:
            return _COMPONENT
        parent = parent[3:]  # a component's own sections are those of the top level
    elif parent[:2] == ["mix", "schedule"]:
        return "mix.schedule"
    return str(parent[0]) if parent else ""


def _location(loc: tuple) -> list:
    """An error location without the names pydantic gives union branches; a component's
    name (whatever it is) is kept."""
    path: list = []
    for i, p in enumerate(loc):
        name = i == 2 and loc[:2] == ("mix", "components")
        if name or not (isinstance(p, str) and (p in _TAGS or "[" in p or p in _TYPE_TAGS)):
            path.append(p)
    return path


def _problems(err: ValidationError) -> list[str]:
    """One line per problem of ``err``: the key path, what is wrong, the value."""
    errors = [(_location(e["loc"]), e) for e in err.errors(include_url=False)]
    lines = []
    for path, e in errors:
        loc = ".".join(str(p) if isinstance(p, int) else clip(p, 60) for p in path)
        if e["type"] == "extra_forbidden":
            key = str(path[-1])
            section = _section(path[:-1])
            near = (
                [k for k in difflib.get_close_matches(key, _keys_of(section), n=2) if k != key] if len(key) < 60 else []
            )
            elsewhere = [s or "the top level" for s in _SECTIONS if s != section and key in _keys_of(s)]
            hint = (
                f"; did you mean {near[0]!r}?" if near else (f"; it belongs under {elsewhere[0]}" if elsewhere else "")
            )
            if section == _COMPONENT and key == "name":
                hint = "; a component's name is its key (in the list form of components, its name: entry)"
            lines.append(f"{loc}: unknown key {show(key)}{hint}")
            continue
        if any(len(p) > len(path) and p[: len(path)] == path for p, _ in errors):
            continue  # a union branch that failed on type: the deeper error says what is wrong
        if e["type"] == "value_error":  # our own validators: the message names the value already
            msg, got = e["msg"].removeprefix("Value error, "), ""
        else:  # pydantic's own messages may quote the input (a discriminator's tag): clipped
            msg, got = (
                clip(e["msg"], MAX_SHOWN + 100),
                "" if e["type"] == "missing" else f" (got {show(e.get('input'))})",
            )
            if e["type"] == "missing" and path == ["source"]:
                got = " (or a mix: section, for a mixture of named components)"
        lines.append(f"{loc or '(top level)'}: {msg}{got}")
    return lines


def _invalid(lines: list[str]) -> str:
    return bounded("invalid config:\n  " + "\n  ".join(dict.fromkeys(clip(line) for line in lines)))


def _explain(err: ValidationError) -> str:
    return _invalid(_problems(err))


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


def _validate(data: dict) -> PipelineConfig | MixPipelineConfig:
    """The config's schema checked: every problem in one :class:`ConfigError`."""
    if "mix" not in data:
        try:
            return PipelineConfig.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_explain(e)) from None
    lines = []
    for key, why in _NOT_WITH_MIX.items():
        given = key in data and (key in ("source", "seed") or data[key] is not None)
        if given and not (key == "row_transforms" and isinstance(data[key], list) and not data[key]):
            lines.append(f"{key}: {why}")
    try:
        cfg = MixPipelineConfig.model_validate({k: v for k, v in data.items() if k not in _NOT_WITH_MIX})
    except ValidationError as e:
        lines += _problems(e)
    if lines:
        raise ConfigError(_invalid(lines))
    return cfg


def _build(data: dict, base: str, process_count: int, policy: Policy) -> Pipeline:
    """The pipeline of a config read by :func:`_read` (messages without the file)."""
    cfg = _validate(data)
    size, drop = (cfg.batch, True) if isinstance(cfg.batch, int) else (cfg.batch.size, cfg.batch.drop_remainder)
    try:  # the one host-slice check
        host_rows(size, 0, process_count)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"batch: {e}") from None
    if isinstance(cfg, MixPipelineConfig):
        pipe = _mixture_of(cfg.mix, base, policy)
        pipe = _add_stages(pipe, cfg.transforms, "transforms", ("map", "random_map"), "batch_transforms", policy)
    elif cfg.pack is None:
        if cfg.row_transforms:
            raise ConfigError(
                "row_transforms: transforms of packed rows need a pack: section; "
                "put the transforms of records under transforms"
            )
        pipe = _leaf(cfg, base, policy, "")
    else:
        pack = PackConfig(seq_len=cfg.pack) if isinstance(cfg.pack, int) else cfg.pack
        for i, t in enumerate(cfg.transforms):  # before any scan: the lengths must not depend on positions
            if t.kind == "random_map":
                raise ConfigError(
                    f"transforms.{i}.kind: a random_map before pack: the lengths packing plans with must not "
                    "depend on the stream position; put it under row_transforms (on packed rows)"
                )
        pipe = _packed(_leaf(cfg, base, policy, ""), pack, base)
        pipe = _add_stages(
            pipe,
            cfg.row_transforms,
            "row_transforms",
            ("map", "random_map"),
            "batch_transforms",
            policy,
            filter_hint="filter the records before pack (under transforms)",
        )
    try:
        pipe = pipe.batch(size, drop_remainder=drop)
    except ValueError as e:
        raise ConfigError(_prefixed("batch", e)) from e
    return _add_stages(
        pipe, cfg.batch_transforms, "batch_transforms", ("map_batch", "random_map_batch"), "transforms", policy
    )


def _leaf(cfg: PipelineConfig | ComponentConfig, base: str, policy: Policy, where: str) -> Pipeline:
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


def _packed(pipe: Pipeline, cfg: PackConfig, base: str) -> Pipeline:
    """``pipe`` packed as the ``pack`` section says (its ``lengths`` file against ``base``)."""
    lengths = os.path.abspath(_path(cfg.lengths, base)) if cfg.lengths is not None else None
    if lengths is not None and not os.path.isfile(lengths):
        raise ConfigError(f"pack.lengths: no file {show(lengths)} (a .npy file of one integer per record)")
    try:
        packed = pipe.pack(cfg.seq_len, mode=cfg.mode, key=cfg.key, lengths=lengths)
    except ScanError as e:  # a record without tokens (no key, not 1-D): the data's error, said with its key
        raise ScanError(f"pack: {e}") from e.__cause__
    except (OSError, ValueError) as e:  # the file's (unreadable, or not this data's index), or no token at all
        if lengths is None or "hold no token" in str(e):
            raise ConfigError(_prefixed("pack", e)) from e
        if "length index" in str(e):  # pack's own check: names the file
            raise ConfigError(_prefixed("pack.lengths", e)) from e
        raise ConfigError(
            f"pack.lengths: cannot read {show(lengths)} as a .npy array: {type(e).__name__}: {clip(str(e))}"
        ) from e
    return packed


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
        name: _leaf(c, base, policy, f"mix.components.{clip(name, 60)}.") for name, c in cfg.components.items()
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
