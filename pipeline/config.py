"""Pipelines as configuration: YAML, JSON or a dict <-> :class:`Pipeline`.

A config names a source, the shuffle, the record transforms, the batch and the
batch transforms::

    source: {type: array_record, paths: "data/train-*.array_record"}
    seed: 0
    num_epochs: null            # endless
    shuffle: global             # or {mode: block, block: 1024, window: 8}, or null
    transforms:                 # record level, in order
      - {name: decode, kwargs: {dtype: int32}}
      - {name: pad, kwargs: {length: 512}}
      - {fn: "mytransforms:mask_some", kind: random_map, kwargs: {rate: 0.1}}
    batch: {size: 256, drop_remainder: true}
    batch_transforms:           # batch level, in order (kind map_batch or random_map_batch)
      - {fn: "mypackage.lm:shift"}

``name`` is a registered transform (:data:`REGISTRY`, extend it with
:func:`register`); ``fn`` is user code as ``"package.module:function"``, called
with ``kwargs`` through ``functools.partial``. Relative paths are relative to
the config file (the current directory for a dict). Validation (pydantic)
reports every problem with its key path, the bad value and what was expected,
and suggests the nearest key for an unknown one; it raises :class:`ConfigError`,
whose message starts with the file's path when the config is a file, and says
each prefix (file, key path, source) once.

What a config may import is :mod:`quern.pipeline.trust`'s rule; the limits on
what a config file can make quern do are :mod:`quern.pipeline.limits`'.
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
from .errors import ConfigError, SourceError
from .index import host_rows
from .limits import MAX_BYTES, MAX_KEYS, MAX_SHOWN, MAX_STAGES, Loader, bounded, clip, measure, object_children, show
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
    kind: Literal["map", "random_map", "map_batch", "random_map_batch"] | None = None
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


class PipelineConfig(_Model):
    source: SourceConfig
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    num_epochs: StrictInt | None = Field(None, ge=1)
    shuffle: Literal["global", "block"] | ShuffleConfig | None = None
    transforms: Annotated[list[TransformConfig], Field(max_length=MAX_STAGES)] = []
    batch: Annotated[StrictInt, Field(ge=1)] | BatchConfig
    batch_transforms: Annotated[list[TransformConfig], Field(max_length=MAX_STAGES)] = []


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
            f"{path}: the top level must be a mapping of keys (source, batch, ...), got {type(data).__name__}"
        )
    return data, os.path.dirname(os.path.abspath(path)), path


_SECTIONS = {
    "": PipelineConfig,
    "shuffle": ShuffleConfig,
    "batch": BatchConfig,
    "transforms": TransformConfig,
    "batch_transforms": TransformConfig,
    "source": (ArrayRecordConfig, ParquetConfig, TensorStoreConfig),
}
_TAGS = {"array_record", "parquet", "tensorstore", "ShuffleConfig", "BatchConfig"}
_TYPE_TAGS = {"int", "str", "constrained-int"}  # names pydantic gives union branches in error locations


def _keys_of(section: str) -> list[str]:
    models = _SECTIONS.get(section, ())
    models = models if isinstance(models, tuple) else (models,)
    return sorted({k for m in models for k in m.model_fields})


def _explain(err: ValidationError) -> str:
    errors = []
    for e in err.errors(include_url=False):
        path = [p for p in e["loc"] if not (isinstance(p, str) and (p in _TAGS or "[" in p or p in _TYPE_TAGS))]
        errors.append((path, e))
    lines = []
    for path, e in errors:
        loc = ".".join(str(p) if isinstance(p, int) else clip(p, 60) for p in path)
        if e["type"] == "extra_forbidden":
            key = str(path[-1])
            section = str(path[0]) if len(path) > 1 else ""
            near = (
                [k for k in difflib.get_close_matches(key, _keys_of(section), n=2) if k != key] if len(key) < 60 else []
            )
            elsewhere = [s or "the top level" for s in _SECTIONS if s != section and key in _keys_of(s)]
            hint = (
                f"; did you mean {near[0]!r}?" if near else (f"; it belongs under {elsewhere[0]}" if elsewhere else "")
            )
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
        lines.append(f"{loc or '(top level)'}: {msg}{got}")
    return bounded("invalid config:\n  " + "\n  ".join(dict.fromkeys(clip(line) for line in lines)))


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


def _source(cfg: ArrayRecordConfig | ParquetConfig | TensorStoreConfig, base: str) -> sources.Source:
    """The source a ``source`` section describes, its relative paths against ``base``."""
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
        raise ConfigError(_prefixed("source", e)) from e


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
    the config file's folder (the current directory for a dict)."""
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


def _build(data: dict, base: str, process_count: int, policy: Policy) -> Pipeline:
    """The pipeline of a config read by :func:`_read` (messages without the file)."""
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None
    size, drop = (cfg.batch, True) if isinstance(cfg.batch, int) else (cfg.batch.size, cfg.batch.drop_remainder)
    try:  # the one host-slice check
        host_rows(size, 0, process_count)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"batch: {e}") from None
    source = _source(cfg.source, base)
    try:
        pipe = Pipeline.from_source(source, seed=cfg.seed, num_epochs=cfg.num_epochs)
    except ValueError as e:
        raise ConfigError(_prefixed("source", e)) from e
    if cfg.shuffle is not None:
        sh = ShuffleConfig.model_validate({"mode": cfg.shuffle}) if isinstance(cfg.shuffle, str) else cfg.shuffle
        pipe = pipe.shuffle(sh.mode, block=sh.block, window=sh.window)
    pipe = _add_stages(pipe, cfg.transforms, "transforms", ("map", "random_map"), "batch_transforms", policy)
    try:
        pipe = pipe.batch(size, drop_remainder=drop)
    except ValueError as e:
        raise ConfigError(_prefixed("batch", e)) from e
    return _add_stages(
        pipe, cfg.batch_transforms, "batch_transforms", ("map_batch", "random_map_batch"), "transforms", policy
    )


def _add_stages(
    pipe: Pipeline,
    stages: list[TransformConfig],
    section: str,
    kinds: tuple[str, str],
    other: str,
    policy: Policy,
) -> Pipeline:
    """``pipe`` with the stages of one config section; ``kinds``: its (plain, random) kinds."""
    for i, t in enumerate(stages):
        kind = t.kind or kinds[0]
        if kind not in kinds:
            raise ConfigError(f"{section}.{i}.kind: {kind!r} does not belong here; put it under {other}")
        fn = _resolve(t, f"{section}.{i}", policy)
        pipe = getattr(pipe, kind)(fn)
    return pipe
