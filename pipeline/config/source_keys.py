"""The ``source:`` sections of a config: one pydantic model per kind of source, chosen by ``type``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    field_validator,
)

from .sections import Section, string_keys, strings

__all__ = [
    "ArrayRecordConfig",
    "FileSourceConfig",
    "JsonlConfig",
    "ParquetConfig",
    "SourceConfig",
    "TFRecordConfig",
    "TensorStoreConfig",
    "WebDatasetConfig",
]

# --------------------------------------------------------------------------- sources

_PATHS = (
    "A path, a glob or a list of them (globs sorted; record ids run over the files in the given order); "
    "relative paths are relative to the config file's folder (the current directory for a dict config)."
)
_NAME = "The source's name in messages, explain and stage names (default: derived from the paths)."


class ArrayRecordConfig(Section):
    """``source: {type: array_record, ...}``: ArrayRecord files, or a folder written by ``quern prepare``.

    The folder may be given by its URL. Records are the raw ``bytes``
    (:class:`~quern.pipeline.sources.ArrayRecordSource`).
    """

    type: Literal["array_record"] = Field(description="``array_record``.")
    paths: str | list[str] = Field(
        description=_PATHS + " May also be a prepared folder, its manifest.json or its URL (http(s)://, s3://, gs://)."
    )
    name: str | None = Field(default=None, description=_NAME)
    max_open_files: StrictInt = Field(
        default=256, ge=1, description="Integer >= 1, default 256: the most idle readers kept open (shared by threads)."
    )
    fields: list[str] = Field(
        default=[],
        description="A prepared folder's metadata fields read with each record (default none): records are then "
        "``{bytes: the record, FIELD: value, ...}``.",
    )

    _paths = field_validator("paths", mode="before")(strings)


class ParquetConfig(Section):
    """``source: {type: parquet, ...}``: Parquet files; records are ``{column: value}`` dicts.

    The source is a :class:`~quern.pipeline.sources.ParquetSource`.
    """

    type: Literal["parquet"] = Field(description="``parquet``.")
    paths: str | list[str] = Field(description=_PATHS)
    columns: list[str] | None = Field(
        default=None, description="The columns read, a list of names (null, the default: all the first file's columns)."
    )
    name: str | None = Field(default=None, description=_NAME)
    cache_bytes: StrictInt = Field(
        default=1 << 30,
        ge=1,
        description="Integer >= 1, default 2**30: the bytes of decoded row groups kept in the LRU cache.",
    )
    cache_row_groups: StrictInt | None = Field(
        default=None,
        ge=1,
        description="Integer >= 1 or null (the default: no bound): the most row groups kept in the cache.",
    )
    unify_schemas: StrictBool = Field(
        default=False,
        description="Boolean, default false: read columns of compatible types across files as their common type "
        "(int32 and int64 as int64, ...); false: every file must have one schema over the columns read.",
    )

    _paths = field_validator("paths", "columns", mode="before")(strings)


class TensorStoreConfig(Section):
    """``source: {type: tensorstore, ...}``: TensorStore arrays, the first axis the record axis.

    The source is a :class:`~quern.pipeline.sources.TensorStoreSource`.
    """

    type: Literal["tensorstore"] = Field(description="``tensorstore``.")
    spec: str | dict[str, Any] = Field(
        description="A zarr or zarr3 array directory (relative to the config file's folder), a TensorStore spec, "
        "or a mapping of names to either (records are then dicts of rows; every array has the same length)."
    )
    name: str | None = Field(default=None, description=_NAME)

    _spec = field_validator("spec", mode="before")(string_keys)


_URLS = " May also be URLs (http(s)://, s3://, gs://), fetched whole into the disk cache."


class WebDatasetConfig(Section):
    """``source: {type: webdataset, ...}``: WebDataset tar shards read in place; a record is a sample.

    Samples are ``{"__key__": str, extension: bytes}``
    (:class:`~quern.pipeline.sources.WebDatasetSource`); the shards are indexed on first open.
    """

    type: Literal["webdataset"] = Field(description="``webdataset``.")
    paths: str | list[str] = Field(description=_PATHS + _URLS)
    name: str | None = Field(default=None, description=_NAME)

    _paths = field_validator("paths", mode="before")(strings)


class TFRecordConfig(Section):
    """``source: {type: tfrecord, ...}``: TFRecord files read in place; records are the raw ``bytes``.

    Both CRCs of every record are checked (:class:`~quern.pipeline.sources.TFRecordSource`).
    """

    type: Literal["tfrecord"] = Field(description="``tfrecord``.")
    paths: str | list[str] = Field(description=_PATHS + _URLS)
    name: str | None = Field(default=None, description=_NAME)

    _paths = field_validator("paths", mode="before")(strings)


class JsonlConfig(Section):
    """``source: {type: jsonl, ...}``: JSON-lines files read in place; a record is a parsed line.

    The source is a :class:`~quern.pipeline.sources.JsonlSource`.
    """

    type: Literal["jsonl"] = Field(description="``jsonl``.")
    paths: str | list[str] = Field(description=_PATHS + _URLS)
    field: str | None = Field(
        default=None, description="The record is this key's value of each line (null, the default: the whole line)."
    )
    name: str | None = Field(default=None, description=_NAME)

    _paths = field_validator("paths", mode="before")(strings)


FileSourceConfig = (
    ArrayRecordConfig | ParquetConfig | TensorStoreConfig | WebDatasetConfig | TFRecordConfig | JsonlConfig
)
"""Any source section."""

SourceConfig = Annotated[
    FileSourceConfig,
    Field(discriminator="type", description="The records: a source section, chosen by its ``type``."),
]
