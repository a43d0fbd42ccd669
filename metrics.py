"""Prometheus metrics of quern's iterators (``pip install 'quern[metrics]'``): see :mod:`quern.pipeline.iterate.prometheus`."""

from .pipeline.iterate.prometheus import *  # noqa: F403
from .pipeline.iterate.prometheus import __all__, __doc__  # noqa: F401
