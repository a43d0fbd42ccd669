"""The ``skip:`` and ``exclude:`` sections of a config: edits that keep the past.

``skip: [{start: 100, stop: 120}]`` is :meth:`Pipeline.skip_steps`;
``exclude: [{from_step: 500, ids: [3, 17]}]`` (or ``file: takedown.npy``, a
``.npy`` file or a text file of ids, relative to the config's folder; with
``component:`` for a mixture) is :meth:`Pipeline.exclude`. The edits apply
after the batch and batch stages, in the order of their first steps (a skip
before an exclusion at the same step): what :meth:`Pipeline.to_config` writes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from ..core.errors import ConfigError

__all__ = ["SkipConfig", "ExcludeConfig", "apply_edits", "read_ids", "SKIP_HELP", "EXCLUDE_HELP"]

SKIP_HELP = "Skipped steps: ``{start, stop}`` entries (``Pipeline.skip_steps``); default none."
EXCLUDE_HELP = (
    "Excluded records: ``{from_step, ids or file, component}`` entries (``Pipeline.exclude``); default none. "
    "The edits apply in the order of their first steps."
)

_MAX_LISTED = 1 << 20  # ids written in the config itself; more belong in a file


class SkipConfig(BaseModel):
    """``{start, stop}``: training steps from ``start`` on get the data of steps ``stop``, ``stop + 1``, ..."""

    model_config = ConfigDict(extra="forbid")

    start: StrictInt = Field(ge=0, description="The first training step that gets other data.")
    stop: StrictInt = Field(ge=1, description="The step whose data step ``start`` gets; greater than ``start``.")

    @model_validator(mode="after")
    def _ordered(self) -> SkipConfig:
        if self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be greater than start ({self.start})")
        return self


class ExcludeConfig(BaseModel):
    """``{from_step, ids | file, component}``: the records never used from step ``from_step`` on."""

    model_config = ConfigDict(extra="forbid")

    from_step: StrictInt = Field(ge=0, description="The first step without the records.")
    ids: list[StrictInt] | None = Field(
        default=None, max_length=_MAX_LISTED, description="The record ids (of the component's source for a mixture)."
    )
    file: str | None = Field(
        default=None,
        description="Instead of ``ids``: a ``.npy`` file of integer ids, or a text file of ids separated by "
        "whitespace or commas (``#`` starts a comment), relative to the config file's folder.",
    )
    component: str | None = Field(default=None, description="The mixture component the ids are of (mixtures only).")

    @model_validator(mode="after")
    def _one_of(self) -> ExcludeConfig:
        if (self.ids is None) == (self.file is None):
            raise ValueError("give exactly one of 'ids' (a list of record ids) or 'file' (a .npy or text file of ids)")
        return self


_INT64 = np.iinfo(np.int64)
_RANGE = "record ids fit in int64, 0 to 2**63 - 1"


def _out_of_int64(ids: list[int]) -> int | None:
    """The first of ``ids`` (Python integers) that does not fit in int64, or ``None``."""
    return next((i for i in ids if not _INT64.min <= i <= _INT64.max), None)


def _bytes_text(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (``7.0 TiB``)."""
    size, unit = float(n), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024:
            break
        size, unit = size / 1024, name
    return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit}"


def _npy_ids(path: str) -> np.ndarray:
    """The ids of a ``.npy`` file, its header checked before its data is read (no allocation on its word)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = header(f)
        held = os.fstat(f.fileno()).st_size - f.tell()
    if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
        raise ConfigError(f"{path}: needs a 1-D array of integer ids, got {dtype} of shape {shape}")
    claimed = shape[0] * dtype.itemsize
    if claimed > held:
        raise ConfigError(
            f"{path}: its .npy header claims {shape[0]} ids of {dtype} ({_bytes_text(claimed)}), and the file holds "
            f"{held} bytes after the header: the file is cut short or its header is wrong"
        )
    ids = np.load(path, allow_pickle=False)
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > _INT64.max:
        raise ConfigError(f"{path}: record id {int(ids.max())} is out of range ({_RANGE})")
    return ids.astype(np.int64)


def read_ids(path: str) -> np.ndarray:
    """The record ids in a ``.npy`` file or a text file.

    Args:
        path: the file.

    Returns:
        A 1-D int64 array.

    Raises:
        ConfigError: the file cannot be read, holds anything but integers, or an id that does not fit
            in int64, or its ``.npy`` header claims more data than the file holds (naming the file and
            the token or value).
    """
    try:
        if path.endswith(".npy"):
            return _npy_ids(path)
        with open(path) as f:
            text = f.read()
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"cannot read the ids of {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not a .npy file of ids ({e})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for token in line.split("#", 1)[0].replace(",", " ").split():
            try:
                out.append(int(token))
            except ValueError:  # (a number of over 4300 digits too)
                raise ConfigError(f"{path}, line {n}: {token!r:.60} is not an integer record id") from None
            if _out_of_int64(out[-1:]) is not None:
                raise ConfigError(f"{path}, line {n}: record id {token} is out of range ({_RANGE})")
    return np.asarray(out, dtype=np.int64)


def apply_edits(pipe: Any, skip: list[SkipConfig], exclude: list[ExcludeConfig], base: str) -> Any:
    """``pipe`` with the config's edits, in the order of their first steps (skips first at a tie).

    Args:
        pipe: the batched pipeline (a :class:`~quern.pipeline.definition.dataset.Pipeline`).
        skip: the ``skip:`` entries.
        exclude: the ``exclude:`` entries.
        base: the folder relative files are found from.

    Returns:
        The edited pipeline.

    Raises:
        ConfigError: an edit the pipeline refuses, naming its key path.
    """
    todo: list[tuple[int, int, int, Any]] = [(e.start, 0, i, e) for i, e in enumerate(skip)]
    todo += [(e.from_step, 1, i, e) for i, e in enumerate(exclude)]
    for _, kind, i, entry in sorted(todo, key=lambda t: t[:3]):
        where = f"skip.{i}" if kind == 0 else f"exclude.{i}"
        try:
            if isinstance(entry, SkipConfig):
                pipe = pipe.skip_steps(entry.start, entry.stop)
            else:
                ids = entry.ids
                big = None if ids is None else _out_of_int64(ids)
                if big is not None:
                    raise ConfigError(f"record id {big} is out of range ({_RANGE})")
                if entry.file is not None:
                    path = os.path.expanduser(entry.file)
                    ids = read_ids(path if os.path.isabs(path) else os.path.join(base, path))
                pipe = pipe.exclude(ids, from_step=entry.from_step, component=entry.component)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except (TypeError, ValueError, IndexError) as e:
            raise ConfigError(f"{where}: {e}") from e
    return pipe
