"""Pure record- and batch-level transforms: decoding, padding, counter-based randomness."""

from . import random
from .decode import decode
from .pad import pad

__all__ = ["decode", "pad", "random"]
