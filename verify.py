"""Checking determinism: step digests across topologies, ledgers against the data: see :mod:`quern.pipeline.verify`."""

from quern.pipeline.verify import *  # noqa: F403
from quern.pipeline.verify import __all__, __doc__  # noqa: F401
