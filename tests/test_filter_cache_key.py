"""Tests of pipeline/plan/survivors.py and pipeline/scan.py.

A filter's cache is tied to what it caches: each cache file records the key it was
built for; the fingerprint of a filtered pipeline is the one its survivors were
computed with; reads a predicate must not depend on are refused where they can be
detected."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import sys
from os import environ as ENVIRON

import numpy as np
import pytest

import quern
from quern.pipeline.core.errors import FingerprintError

N = 600
ME = sys.modules[__name__]
THR = 0


def _src(n=N):
    return quern.Pipeline.from_source({"x": np.arange(n, dtype=np.int64)})


def div3(rec):
    return int(rec["x"]) % 3 == 0


def div5(rec):
    return int(rec["x"]) % 5 == 0


def above_thr(rec):
    return int(rec["x"]) >= THR


def plus_one(rec):
    return {"x": rec["x"] + 1}


def twice(rec):
    return {"x": rec["x"], "tokens": np.zeros(2 + int(rec["x"]) % 3)}


def thrice(rec):
    return {"x": rec["x"], "tokens": np.zeros(3 + int(rec["x"]) % 3)}


def _files(folder, suffix=".survivors"):
    return sorted(p for p in folder.rglob(f"*{suffix}"))


# --------------------------------------------------------------------------- (i) a file is used only under its key


def test_a_cache_file_copied_from_another_filter_is_not_used(tmp_path, capfd):
    five = _src().filter(div5, cache_dir=tmp_path)
    [five_file] = _files(tmp_path)
    three = _src().filter(div3, cache_dir=tmp_path)
    [three_file] = [p for p in _files(tmp_path) if p != five_file]
    del five, three
    shutil.copyfile(three_file, five_file)  # the same source, the same record count: only the key differs
    capfd.readouterr()
    again = _src().filter(div5, cache_dir=tmp_path)
    ids = np.arange(N)
    np.testing.assert_array_equal(again.survivors, ids[ids % 5 == 0])
    err = capfd.readouterr().err
    assert "not usable" in err and "built for key" in err and five_file.stem in err


def test_a_length_index_copied_from_another_pipeline_is_not_used(tmp_path, capfd):
    a = _src().map(twice).length_index(key="tokens", cache_dir=tmp_path)
    [a_file] = _files(tmp_path, ".lengths")
    b = _src().map(thrice).length_index(key="tokens", cache_dir=tmp_path)
    [b_file] = [p for p in _files(tmp_path, ".lengths") if p != a_file]
    np.testing.assert_array_equal(b, a + 1)
    del a, b
    shutil.copyfile(a_file, b_file)
    capfd.readouterr()
    again = _src().map(thrice).length_index(key="tokens", cache_dir=tmp_path)
    np.testing.assert_array_equal(again, 3 + np.arange(N) % 3)
    assert "built for key" in capfd.readouterr().err


def _write_v1(path, ids, n):
    """A survivors file as version 1 wrote it (no key), with a valid checksum."""
    body = np.asarray(ids, dtype="<i8").tobytes()
    path.write_bytes(struct.pack("<8sQQ32s8x", b"QUERNSV1", len(ids), n, hashlib.sha256(body).digest()) + body)


def _write_v2(path, ids, n, key):
    """A survivors file in the documented version-2 layout, written by hand."""
    body = np.asarray(ids, dtype="<i8").tobytes()
    field = key.encode().ljust(32, b"\0")
    head = struct.pack("<8sQQ32s32s40x", b"QUERNSV2", len(ids), n, hashlib.sha256(field + body).digest(), field)
    path.write_bytes(head + body)


def test_a_hand_written_file_with_a_valid_checksum_is_not_used(tmp_path, capfd):
    first = _src().filter(div3, cache_dir=tmp_path)
    [path] = _files(tmp_path)
    del first
    _write_v1(path, [1, 2, 4], N)  # an old file, or one written by hand in the old layout
    again = _src().filter(div3, cache_dir=tmp_path)
    ids = np.arange(N)
    np.testing.assert_array_equal(again.survivors, ids[ids % 3 == 0])
    assert "old format" in capfd.readouterr().err
    del again
    _write_v2(path, [1, 2, 4], N, "0" * 32)  # the current layout, valid, for another key
    again = _src().filter(div3, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.survivors, ids[ids % 3 == 0])
    assert "built for key '" + "0" * 32 in capfd.readouterr().err
    del again
    _write_v2(path, [1, 2, 4], N, path.stem)  # the same layout for its own key: used (so the refusal was the key's)
    assert list(_src().filter(div3, cache_dir=tmp_path).survivors) == [1, 2, 4]


# --------------------------------------------------------------------------- (ii) the fingerprint of the survivors


def test_the_fingerprint_is_the_one_the_survivors_were_computed_with(tmp_path, monkeypatch):
    monkeypatch.setattr(ME, "THR", 450)
    pipe = _src().shuffle().filter(above_thr, cache_dir=tmp_path).batch(10)
    monkeypatch.setattr(ME, "THR", 0)  # after filter(): the survivors do not change, nor does the fingerprint
    with pipe.iterator() as it:
        got = np.concatenate([next(it)["x"] for _ in range(15)])
        state = it.state()
    np.testing.assert_array_equal(np.sort(got), np.arange(450, 600))
    other = _src().shuffle().filter(above_thr, cache_dir=tmp_path).batch(10)  # THR 0: other survivors
    assert len(other.survivors) == N
    assert other.fingerprint() != pipe.fingerprint()
    with pytest.raises(ValueError, match="does not match this pipeline"):
        other.check_state(state)
    monkeypatch.setattr(ME, "THR", 450)
    same = _src().shuffle().filter(above_thr, cache_dir=tmp_path).batch(10)
    assert same.fingerprint() == pipe.fingerprint()
    assert same.check_state(state) == 15


def test_a_later_filter_is_keyed_by_the_survivors_of_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.setattr(ME, "THR", 300)
    first = _src().filter(above_thr, cache_dir=tmp_path)
    monkeypatch.setattr(ME, "THR", 0)
    second = first.filter(div5, cache_dir=tmp_path)  # keyed by the first filter as it was (THR 300)
    ids = np.arange(300, 600)
    np.testing.assert_array_equal(second.survivors, ids[ids % 5 == 0])
    fresh = _src().filter(above_thr, cache_dir=tmp_path).filter(div5, cache_dir=tmp_path)  # THR 0
    ids = np.arange(N)
    np.testing.assert_array_equal(fresh.survivors, ids[ids % 5 == 0])  # not the cached survivors of the other


# --------------------------------------------------------------------------- (iii) reads a predicate must not depend on


def with_attribute(rec):
    return int(rec["x"]) % with_attribute.k == 0


def test_a_function_attribute_is_part_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(with_attribute, "k", 3, raising=False)
    three = _src().filter(with_attribute, cache_dir=tmp_path)
    monkeypatch.setattr(with_attribute, "k", 5)
    five = _src().filter(with_attribute, cache_dir=tmp_path)
    ids = np.arange(N)
    np.testing.assert_array_equal(three.survivors, ids[ids % 3 == 0])
    np.testing.assert_array_equal(five.survivors, ids[ids % 5 == 0])  # not the stale cache of k=3
    assert three.fingerprint() != five.fingerprint()


MOD = 3


def by_globals(rec):
    return int(rec["x"]) % globals()["MOD"] == 0


def by_vars(rec):
    return int(rec["x"]) % vars(ME)["MOD"] == 0


def by_environ(rec):
    return int(rec["x"]) % int(os.environ.get("QUERN_TEST_MOD", "3")) == 0


def by_getenv(rec):
    return int(rec["x"]) % int(os.getenv("QUERN_TEST_MOD", "3")) == 0


def by_imported_environ(rec):
    return int(rec["x"]) % int(ENVIRON.get("QUERN_TEST_MOD", "3")) == 0


def by_import_inside(rec):
    import os as o

    return int(rec["x"]) % int(o.environ.get("QUERN_TEST_MOD", "3")) == 0


def by_nested_environ(rec):
    return (lambda: int(rec["x"]) % int(os.environ["QUERN_TEST_MOD"]) == 0)()


@pytest.mark.parametrize(
    "pred, what",
    [
        (by_globals, r"by_globals calls globals\(\)"),
        (by_vars, r"by_vars calls vars\(\)"),
        (by_environ, r"by_environ reads the environment"),
        (by_getenv, r"by_getenv reads the environment"),
        (by_imported_environ, r"reads the environment"),
        (by_import_inside, r"reads the environment"),
        (by_nested_environ, r"reads the environment"),
    ],
    ids=["globals", "vars", "environ", "getenv", "from-os-import-environ", "import-inside", "nested"],
)
def test_hidden_reads_are_refused(tmp_path, monkeypatch, pred, what):
    monkeypatch.setenv("QUERN_TEST_MOD", "3")
    with pytest.raises(
        FingerprintError, match=rf"filter\[0\] .*{what}.*pass the value to the transform as an argument"
    ):
        _src().filter(pred, cache_dir=tmp_path)
    assert _files(tmp_path) == []
    with pytest.raises(FingerprintError, match=what):  # a map too: its fingerprint cannot see the value
        _src().map(lambda rec: rec).map(pred).batch(2).fingerprint()


def by_locals(rec):
    x = int(rec["x"])
    return locals()["x"] % 3 == 0


def by_os_path(rec):
    return os.path.sep == "/" and int(rec["x"]) % 3 == 0


class ModFromEnv:
    """Reads the environment when it is built: the value is in its state, which is described."""

    def __init__(self):
        self.k = int(os.environ["QUERN_TEST_MOD"])

    def __call__(self, rec):
        return int(rec["x"]) % self.k == 0


def test_reads_the_description_covers_are_allowed(tmp_path, monkeypatch):
    ids = np.arange(N)
    for pred in (by_locals, by_os_path):
        got = _src().filter(pred, cache_dir=tmp_path)
        np.testing.assert_array_equal(got.survivors, ids[ids % 3 == 0])
    monkeypatch.setenv("QUERN_TEST_MOD", "3")
    three = _src().filter(ModFromEnv(), cache_dir=tmp_path)
    monkeypatch.setenv("QUERN_TEST_MOD", "5")
    five = _src().filter(ModFromEnv(), cache_dir=tmp_path)
    np.testing.assert_array_equal(three.survivors, ids[ids % 3 == 0])
    np.testing.assert_array_equal(five.survivors, ids[ids % 5 == 0])
