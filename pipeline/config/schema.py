"""The config format: what a pipeline config may hold, as pydantic models.

Each model is one section of a config and each field one key, with its type,
default and meaning in ``Field(description=...)`` (the documentation's config
reference is generated from them). Three top-level forms exist: one source
(:class:`PipelineConfig`), a mixture of named components
(:class:`MixPipelineConfig`) and length buckets (:class:`BucketPipelineConfig`).
The models only check values; :func:`quern.pipeline.config.validate.validate`
picks the form and says every problem, and
:mod:`quern.pipeline.config.load` builds the pipeline.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..order import components as _mixture
from .edits import EXCLUDE_HELP, SKIP_HELP, ExcludeConfig, SkipConfig
from .limits import MAX_COMPONENTS, MAX_SCHEDULE, MAX_SHOWN, MAX_STAGES, show
from .sections import Section, first_bad, null, string_keys
from .source_keys import (
    ArrayRecordConfig,
    FileSourceConfig,
    JsonlConfig,
    ParquetConfig,
    SourceConfig,
    TensorStoreConfig,
    TFRecordConfig,
    WebDatasetConfig,
)
from .trust import FN, FN_FORM, IDENT, MODULE

__all__ = [
    "ArrayRecordConfig",
    "BatchConfig",
    "BucketConfig",
    "BucketPipelineConfig",
    "ComponentConfig",
    "FileSourceConfig",
    "JsonlConfig",
    "MixConfig",
    "MixPipelineConfig",
    "PackConfig",
    "ParquetConfig",
    "PipelineConfig",
    "ShuffleConfig",
    "StageConfig",
    "TFRecordConfig",
    "TensorStoreConfig",
    "TransformConfig",
    "WebDatasetConfig",
]


# --------------------------------------------------------------------------- order, stages, batch


class ShuffleConfig(Section):
    """``shuffle: {mode: ..., block: ..., window: ...}``: a new permutation each epoch (:meth:`Pipeline.shuffle`).

    ``shuffle: global`` and ``shuffle: block`` are this mapping's ``mode`` alone.
    """

    mode: Literal["global", "block"] = Field(
        default="global",
        description="``global`` (the default: a keyed bijection over all records) or ``block`` (blocks of "
        "consecutive records permuted, then shuffled within windows of blocks: reads stay local).",
    )
    block: StrictInt | None = Field(
        default=None,
        ge=1,
        description="``block`` mode: records per block, an integer >= 1 (null, the default: the source's "
        "row-group size).",
    )
    window: StrictInt = Field(default=8, ge=1, description="``block`` mode: blocks per shuffle window, default 8.")


class TransformConfig(Section):
    """One stage: ``{name: ..., kwargs: ...}`` (a registered transform) or ``{fn: ..., kind: ..., kwargs: ...}``.

    An ``fn`` names user code; what it may name is :mod:`quern.pipeline.config.trust`'s
    rule: registered transforms, modules in the config's own folder, and modules under the
    prefixes the user allows (``--allow``, ``QUERN_ALLOW``, ``load_config(allow=...)``).
    """

    name: str | None = Field(
        default=None,
        description="A registered transform (``REGISTRY``: decode, pad, ...; Python code extends it with "
        "``register``), called with ``kwargs``. Give exactly one of name and fn.",
    )
    fn: str | None = Field(
        default=None,
        description='User code as ``"package.module:function"`` (dotted ASCII names; no relative import, no '
        "private or dunder name), called with ``kwargs`` bound by ``functools.partial``.",
    )
    kind: (
        Literal[
            "map",
            "random_map",
            "filter",
            "flat_map",
            "map_batch",
            "random_map_batch",
            "map_device",
            "random_map_device",
        ]
        | None
    ) = Field(
        default=None,
        description="Record stages (``transforms``): ``map`` (the default), ``random_map`` (``fn(record, rng)``), "
        "``filter`` (keeps the records for which ``fn(record, **kwargs)`` is true: loading the config scans "
        "the records once, or finds the survivors in the cache, ``$QUERN_CACHE_DIR`` else ``~/.cache/quern``; "
        "a filter comes before any random_map) or ``flat_map`` (``fn(record, **kwargs)`` returns a list of "
        "records, which replace it: loading the config counts them once, cached as a filter's survivors; it "
        "comes before any random_map). Packed rows (``row_transforms``): ``map`` or ``random_map``. "
        "Batch stages (``batch_transforms``): ``map_batch`` (the default) or ``random_map_batch``, then the "
        "device stages ``map_device`` and ``random_map_device`` (run on the global arrays by quern.sharding).",
    )
    kwargs: dict[str, Any] = Field(
        default={}, description="Keyword arguments of the transform (a mapping with string keys; default none)."
    )

    _kwargs = field_validator("kwargs", mode="before")(string_keys)

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


class BatchConfig(Section):
    """``batch: {size: ..., drop_remainder: ...}`` (``batch: N`` is ``{size: N}``)."""

    size: StrictInt = Field(
        ge=1,
        description="Rows per step over all hosts (the global batch size), an integer >= 1 divisible by the host "
        "count; rows are records, or packed rows with ``pack``.",
    )
    drop_remainder: bool = Field(
        default=True, description="Default true: with a finite num_epochs, drop the last partial batch."
    )
    pad_remainder: bool = Field(
        default=False,
        description="Pad the last partial batch to whole batches instead (with ``drop_remainder: false``): every "
        "batch gets a boolean leaf ``valid``, and every host gets its share of rows of every step (evaluation).",
    )
    pad_value: StrictInt | float = Field(default=0, description="The value of the padding rows (default 0).")


Stages = Annotated[list[TransformConfig], Field(max_length=MAX_STAGES)]
Shuffle = Literal["global", "block"] | ShuffleConfig | None
Batch = Annotated[StrictInt, Field(ge=1)] | BatchConfig

_LENGTHS = (
    "The records' length index: a .npy file (relative to the config file's folder) of one integer per record of "
    "the source (records a filter drops: any value), checked against a sample of records. Null (the default): "
    "scanned once when the config loads and cached (``$QUERN_CACHE_DIR``, folder ``lengths/``). Its content is "
    "part of the fingerprint, not where it came from."
)
_KEY = "The value of a dict record that holds its tokens (null, the default: each record is a 1-D token array)."


def _npy_path(value: str | None) -> str | None:
    """A length index's file: a path (non-empty, at most 4096 characters) or ``None``."""
    if value is not None and (not value or len(value) > 4096):
        raise ValueError(f"must be the path of a .npy file, got {show(value)}")
    return value


class PackConfig(Section):
    """``pack: {seq_len: ..., mode: ..., key: ..., lengths: ...}``: the records packed into rows of ``seq_len`` tokens.

    ``pack: N`` is ``{seq_len: N}``. The records are packed after ``transforms``
    (:meth:`Pipeline.pack`). A row is ``{tokens, segment_ids, positions}`` plus the
    packed copies of the record's other per-token arrays. The record ``transforms`` before it
    may filter but not random_map (the lengths it plans with must not depend on the stream
    position: put a random_map under ``row_transforms``).
    """

    seq_len: Annotated[StrictInt, Field(ge=1)] | dict[str, Annotated[StrictInt, Field(ge=1)]] = Field(
        description="The row length in tokens, an integer >= 1; or one per column (``{inputs: 512, targets: 512}``): "
        "the columns are packed together into ``KEY``, ``KEY_segment_ids`` and ``KEY_positions``."
    )
    mode: Literal["best_fit", "concat", "first_fit"] = Field(
        default="best_fit",
        description="``best_fit`` (the default: whole documents placed by best-fit decreasing, rows in a keyed "
        "random order), ``concat`` (documents concatenated in stream order and cut) or ``first_fit`` (whole "
        "documents in stream order into the first of ``num_bins`` rows with room: grain's first-fit packer).",
    )
    key: str | None = Field(default=None, description=_KEY)
    lengths: str | None = Field(default=None, description=_LENGTHS)
    num_bins: StrictInt | None = Field(default=None, ge=1, description="``first_fit``: rows per packing batch.")
    max_sequences_per_bin: StrictInt | None = Field(
        default=None, ge=1, description="``first_fit``: documents per row at most (default: no limit)."
    )
    pad_value: StrictInt | float | dict[str, StrictInt | float] = Field(
        default=0, description="The padding of the packed tokens: one number, or one per column (default 0)."
    )

    _file = field_validator("lengths")(_npy_path)


Pack = Annotated[StrictInt, Field(ge=1)] | PackConfig


def _positive_ints(value: Any) -> Any:
    """A list of integers >= 1 as it is; otherwise an error naming the first item that is not one.

    Pydantic would report each: as many errors as items.
    """
    if isinstance(value, list):
        bad = [i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise first_bad(bad, f"item {bad[0]} is not an integer >= 1: {show(value[bad[0]])}", "items are not")
    return value


class BucketConfig(Section):
    """``bucket:``, instead of ``batch:``: every step a batch of records from one bucket of lengths.

    The records are padded to the bucket's upper bound (:meth:`Pipeline.bucket`: few static shapes).
    A step's batch is ``{tokens, length}`` (shape ``(batch_size, bound)``) plus the records'
    other fields as they are (drop or pad other variable-length fields before). Steps go to
    buckets in proportion to records per batch, so every bucket goes through its records at
    the same pace; each bucket has its own epochs: the stream is endless. The record
    ``transforms`` before it may filter but not random_map (randomize the padded batches with
    a random_map_batch under ``batch_transforms``).
    """

    boundaries: Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_COMPONENTS)] = Field(
        description="Increasing lengths >= 1: bucket b holds lengths in (boundaries[b-1], boundaries[b]]; "
        "records longer than the last go to the last bucket, truncated to it."
    )
    batch_sizes: Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_COMPONENTS)] = Field(
        description="Rows per step of each bucket, one per boundary, each divisible by the host count."
    )
    key: str | None = Field(default=None, description=_KEY)
    pad_value: StrictInt | StrictFloat = Field(
        default=0, description="The value of padding tokens, a number (default 0)."
    )
    block: StrictInt = Field(
        default=_mixture.BLOCK,
        ge=1,
        description=f"Steps per block of the assignment of steps to buckets, default {_mixture.BLOCK}.",
    )
    lengths: str | None = Field(default=None, description=_LENGTHS)

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


# --------------------------------------------------------------------------- top levels and components

_SEED = "The seed of the shuffle and of random stages, an integer in [0, 2**64), default 0."
_SHUFFLE = "``global``, ``block``, a shuffle section, or null (the default: the source's order)."
_TRANSFORMS = "Record stages, in order (kind ``map``, the default, ``random_map`` or ``filter``); default none."
_ROW_TRANSFORMS = (
    "Stages of the packed rows, in order (kind ``map``, the default, or ``random_map``); needs ``pack``; default none."
)
_BATCH_TRANSFORMS = (
    "Batch stages, in order, on each host's collated batch (kind ``map_batch``, the default, or "
    "``random_map_batch``), then the device stages (``map_device``, ``random_map_device``: run on the global "
    "arrays by quern.sharding); default none."
)
_PACK = (
    "Pack the records into rows: ``seq_len`` alone (best_fit, records are token arrays) or a pack section; "
    "null (the default): not packed."
)


class PipelineConfig(Section):
    """A single-source config: ``source``, the order, the record stages, packing, the batch and the batch stages.

    Relative paths are relative to the config file's folder (the current
    directory for a dict config).

    Example:
        >>> cfg = PipelineConfig.model_validate({"source": {"type": "array_record", "paths": "d/*"}, "batch": 8})
        >>> cfg.batch, cfg.shuffle, cfg.source.max_open_files
        (8, None, 256)
    """

    source: SourceConfig
    seed: StrictInt = Field(default=0, ge=0, lt=2**64, description=_SEED)
    num_epochs: StrictInt | None = Field(
        default=None, ge=1, description="Passes over the records, an integer >= 1; null (the default): endless."
    )
    shuffle: Shuffle = Field(default=None, description=_SHUFFLE)
    transforms: Stages = Field(default=[], description=_TRANSFORMS)
    pack: Pack | None = Field(default=None, description=_PACK)
    row_transforms: Stages = Field(default=[], description=_ROW_TRANSFORMS)
    batch: Batch = Field(
        description="Rows per step (an integer >= 1) or a batch section; with pack, rows are packed rows."
    )
    batch_transforms: Stages = Field(default=[], description=_BATCH_TRANSFORMS)
    skip: list[SkipConfig] = Field(default=[], description=SKIP_HELP)
    exclude: list[ExcludeConfig] = Field(default=[], description=EXCLUDE_HELP)


class BucketPipelineConfig(Section):
    """A single-source config batched by length buckets (``bucket:``) instead of ``batch:``.

    It has no ``batch``, ``pack``, ``row_transforms`` or ``mix``.
    """

    source: SourceConfig
    seed: StrictInt = Field(default=0, ge=0, lt=2**64, description=_SEED)
    num_epochs: None = Field(default=None, description="Null if given: a bucketed stream is endless.")
    shuffle: Shuffle = Field(default=None, description=_SHUFFLE)
    transforms: Stages = Field(default=[], description=_TRANSFORMS + " They may filter but not random_map.")
    bucket: BucketConfig = Field(description="The length buckets that make the batches.")
    batch_transforms: Stages = Field(default=[], description=_BATCH_TRANSFORMS)
    skip: list[SkipConfig] = Field(default=[], description=SKIP_HELP)
    exclude: list[ExcludeConfig] = Field(default=[], description=EXCLUDE_HELP)

    _endless = field_validator("num_epochs", mode="before")(
        null("a bucketed stream is endless (each bucket repeats and reshuffles its records on its own epochs)")
    )


def _bounded_mapping(value: Any) -> Any:
    """A mapping with string keys and at most :data:`MAX_COMPONENTS` of them, as it is."""
    value = string_keys(value)
    if isinstance(value, dict) and len(value) > MAX_COMPONENTS:
        raise ValueError(f"{len(value):,} entries, more than {MAX_COMPONENTS} (the most components of a mixture)")
    return value


def _numbers(value: Any) -> Any:
    """Weights by name as they are; otherwise an error naming the first weight that is not a number."""
    value = _bounded_mapping(value)
    if isinstance(value, dict):
        bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int | float)]
        if bad:
            raise first_bad(
                bad,
                f"the weight of {show(bad[0])} must be a number, got {show(value[bad[0]])}",
                "weights are not numbers",
            )
    return value


class ComponentConfig(Section):
    """One component of a mixture (``mix.components.<name>``): the keys of a single-source config but the batch's.

    It has no ``batch``, ``batch_transforms`` or ``bucket``; it is endless unless it has
    ``num_epochs`` (each component has its own epochs). Its transforms may filter, and it may be packed (``pack``
    and ``row_transforms``); the components' rows must then have the same keys, dtypes and
    ``seq_len`` (checked when a batch is collated).
    """

    source: SourceConfig
    seed: StrictInt = Field(
        default=0, ge=0, lt=2**64, description="The component's own seed (shuffle, random stages), default 0."
    )
    num_epochs: StrictInt | None = Field(
        default=None,
        ge=1,
        description="Passes over the component's records; null (the default): endless. Finite components make a "
        "finite mixture (see ``mix.stop``).",
    )
    shuffle: Shuffle = Field(default=None, description=_SHUFFLE)
    transforms: Stages = Field(default=[], description=_TRANSFORMS)
    pack: Pack | None = Field(default=None, description=_PACK)
    row_transforms: Stages = Field(default=[], description=_ROW_TRANSFORMS)


class StageConfig(Section):
    """One stage of a schedule: from ``start_step`` on, these weights."""

    start_step: StrictInt = Field(ge=0, description="The stage's first step: 0 for the first stage, then increasing.")
    weights: dict[str, Any] = Field(description="A weight (a number >= 0, relative) for every component, by name.")

    _weights = field_validator("weights", mode="before")(_numbers)


class MixConfig(Section):
    """``mix:``, instead of ``source:``: the records come from named components in given proportions.

    The mixture is :func:`quern.mix`'s. Give exactly one of ``weights`` and ``schedule``.
    """

    seed: StrictInt = Field(
        default=0, ge=0, lt=2**64, description="The seed of the assignment of positions to components."
    )
    block: StrictInt = Field(
        default=_mixture.BLOCK,
        ge=1,
        description=f"Positions per block of the assignment, default {_mixture.BLOCK} "
        "(see quern.pipeline.order.components).",
    )
    components: dict[str, ComponentConfig] = Field(
        min_length=1,
        description=f"The components by name, at most {MAX_COMPONENTS}: a mapping, or a list of components with a "
        "``name`` each (the form to_config writes; the order is part of the mixture, and a list keeps it "
        "whatever sorts a mapping's keys).",
    )
    weights: dict[str, Any] | None = Field(
        default=None, description="Relative weights of the components by name (numbers >= 0), fixed over the steps."
    )
    stop: Literal["first", "last"] = Field(
        default="first",
        description="With finite components (``num_epochs``): ``first`` (the default) ends the mixture when the first "
        "component runs out; ``last`` gives an ended component's weight to the others until all have ended.",
    )
    schedule: Annotated[list[StageConfig], Field(min_length=1, max_length=MAX_SCHEDULE)] | None = Field(
        default=None,
        description=f"Weights that change at steps: at most {MAX_SCHEDULE} stages, the first at step 0, each "
        "naming every component.",
    )

    @field_validator("components", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """The components by name, in order.

        A mapping as it is; a list of components with a ``name`` each as the mapping of their names.
        """
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


class MixPipelineConfig(Section):
    """A config whose records come from a mixture (``mix:``) instead of one ``source:``.

    Its top level has no ``source``, ``seed`` (the mixture's is ``mix.seed``),
    ``shuffle``, ``num_epochs``, ``pack``, ``row_transforms`` or ``bucket``.
    """

    mix: MixConfig = Field(description="The mixture: its seed, block, components and weights or schedule.")
    transforms: Stages = Field(
        default=[],
        description="Stages of the mixed records (kind ``map``, the default, or ``random_map``); default none.",
    )
    batch: Batch = Field(description="Rows per step (an integer >= 1) or a batch section; packed components: rows.")
    batch_transforms: Stages = Field(default=[], description=_BATCH_TRANSFORMS)
    skip: list[SkipConfig] = Field(default=[], description=SKIP_HELP)
    exclude: list[ExcludeConfig] = Field(default=[], description=EXCLUDE_HELP)
