"""Shared test settings: quern's cache folder is a temporary one for the whole session
(``QUERN_CACHE_DIR``, inherited by the processes tests start), so no test writes under
``~/.cache/quern``."""

from __future__ import annotations

import os

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
