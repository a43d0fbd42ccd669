"""Pure record- and batch-level transforms: decoding, padding, counter-based randomness."""

from . import random
from .decode import decode
from .metadata import metadata_range
from .pad import pad

__all__ = ["decode", "metadata_range", "pad", "random"]
