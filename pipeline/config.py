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
with ``kwargs`` through ``functools.partial``, imported from the usual
``sys.path`` or, without ``PYTHONPATH``, from the config file's folder and the
current directory (:func:`_import_object`, the one place a config imports code).
Relative paths are relative to the config file (the current directory for a
dict). Validation (pydantic) reports every problem with its key path, the bad
value and what was expected, and suggests the nearest key for an unknown one; it
raises :class:`ConfigError`, whose message starts with the file's path when the
config is a file, and says each prefix (file, key path, source) once.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import cloudpickle
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from . import sources
from .dataset import Pipeline
from .dump import to_config
from .errors import ConfigError, SourceError
from .index import host_rows
from .registry import REGISTRY, register

__all__ = ["REGISTRY", "ConfigError", "load_config", "register", "to_config"]


# --------------------------------------------------------------------------- schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ArrayRecordConfig(_Model):
    type: Literal["array_record"]
    paths: str | list[str]
    name: str | None = None
    max_open_files: StrictInt = Field(256, ge=1)


class ParquetConfig(_Model):
    type: Literal["parquet"]
    paths: str | list[str]
    columns: list[str] | None = None
    name: str | None = None
    cache_bytes: StrictInt = Field(1 << 30, ge=1)
    cache_row_groups: StrictInt | None = Field(None, ge=1)


class TensorStoreConfig(_Model):
    type: Literal["tensorstore"]
    spec: str | dict[str, Any]
    name: str | None = None


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

    @model_validator(mode="after")
    def _one_of(self) -> TransformConfig:
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
    shuffle: Literal["global", "block"] | ShuffleConfig | None = None
    transforms: list[TransformConfig] = []
    batch: Annotated[StrictInt, Field(ge=1)] | BatchConfig
    batch_transforms: list[TransformConfig] = []


# --------------------------------------------------------------------------- loading


def _read(config: Any) -> tuple[dict, str, str | None]:
    """The config as a dict, the folder relative paths and modules are resolved
    against, and the file's path (``None`` for a dict). Messages name the file."""
    if isinstance(config, dict):
        return config, os.getcwd(), None
    path = os.fspath(config)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
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
            hint = (
                f"; did you mean {near[0]!r}?" if near else (f"; it belongs under {elsewhere[0]}" if elsewhere else "")
            )
            lines.append(f"{loc}: unknown key {key!r}{hint}")
            continue
        if any(len(p) > len(path) and p[: len(path)] == path for p, _ in errors):
            continue  # a union branch that failed on type: the deeper error says what is wrong
        if e["type"] == "value_error":  # our own validators: the message names the value already
            msg, got = e["msg"].removeprefix("Value error, "), ""
        else:
            msg, got = e["msg"], "" if e["type"] == "missing" else f" (got {e.get('input')!r})"
        lines.append(f"{loc or '(top level)'}: {msg}{got}")
    return "invalid config:\n  " + "\n  ".join(dict.fromkeys(lines))


def _prefixed(key: str, error: BaseException) -> str:
    """``"key: message"`` of ``error``, with ``key`` said once: not added when the
    message already starts with it (``source 'x' is empty``); a ``KeyError``'s
    message without the quotes its ``str`` adds."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return text if text.startswith((f"{key}:", f"{key} ")) else f"{key}: {text}"


def _on_sys_path(folder: str) -> bool:
    """Whether the absolute path ``folder`` is on ``sys.path`` (``""`` counting as the current directory)."""
    return any(os.path.abspath(p or os.curdir) == folder for p in sys.path)


def _inside(path: str, folder: str) -> bool:
    """Whether the file ``path`` lies under the absolute path ``folder``."""
    return os.path.abspath(path).startswith(folder.rstrip(os.sep) + os.sep)


def _import_object(spec: str, folders: Sequence[str]) -> Any:
    """The object a config's ``fn`` names, ``"package.module:qualname"``: the one
    place a config imports code (a policy of what a config may import belongs here).

    The module is imported as usual, except that ``folders`` (the config file's
    folder, then the current directory) are searched first: those not already on
    ``sys.path`` are put at its front while the import runs and taken off again,
    so the process's ``sys.path`` is left as it was. Modules that the import
    loaded from such a folder are registered with
    ``cloudpickle.register_pickle_by_value``: worker processes, which start with
    the parent's ``sys.path`` and could not import them, receive their code with
    the pipeline. A module that is already imported is used as it is (module
    names are global to a process: two configs cannot use two different
    ``mytransforms.py``). Not thread-safe against imports running concurrently."""
    module_name, _, qualname = spec.partition(":")
    added = [f for f in dict.fromkeys(os.path.abspath(f) for f in folders) if not _on_sys_path(f)]
    before = set(sys.modules)
    sys.path[:0] = added
    try:
        module = importlib.import_module(module_name)
    finally:
        for folder in added:
            sys.path.remove(folder)
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None)
        if file and any(_inside(file, f) for f in added):
            cloudpickle.register_pickle_by_value(sys.modules[name])
    return functools.reduce(getattr, qualname.split("."), module)


def _resolve(cfg: TransformConfig, where: str, folders: Sequence[str]) -> Callable:
    """The callable of one transform entry: a registered factory called with
    ``kwargs``, or the imported ``fn`` (see :func:`_import_object`) with ``kwargs``
    bound by ``functools.partial``."""
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
    assert cfg.fn is not None  # the schema asks for exactly one of name and fn
    try:
        fn = _import_object(cfg.fn, folders)
    except Exception as e:  # whatever importing user code raises (a SyntaxError too) is a config error
        raise ConfigError(f"{where}.fn: cannot import {cfg.fn!r}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"{where}.fn: {cfg.fn!r} is a {type(fn).__name__}, not a function")
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
            )
        spec = _path(cfg.spec, base) if isinstance(cfg.spec, str) else cfg.spec
        return sources.TensorStoreSource(spec, name=cfg.name)
    except (OSError, KeyError, ValueError, SourceError) as e:
        raise ConfigError(_prefixed("source", e)) from e


def load_config(config: Any, process_count: int = 1) -> Pipeline:
    """A :class:`Pipeline` from a config (a YAML or JSON file path, or a dict).

    ``process_count``: the number of hosts the pipeline will run on, checked to
    divide the batch size. Raises :class:`ConfigError` naming every problem, and
    the file first when ``config`` is one (each prefix said once). Relative data
    paths, and the modules of ``fn`` entries, are found from the config file's
    folder (the current directory for a dict); modules also from the current
    directory (see :func:`_import_object`)."""
    data, base, path = _read(config)
    try:
        return _build(data, base, process_count)
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"{path}: {e}").with_traceback(e.__traceback__) from e.__cause__


def _build(data: dict, base: str, process_count: int) -> Pipeline:
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
    folders = [base, os.getcwd()]
    pipe = _add_stages(pipe, cfg.transforms, "transforms", ("map", "random_map"), "batch_transforms", folders)
    try:
        pipe = pipe.batch(size, drop_remainder=drop)
    except ValueError as e:
        raise ConfigError(_prefixed("batch", e)) from e
    return _add_stages(
        pipe, cfg.batch_transforms, "batch_transforms", ("map_batch", "random_map_batch"), "transforms", folders
    )


def _add_stages(
    pipe: Pipeline,
    stages: list[TransformConfig],
    section: str,
    kinds: tuple[str, str],
    other: str,
    folders: Sequence[str],
) -> Pipeline:
    """``pipe`` with the stages of one config section; ``kinds``: its (plain, random) kinds."""
    for i, t in enumerate(stages):
        kind = t.kind or kinds[0]
        if kind not in kinds:
            raise ConfigError(f"{section}.{i}.kind: {kind!r} does not belong here; put it under {other}")
        fn = _resolve(t, f"{section}.{i}", folders)
        pipe = getattr(pipe, kind)(fn)
    return pipe
