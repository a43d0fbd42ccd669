"""What every config section shares: unknown keys refused, and lists and mappings checked with one error each.

:class:`Section` is the base of every model of :mod:`quern.pipeline.config.schema`: a key it does not
declare is an error, and a mapping with more keys than any section has is one error. The validators
report the first bad item of a list or mapping with the count of the others, instead of one error per item.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    model_validator,
)

from .limits import MAX_KEYS, show

__all__ = ["Section", "first_bad", "strings", "string_keys", "null"]


class Section(BaseModel):
    """A config section: unknown keys are errors, and a mapping of too many keys is one error."""

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


def first_bad(bad: list, message: str, others: str) -> ValueError:
    """The error ``message`` (about ``bad[0]``), with the count of ``bad`` when there are several.

    ``"(3 items are not strings)"``: one error instead of one per item.
    """
    return ValueError(message + (f" ({len(bad):,} {others})" if len(bad) > 1 else ""))


def strings(value: Any) -> Any:
    """A list of strings as it is; otherwise an error naming the first item that is not one.

    Pydantic would report each: as many errors as items.
    """
    if isinstance(value, list):
        bad = [i for i, v in enumerate(value) if not isinstance(v, str)]
        if bad:
            raise first_bad(bad, f"item {bad[0]} is not a string: {show(value[bad[0]])}", "items are not strings")
    return value


def string_keys(value: Any) -> Any:
    """A mapping with string keys as it is; otherwise an error naming the first other key."""
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise first_bad(bad, f"keys must be strings, got {show(bad[0])}", "keys are not strings")
    return value


def null(why: str) -> Callable[[Any], Any]:
    """A validator: ``None`` as it is; any other value is an error saying ``why`` it must be null."""

    def check(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"must be null, got {show(value)}: {why}")
        return value

    return check
