"""Pure record- and batch-level transforms: decoding, padding, counter-based randomness, images.

The built-in transforms are factory functions (``decode``, ``pad``,
``metadata_range``) returning instances of their classes (``Decode``, ``Pad``,
``MetadataRange``), registered for configs under the factory's name.
"""

from . import image, random
from .decode import Decode, decode
from .metadata import MetadataRange, metadata_range
from .pad import Pad, pad

__all__ = ["Decode", "MetadataRange", "Pad", "decode", "image", "metadata_range", "pad", "random"]
