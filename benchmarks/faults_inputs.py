"""Reliability scenarios of smaller holes: odd inputs, each a clear error (issue 36 point 10).

Each scenario is a function ``(trials, rng, tmp) -> (tried, held, notes)`` as in
:mod:`faults`, which runs the ones in :data:`SCENARIOS` with its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable

SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {}
