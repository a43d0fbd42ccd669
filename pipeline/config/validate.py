"""A config checked against the schema, with one message naming every problem.

:func:`validate` picks the config's form (one source, ``mix:`` or ``bucket:``),
checks it against the models of :mod:`quern.pipeline.config.schema` and raises
one :class:`ConfigError` naming every problem: its key path, what is wrong, the
value, and for an unknown key the nearest known one ("did you mean") or the
section it belongs under. It builds nothing: :mod:`quern.pipeline.config.load`
builds the pipeline from the checked models.
"""

from __future__ import annotations

import difflib

from pydantic import ValidationError

from ..core.errors import ConfigError
from .limits import MAX_SHOWN, bounded, clip, show
from .schema import (
    ArrayRecordConfig,
    BatchConfig,
    BucketConfig,
    BucketPipelineConfig,
    ComponentConfig,
    JsonlConfig,
    MixConfig,
    MixPipelineConfig,
    PackConfig,
    ParquetConfig,
    PipelineConfig,
    ShuffleConfig,
    StageConfig,
    TensorStoreConfig,
    TFRecordConfig,
    TransformConfig,
    WebDatasetConfig,
)

__all__ = ["validate"]

_NOT_WITH_BUCKET = {
    "batch": "bucket makes the batches (bucket.batch_sizes, one size per bucket); give either batch or bucket, not both",
    "pack": "give either pack (rows of seq_len tokens) or bucket (records padded to their bucket's bound), not both",
    "row_transforms": "transforms of packed rows; a bucketed config is not packed (record transforms go under "
    "transforms, transforms of the padded batches under batch_transforms)",
}
"""Keys of a single-source config that a ``bucket:`` config refuses, and why (``batch: null``,
``pack: null`` and ``row_transforms: []`` are none: let through)."""


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
    "source": (ArrayRecordConfig, ParquetConfig, TensorStoreConfig, WebDatasetConfig, TFRecordConfig, JsonlConfig),
    "mix": MixConfig,
    "pack": PackConfig,
    "row_transforms": TransformConfig,
    "bucket": BucketConfig,
    _COMPONENT: ComponentConfig,
    "mix.schedule": StageConfig,
}
"""Section -> its model(s): a section's keys, for hints about unknown keys ("did you mean",
"it belongs under"). A component's ``shuffle``, ``source``... are those sections too."""
_TAGS = {
    "array_record",
    "parquet",
    "tensorstore",
    "webdataset",
    "tfrecord",
    "jsonl",
    "ShuffleConfig",
    "BatchConfig",
    "PackConfig",
}
_TYPE_TAGS = {"int", "str", "float", "constrained-int"}  # names pydantic gives union branches in error locations


def _keys_of(section: str) -> list[str]:
    """The keys a section may hold (of any of its models), sorted."""
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
    """An error location without the names pydantic gives union branches.

    A component's name (whatever it is) is kept.
    """
    path: list = []
    for i, p in enumerate(loc):
        name = i == 2 and loc[:2] == ("mix", "components")
        if name or not (isinstance(p, str) and (p in _TAGS or "[" in p or p in _TYPE_TAGS)):
            path.append(p)
    return path


def _problems(err: ValidationError, bucket_hint: bool = False) -> list[str]:
    """One line per problem of ``err``: the key path, what is wrong, the value.

    ``bucket_hint``: a missing ``batch`` says that ``bucket`` may batch instead.
    """
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
    """``"key: why"`` for each key of ``refused`` that ``data`` gives.

    Given: present and not null (the keys of ``always``: present at all),
    ``row_transforms`` not an empty list.
    """
    lines = []
    for key, why in refused.items():
        given = key in data and (key in always or data[key] is not None)
        if given and not (key == "row_transforms" and isinstance(data[key], list) and not data[key]):
            lines.append(f"{key}: {why}")
    return lines


def validate(data: dict) -> PipelineConfig | MixPipelineConfig | BucketPipelineConfig:
    """Check a config against the schema, saying every problem at once.

    The form is picked by the top-level keys: ``mix`` a mixture, a ``bucket`` that
    is not null length buckets, else one source.

    Args:
        data: The config, as read from its file.

    Returns:
        The checked model of its form; nothing is built or read.

    Raises:
        ConfigError: Naming every problem: its key path, what is wrong, the value,
            and for an unknown key the nearest known one or the section it belongs under.

    Example:
        >>> validate({"source": {"type": "parquet", "paths": "t/*.parquet"}, "batch": 32}).batch
        32
        >>> try:
        ...     validate({"source": {"type": "parquet", "paths": "t/*.parquet"}, "batch": 32, "shufle": "global"})
        ... except ConfigError as e:
        ...     print(e)
        invalid config:
          shufle: unknown key 'shufle'; did you mean 'shuffle'?
    """
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
