"""The config schema: what a pipeline config may hold (pydantic models), and the
messages of its checks.

:func:`validate` checks a config read by :mod:`quern.pipeline.config` against the
schema and raises one :class:`ConfigError` naming every problem: its key path,
what is wrong, the value, and for an unknown key the nearest known one ("did you
mean") or the section it belongs under. It builds nothing: building the pipeline
from the checked models is :mod:`quern.pipeline.config`'s. The format itself is
described in that module's docstring.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

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

from .errors import ConfigError
from .limits import (
    MAX_COMPONENTS,
    MAX_KEYS,
    MAX_SCHEDULE,
    MAX_SHOWN,
    MAX_STAGES,
    bounded,
    clip,
    show,
)
from .plan import mixture as _mixture
from .trust import FN, FN_FORM, IDENT, MODULE

__all__ = [
    "ArrayRecordConfig",
    "BucketConfig",
    "BucketPipelineConfig",
    "ComponentConfig",
    "MixConfig",
    "MixPipelineConfig",
    "PackConfig",
    "ParquetConfig",
    "PipelineConfig",
    "ShuffleConfig",
    "TensorStoreConfig",
    "TransformConfig",
    "validate",
]


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


def _first_bad(bad: list, message: str, others: str) -> ValueError:
    """The error ``message`` (about ``bad[0]``), with the count of ``bad`` when there are
    several (``"(3 items are not strings)"``): one error instead of one per item."""
    return ValueError(message + (f" ({len(bad):,} {others})" if len(bad) > 1 else ""))


def _strings(value: Any) -> Any:
    """A list of strings as it is; otherwise an error naming the first item that is not one
    (pydantic would report each: as many errors as items)."""
    if isinstance(value, list):
        bad = [i for i, v in enumerate(value) if not isinstance(v, str)]
        if bad:
            raise _first_bad(bad, f"item {bad[0]} is not a string: {show(value[bad[0]])}", "items are not strings")
    return value


def _string_keys(value: Any) -> Any:
    """A mapping with string keys as it is; otherwise an error naming the first other key."""
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise _first_bad(bad, f"keys must be strings, got {show(bad[0])}", "keys are not strings")
    return value


def _null(why: str) -> Callable[[Any], Any]:
    """A validator: ``None`` as it is; any other value is an error saying ``why`` it must be null."""

    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"must be null, got {show(value)}: {why}")
        return value

    return check


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
            raise _first_bad(bad, f"item {bad[0]} is not an integer >= 1: {show(value[bad[0]])}", "items are not")
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

    _endless = field_validator("num_epochs", mode="before")(
        _null("a bucketed stream is endless (each bucket repeats and reshuffles its records on its own epochs)")
    )


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
            raise _first_bad(
                bad,
                f"the weight of {show(bad[0])} must be a number, got {show(value[bad[0]])}",
                "weights are not numbers",
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

    _endless = field_validator("num_epochs", mode="before")(
        _null("the components of a mixture are endless (each repeats and reshuffles on its own epochs)")
    )


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


def _refused(data: dict, refused: dict[str, str], always: tuple[str, ...] = ()) -> list[str]:
    """``"key: why"`` for each key of ``refused`` that ``data`` gives: present and not
    null (the keys of ``always``: present at all), ``row_transforms`` not an empty list."""
    lines = []
    for key, why in refused.items():
        given = key in data and (key in always or data[key] is not None)
        if given and not (key == "row_transforms" and isinstance(data[key], list) and not data[key]):
            lines.append(f"{key}: {why}")
    return lines


def validate(data: dict) -> PipelineConfig | MixPipelineConfig | BucketPipelineConfig:
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
