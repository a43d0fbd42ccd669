"""quern.pipeline.core.deprecation: old call forms keep working, with a DeprecationWarning naming the new one."""

import inspect
import warnings

import pytest

from quern.pipeline.core.deprecation import keyword_only, renamed


@keyword_only("cache_dir", "num_workers")
@renamed(workers="num_workers")
def scan(path, n, *, cache_dir=None, num_workers=0):
    """Scan."""
    return path, n, cache_dir, num_workers


def test_the_new_form_is_unchanged_and_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scan("p", 1, cache_dir="c", num_workers=2) == ("p", 1, "c", 2)
        assert scan("p", 1) == ("p", 1, None, 0)
    assert list(inspect.signature(scan).parameters) == ["path", "n", "cache_dir", "num_workers"]
    assert scan.__doc__ == "Scan." and scan.__name__ == "scan"


def test_an_old_keyword_works_and_names_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"workers= is deprecated; use num_workers="):
        assert scan("p", 1, workers=3) == ("p", 1, None, 3)
    with pytest.raises(TypeError, match="both"):
        scan("p", 1, workers=3, num_workers=3)


def test_options_passed_positionally_still_work():
    with pytest.warns(DeprecationWarning, match=r"pass cache_dir, num_workers as a keyword argument"):
        assert scan("p", 1, "c", 4) == ("p", 1, "c", 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert scan("p", 1, "c", workers=5) == ("p", 1, "c", 5)
    assert [str(w.message).split(":")[1].split()[0] for w in caught] == ["pass", "workers="]
    with pytest.raises(TypeError, match="positional arguments"):
        scan("p", 1, "c", 4, 5)
    with pytest.raises(TypeError, match="both positionally and as keywords"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scan("p", 1, "c", cache_dir="d")


def test_prepare_takes_num_workers_and_still_workers(tmp_path):
    from quern.prepare import prepare

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a record")
    assert "num_workers" in inspect.signature(prepare).parameters
    new = prepare(tmp_path / "docs", tmp_path / "new", num_workers=0, progress=False)
    with pytest.warns(DeprecationWarning, match=r"prepare\(\): workers= is deprecated; use num_workers="):
        old = prepare(tmp_path / "docs", tmp_path / "old", workers=0, progress=False)
    assert old["shards"] == new["shards"]


def test_pipeline_old_spellings_work_the_same_with_a_warning(tmp_path):
    """``workers=`` (now ``num_workers=``) and ``shuffle(block=)`` (now ``block_size=``, the shuffle's block,
    apart from a mixture's ``block``) give the same pipeline as the new spellings, with a warning."""
    import numpy as np

    import quern

    src = quern.Pipeline.from_source({"x": np.arange(50)}, seed=3)
    tokens = quern.Pipeline.from_source({"t": np.ones((50, 3), dtype=np.int32)})
    with pytest.warns(DeprecationWarning, match=r"shuffle\(\): block= is deprecated; use block_size="):
        old = src.shuffle("block", block=5, window=2)
    assert old.fingerprint() == src.shuffle("block", block_size=5, window=2).fingerprint()
    with pytest.warns(DeprecationWarning, match=r"filter\(\): workers= is deprecated; use num_workers="):
        kept = src.filter(_even, cache_dir=tmp_path, workers=1)
    assert kept.survivors.tolist() == src.filter(_even, cache_dir=tmp_path, num_workers=1).survivors.tolist()
    with pytest.warns(DeprecationWarning, match=r"length_index\(\): workers= is deprecated"):
        tokens.length_index("t", lengths=np.full(50, 3), workers=1)


def _even(r):
    return int(r["x"]) % 2 == 0
