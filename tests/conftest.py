"""Shared test settings: quern's cache folder is a temporary one for the whole session
(``QUERN_CACHE_DIR``, inherited by the processes tests start), so no test writes under
``~/.cache/quern``."""

from __future__ import annotations

import os
import re

import pytest


@pytest.fixture(autouse=True, scope="session")
def _quern_cache_dir(tmp_path_factory):
    old = os.environ.get("QUERN_CACHE_DIR")
    os.environ["QUERN_CACHE_DIR"] = str(tmp_path_factory.mktemp("quern-cache"))
    yield
    if old is None:
        os.environ.pop("QUERN_CACHE_DIR", None)
    else:
        os.environ["QUERN_CACHE_DIR"] = old


def pytest_collection_modifyitems(config, items):
    """Test ids must be the same in every process (pytest-xdist compares them): none may
    hold an object's address (``<object at 0x...>``), which differs between processes."""
    bad = [item.nodeid for item in items if re.search(r" at 0x[0-9a-f]", item.nodeid)]
    if bad:
        raise pytest.UsageError("test ids holding an object address (give them ids=): " + ", ".join(bad[:5]))
