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
      - {fn: "mypackage.augment:mask_some", kind: random_map, kwargs: {rate: 0.1}}
    batch: {size: 256, drop_remainder: true}
    batch_transforms:           # batch level, in order (kind map_batch or random_map_batch)
      - {fn: "mypackage.lm:shift"}

``name`` is a registered transform (:data:`REGISTRY`, extend it with
:func:`register`); ``fn`` is user code as ``"package.module:function"``, called
with ``kwargs`` through ``functools.partial``. Relative paths are relative to
the config file. Validation (pydantic) reports every problem with its key path,
the bad value and what was expected, and suggests the nearest key for an
unknown one; it raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import json
import os
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from .dump import to_config
from .errors import ConfigError
from .registry import REGISTRY, register

__all__ = ["load_config", "to_config", "register", "REGISTRY", "ConfigError"]


# --------------------------------------------------------------------------- schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ArrayRecordConfig(_Model):
    type: Literal["array_record"]
    paths: Union[str, list[str]]
    name: str | None = None
    max_open_files: StrictInt = Field(256, ge=1)


class ParquetConfig(_Model):
    type: Literal["parquet"]
    paths: Union[str, list[str]]
    columns: list[str] | None = None
    name: str | None = None
    cache_bytes: StrictInt = Field(1 << 30, ge=1)
    cache_row_groups: StrictInt | None = Field(None, ge=1)


class TensorStoreConfig(_Model):
    type: Literal["tensorstore"]
    spec: Union[str, dict[str, Any]]
    name: str | None = None


SourceConfig = Annotated[Union[ArrayRecordConfig, ParquetConfig, TensorStoreConfig], Field(discriminator="type")]


class ShuffleConfig(_Model):
    mode: Literal["global", "block"] = "global"
    block: StrictInt | None = Field(None, ge=1)
    window: StrictInt = Field(8, ge=1)


class TransformConfig(_Model):
    name: str | None = None
    fn: str | None = None
    kind: Literal["map", "random_map", "map_batch", "random_map_batch"] | None = None
    kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_of(self) -> "TransformConfig":
        if (self.name is None) == (self.fn is None):
            raise ValueError("give exactly one of 'name' (a registered transform) or 'fn' ('package.module:function')")
        if self.fn is not None and not all(self.fn.partition(":")[::2]):
            raise ValueError(f"fn must look like 'package.module:function', got {self.fn!r}")
        return self


class BatchConfig(_Model):
    size: StrictInt = Field(ge=1)
    drop_remainder: bool = True


class PipelineConfig(_Model):
    source: SourceConfig
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    num_epochs: StrictInt | None = Field(None, ge=1)
    shuffle: Union[Literal["global", "block"], ShuffleConfig, None] = None
    transforms: list[TransformConfig] = []
    batch: Union[Annotated[StrictInt, Field(ge=1)], BatchConfig]
    batch_transforms: list[TransformConfig] = []


# --------------------------------------------------------------------------- loading


def _read(config: Any) -> tuple[dict, str]:
    """The config as a dict, and the folder relative paths are resolved against."""
    if isinstance(config, dict):
        return config, os.getcwd()
    path = os.fspath(config)
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path!r}")
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from e
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys (source, batch, ...), got {type(data).__name__}")
    return data, os.path.dirname(os.path.abspath(path))


_SECTIONS = {
    "": PipelineConfig, "shuffle": ShuffleConfig, "batch": BatchConfig,
    "transforms": TransformConfig, "batch_transforms": TransformConfig,
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
    for e in err.errors():
        path = [p for p in e["loc"] if not (isinstance(p, str) and (p in _TAGS or "[" in p or p in _TYPE_TAGS))]
        errors.append((path, e))
    lines = []
    for path, e in errors:
        loc = ".".join(map(str, path))
        if e["type"] == "extra_forbidden":
            key = str(path[-1])
            section = str(path[0]) if len(path) > 1 else ""
            near = [k for k in difflib.get_close_matches(key, _keys_of(section), n=2) if k != key]
            elsewhere = [s or "the top level" for s in _SECTIONS if s != section and key in _keys_of(s)]
            hint = f"; did you mean {near[0]!r}?" if near else (f"; it belongs under {elsewhere[0]}" if elsewhere else "")
            lines.append(f"{loc}: unknown key {key!r}{hint}")
            continue
        if any(len(p) > len(path) and p[: len(path)] == path for p, _ in errors):
            continue  # a union branch that failed on type: the deeper error says what is wrong
        got = "" if e["type"] == "missing" else f" (got {e.get('input')!r})"
        lines.append(f"{loc or '(top level)'}: {e['msg']}{got}")
    return "invalid config:\n  " + "\n  ".join(dict.fromkeys(lines))


def _resolve(cfg: TransformConfig, where: str) -> Callable:
    if cfg.name is not None:
        registry = REGISTRY
        if cfg.name not in registry:
            near = difflib.get_close_matches(cfg.name, registry, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{where}.name: no registered transform {cfg.name!r} (known: {sorted(registry)}){hint}")
        try:
            return registry[cfg.name](**cfg.kwargs)
        except Exception as e:
            raise ConfigError(f"{where}.kwargs: {cfg.name}({cfg.kwargs}) failed: {type(e).__name__}: {e}") from e
    module, _, qualname = cfg.fn.partition(":")
    try:
        fn = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}.fn: cannot import {cfg.fn!r}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"{where}.fn: {cfg.fn!r} is a {type(fn).__name__}, not a function")
    return functools.partial(fn, **cfg.kwargs) if cfg.kwargs else fn


def _path(p: str, base: str) -> str:
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) or "://" in p else os.path.join(base, p)


def _source(cfg, base: str):
    from . import sources

    try:
        if cfg.type == "array_record":
            paths = [_path(p, base) for p in ([cfg.paths] if isinstance(cfg.paths, str) else cfg.paths)]
            return sources.ArrayRecordSource(paths, name=cfg.name, max_open_files=cfg.max_open_files)
        if cfg.type == "parquet":
            paths = [_path(p, base) for p in ([cfg.paths] if isinstance(cfg.paths, str) else cfg.paths)]
            return sources.ParquetSource(paths, columns=cfg.columns, name=cfg.name, cache_bytes=cfg.cache_bytes,
                                         cache_row_groups=cfg.cache_row_groups)
        spec = _path(cfg.spec, base) if isinstance(cfg.spec, str) else cfg.spec
        return sources.TensorStoreSource(spec, name=cfg.name)
    except (FileNotFoundError, KeyError, ValueError, sources.SourceError) as e:
        raise ConfigError(f"source: {e}") from e


def load_config(config: Any, process_count: int = 1):
    """A :class:`Pipeline` from a config (a YAML or JSON file path, or a dict).

    ``process_count``: the number of hosts the pipeline will run on, checked to
    divide the batch size. Raises :class:`ConfigError` naming every problem."""
    from .dataset import Pipeline

    data, base = _read(config)
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None
    size, drop = (cfg.batch, True) if isinstance(cfg.batch, int) else (cfg.batch.size, cfg.batch.drop_remainder)
    if isinstance(process_count, bool) or not isinstance(process_count, int) or process_count < 1:
        raise ConfigError(f"the host count must be a positive integer, got {process_count!r}")
    if size % process_count:
        raise ConfigError(f"batch: the batch size {size} is not divisible by the host count {process_count}")
    try:
        pipe = Pipeline.from_source(_source(cfg.source, base), seed=cfg.seed, num_epochs=cfg.num_epochs)
    except ValueError as e:
        raise ConfigError(f"source: {e}") from e
    if cfg.shuffle is not None:
        sh = ShuffleConfig(mode=cfg.shuffle) if isinstance(cfg.shuffle, str) else cfg.shuffle
        pipe = pipe.shuffle(sh.mode, block=sh.block, window=sh.window)
    pipe = _add_stages(pipe, cfg.transforms, "transforms", ("map", "random_map"), "batch_transforms")
    try:
        pipe = pipe.batch(size, drop_remainder=drop)
    except ValueError as e:
        raise ConfigError(f"batch: {e}") from e
    return _add_stages(pipe, cfg.batch_transforms, "batch_transforms", ("map_batch", "random_map_batch"), "transforms")


def _add_stages(pipe, stages: list[TransformConfig], section: str, kinds: tuple[str, str], other: str):
    """``pipe`` with the stages of one config section; ``kinds``: its (plain, random) kinds."""
    for i, t in enumerate(stages):
        kind = t.kind or kinds[0]
        if kind not in kinds:
            raise ConfigError(f"{section}.{i}.kind: {kind!r} does not belong here; put it under {other}")
        fn = _resolve(t, f"{section}.{i}")
        pipe = getattr(pipe, kind)(fn)
    return pipe
