"""Prometheus metrics of quern's iterators (``pip install 'quern[metrics]'``): see :mod:`quern.pipeline.metrics`."""

from quern.pipeline.metrics import *  # noqa: F403
from quern.pipeline.metrics import __all__, __doc__  # noqa: F401
