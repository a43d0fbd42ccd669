"""Shared test settings: quern's cache folder is a temporary one for the whole session
(``QUERN_CACHE_DIR``, inherited by the processes tests start), so no test writes under
``~/.cache/quern``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

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
    hold an object's address (``<object at 0x...>``), which differs between processes.

    The order, the same in every process: the tests marked ``slow`` first, so that with
    ``make test``'s one-test-at-a-time scheduling (``--maxschedchunk 1``) the longest ones do not
    start last and leave the other workers idle at the end; the browser tests of the documentation
    site last (``make test`` builds the site beside the suite, and they wait for it); otherwise the
    order of collection."""
    bad = [item.nodeid for item in items if re.search(r" at 0x[0-9a-f]", item.nodeid)]
    if bad:
        raise pytest.UsageError("test ids holding an object address (give them ids=): " + ", ".join(bad[:5]))
    items.sort(key=lambda item: 2 if item.path.name == SITE_TESTS else 0 if item.get_closest_marker("slow") else 1)


SITE_TESTS = "test_site_browser.py"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """``tmp_path`` as the current directory (``--map`` modules are imported from it); ``sys.path``
    and the map modules imported are restored after the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if file.startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted for the test (root only; skipped where mounting is not allowed)."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill the disk needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """Length indexes and survivors under this test's folder (``QUERN_CACHE_DIR=tmp_path/cache``),
    and nothing allowed from the environment running the tests (no ``QUERN_ALLOW``): the cache folder."""
    monkeypatch.setenv("QUERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QUERN_ALLOW", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def srv() -> Any:
    """A private redis-server for the test (tests/redisserver.py); skipped where redis-server is not installed."""
    from redisserver import REDIS_MISSING, RedisServer, redis_binary

    if redis_binary() is None:
        pytest.skip(REDIS_MISSING)
    with RedisServer() as server:
        yield server
