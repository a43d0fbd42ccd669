"""The examples in docstrings run and give what they show."""

import doctest

import pytest

import quern.pipeline.mix
import quern.pipeline.timing
import quern.transforms.metadata


@pytest.mark.parametrize("module", [quern.pipeline.mix, quern.pipeline.timing, quern.transforms.metadata])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0, result
