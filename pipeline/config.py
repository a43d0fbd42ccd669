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
import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
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


def _npy_path(value: str | None) -> str | None:
    """A length index's file: a path (non-empty, at most 4096 characters) or ``None``."""
    if value is not None and (not value or len(value) > 4096):
        raise ValueError(f"must be the path of a .npy file, got {show(value)}")
    return value


class PackConfig(_Model):
    seq_len: StrictInt = Field(ge=1)
    mode: Literal["best_fit", "concat"] = "best_fit"
    key: str | None = None
    lengths: str | None = None

    _file = field_validator("lengths")(_npy_path)


Pack = Annotated[StrictInt, Field(ge=1)] | PackConfig


def _positive_ints(value: Any) -> Any:
    """A list of integers >= 1 as it is; otherwise an error naming the first item that
    is not one (pydantic would report each: as many errors as items)."""
    if isinstance(value, list):
        bad = [i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(
                f"item {bad[0]} is not an integer >= 1: {show(value[bad[0]])}"
                + (f" ({len(bad):,} items are not)" if len(bad) > 1 else "")
            )
    return value


class BucketConfig(_Model):
    """Length buckets (:meth:`Pipeline.bucket`): the upper bound and batch size of each bucket."""

    boundaries: Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_COMPONENTS)]
    batch_sizes: Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_COMPONENTS)]
    key: str | None = None
    pad_value: StrictInt | StrictFloat = 0
    block: StrictInt = Field(_mixture.BLOCK, ge=1)
    lengths: str | None = None

    _ints = field_validator("boundaries", "batch_sizes", mode="before")(_positive_ints)
    _file = field_validator("lengths")(_npy_path)

    @field_validator("pad_value", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number (the value of padding tokens), got {show(value)}")
        return value

    @field_validator("boundaries")
    @classmethod
    def _increasing(cls, value: list[int]) -> list[int]:
        for i in range(1, len(value)):
            if value[i] <= value[i - 1]:
                raise ValueError(
                    f"must be increasing, got {show(value)}: item {i} ({value[i]}) is not above item {i - 1} "
                    f"({value[i - 1]}); each is the longest length of its bucket"
                )
        return value

    @field_validator("batch_sizes")
    @classmethod
    def _one_per_bucket(cls, value: list[int], info: ValidationInfo) -> list[int]:
        bounds = info.data.get("boundaries")
        if bounds is not None and len(value) != len(bounds):
            raise ValueError(
                f"{len(value)} batch sizes for {len(bounds)} buckets (boundaries {show(bounds)}); give one per bucket"
            )
        return value


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


class BucketPipelineConfig(_Model):
    """A single-source config batched by length buckets (``bucket:``) instead of ``batch:``."""

    source: SourceConfig
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    num_epochs: None = None
    shuffle: Shuffle = None
    transforms: Stages = []
    bucket: BucketConfig
    batch_transforms: Stages = []

    @field_validator("num_epochs", mode="before")
    @classmethod
    def _endless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                f"must be null, got {show(value)}: a bucketed stream is endless "
                "(each bucket repeats and reshuffles its records on its own epochs)"
            )
        return value


_NOT_WITH_BUCKET = {
    "batch": "bucket makes the batches (bucket.batch_sizes, one size per bucket); give either batch or bucket, not both",
    "pack": "give either pack (rows of seq_len tokens) or bucket (records padded to their bucket's bound), not both",
    "row_transforms": "transforms of packed rows; a bucketed config is not packed (record transforms go under "
    "transforms, transforms of the padded batches under batch_transforms)",
}
"""Keys of a single-source config that a ``bucket:`` config refuses, and why (``batch: null``,
``pack: null`` and ``row_transforms: []`` are none: let through)."""


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


class ComponentConfig(_Model):
    """One component of a mixture: a pipeline without batch, endless; packed or not."""

    source: SourceConfig
    seed: StrictInt = Field(0, ge=0, lt=2**64)
    num_epochs: None = None
    shuffle: Shuffle = None
    transforms: Stages = []
    pack: Pack | None = None
    row_transforms: Stages = []

    @field_validator("num_epochs", mode="before")
    @classmethod
    def _endless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                f"must be null, got {show(value)}: the components of a mixture are endless "
                "(each repeats and reshuffles on its own epochs)"
            )
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
    "pack": "a mixture is not packed itself: pack its components (mix.components.<name>.pack), then batch the "
    "mixture of their rows",
    "row_transforms": "transforms of packed rows belong to a packed component "
    "(mix.components.<name>.row_transforms); the mixture's own transforms go under transforms",
    "bucket": "length buckets are for a single source (source:, bucket:); batch a mixture with batch:",
}
"""Top-level keys of a single-source config that a ``mix:`` config refuses, and why
(``pack: null``, ``bucket: null`` and ``row_transforms: []`` are none: let through)."""


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
    "": (PipelineConfig, MixPipelineConfig, BucketPipelineConfig),
    "shuffle": ShuffleConfig,
    "batch": BatchConfig,
    "transforms": TransformConfig,
    "batch_transforms": TransformConfig,
    "source": (ArrayRecordConfig, ParquetConfig, TensorStoreConfig),
    "mix": MixConfig,
    "pack": PackConfig,
    "row_transforms": TransformConfig,
    "bucket": BucketConfig,
    _COMPONENT: ComponentConfig,
    "mix.schedule": StageConfig,
}
"""Section -> its model(s): a section's keys, for hints about unknown keys ("did you mean",
"it belongs under"). A component's ``shuffle``, ``source``... are those sections too."""
_TAGS = {"array_record", "parquet", "tensorstore", "ShuffleConfig", "BatchConfig", "PackConfig"}
_TYPE_TAGS = {"int", "str", "float", "constrained-int"}  # names pydantic gives union branches in error locations


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


def _problems(err: ValidationError, bucket_hint: bool = False) -> list[str]:
    """One line per problem of ``err``: the key path, what is wrong, the value
    (``bucket_hint``: a missing ``batch`` says that ``bucket`` may batch instead)."""
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
            if e["type"] == "missing" and path == ["batch"] and bucket_hint:
                got = " (or a bucket: section, for batches of length buckets)"
        lines.append(f"{loc or '(top level)'}: {msg}{got}")
    return lines


def _invalid(lines: list[str]) -> str:
    return bounded("invalid config:\n  " + "\n  ".join(dict.fromkeys(clip(line) for line in lines)))


def _explain(err: ValidationError, bucket_hint: bool = False) -> str:
    return _invalid(_problems(err, bucket_hint))


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


def _refused(data: dict, refused: dict[str, str], always: tuple[str, ...] = ()) -> list[str]:
    """``"key: why"`` for each key of ``refused`` that ``data`` gives: present and not
    null (the keys of ``always``: present at all), ``row_transforms`` not an empty list."""
    lines = []
    for key, why in refused.items():
        given = key in data and (key in always or data[key] is not None)
        if given and not (key == "row_transforms" and isinstance(data[key], list) and not data[key]):
            lines.append(f"{key}: {why}")
    return lines


def _validate(data: dict) -> PipelineConfig | MixPipelineConfig | BucketPipelineConfig:
    """The config's schema checked: every problem in one :class:`ConfigError`."""
    model: type[MixPipelineConfig] | type[BucketPipelineConfig]
    if "mix" in data:
        model, refused = MixPipelineConfig, _NOT_WITH_MIX
        lines = _refused(data, _NOT_WITH_MIX, ("source", "seed"))
    elif data.get("bucket") is not None:
        model, refused = BucketPipelineConfig, _NOT_WITH_BUCKET
        lines = _refused(data, _NOT_WITH_BUCKET)
    else:
        try:
            return PipelineConfig.model_validate({k: v for k, v in data.items() if k != "bucket"})
        except ValidationError as e:
            raise ConfigError(_explain(e, bucket_hint=True)) from None
    try:
        cfg = model.model_validate({k: v for k, v in data.items() if k not in refused})
    except ValidationError as e:
        lines += _problems(e)
    if lines:
        raise ConfigError(_invalid(lines))
    return cfg


def _build(data: dict, base: str, process_count: int, policy: Policy) -> Pipeline:
    """The pipeline of a config read by :func:`_read` (messages without the file)."""
    cfg = _validate(data)
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
