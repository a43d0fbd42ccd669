"""The examples in docstrings run and give what they show: every module of the package, found by walking it."""

import doctest
import importlib
import pkgutil

import pytest

import quern

SKIP = {"setup", "__main__", "tests", "benchmarks", "examples", "docs"}  # scripts, and folders beside a source tree
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(quern.__path__, "quern.") if not SKIP & set(m.name.split(".")[1:])
)


def test_the_walk_finds_the_package():
    assert {"quern.pipeline.definition.dataset", "quern.pipeline.streams.mixture", "quern.transforms.pad"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0, result


def test_the_public_api_has_examples():
    attempted = sum(doctest.testmod(importlib.import_module(n)).attempted for n in MODULES)
    assert attempted >= 40, attempted
