"""Tests of pipeline/lengths.py.

Pipeline.length_index: tokens per record after the record transforms, scanned once and
cached (or given and checked), and token-balanced host slices from it (issue 12, points 1 and 6).

Every expected length is computed here from the documents' definition (``DOC_LEN``),
never by the code under test. Cache folders are ``tmp_path``.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

import quern
from quern.pipeline.definition import scan

pytestmark = pytest.mark.timeout(120)

N = 300
DOC_LEN = (np.arange(N) * 7919) % 37 + 1  # 1..37 tokens, scrambled

CALLS = types.ModuleType("quern_test_length_calls")  # counts reads (a module: fingerprinted by name only)
CALLS.n = 0


class Docs:
    """Record ``i``: ``{"tokens": arange(DOC_LEN[i]), "i": i}``; counts the records read."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        CALLS.n += 1
        return {"tokens": np.arange(int(DOC_LEN[i]), dtype=np.int32), "i": int(i)}

    def identity(self):
        return {"type": "Docs", "n": N}


def twice(rec):  # a transform before the measure: lengths are taken after it
    return {**rec, "tokens": np.concatenate([rec["tokens"], rec["tokens"]])}


def odd(rec):
    return bool(rec["i"] % 2)


def tokens_only(rec):
    return rec["tokens"]


def only_i(rec):
    return {"i": rec["i"]}


def _pipe():
    return quern.Pipeline.from_source(Docs(), seed=3).shuffle()


def test_lengths_are_taken_after_the_transforms(tmp_path):
    got = _pipe().map(twice).length_index(key="tokens", cache_dir=tmp_path)
    assert got.dtype == np.int64 and got.shape == (N,)
    np.testing.assert_array_equal(got, 2 * DOC_LEN)
    plain = _pipe().map(tokens_only).length_index(cache_dir=tmp_path)  # records that are 1-D arrays: no key
    np.testing.assert_array_equal(plain, DOC_LEN)


def test_the_index_is_scanned_once_and_cached(tmp_path):
    CALLS.n = 0
    first = _pipe().length_index(key="tokens", cache_dir=tmp_path)
    assert CALLS.n == N  # the scan read every record once
    files = list((tmp_path / "lengths").glob("*.lengths"))
    assert len(files) == 1
    CALLS.n = 0
    again = _pipe().length_index(key="tokens", cache_dir=tmp_path)
    assert CALLS.n == 0 and isinstance(again, np.memmap) and not again.flags.writeable
    np.testing.assert_array_equal(again, first)
    # another transform or key: another file
    _pipe().map(twice).length_index(key="tokens", cache_dir=tmp_path)
    assert len(list((tmp_path / "lengths").glob("*.lengths"))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_damaged_index_is_rebuilt(tmp_path, damage):
    _pipe().length_index(key="tokens", cache_dir=tmp_path)
    [path] = list((tmp_path / "lengths").glob("*.lengths"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10  # a high bit of the last length: still >= -1, only the checksum sees it
    elif damage == "truncate":
        data = data[: len(data) - 8]
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    CALLS.n = 0
    got = _pipe().length_index(key="tokens", cache_dir=tmp_path)
    assert CALLS.n == N  # scanned again
    np.testing.assert_array_equal(got, DOC_LEN)


def test_records_a_filter_drops_have_length_minus_one(tmp_path):
    pipe = _pipe().filter(odd, cache_dir=tmp_path)
    got = pipe.length_index(key="tokens", cache_dir=tmp_path)
    want = np.where(np.arange(N) % 2 == 1, DOC_LEN, -1)
    np.testing.assert_array_equal(got, want)


def test_the_scan_in_processes_equals_the_scan_here(tmp_path, monkeypatch):
    monkeypatch.setattr(scan, "PROCESS_MIN", 50)
    a = _pipe().map(twice).length_index(key="tokens", cache_dir=tmp_path / "a", num_workers=2)
    monkeypatch.setattr(scan, "PROCESS_MIN", 10**9)
    b = _pipe().map(twice).length_index(key="tokens", cache_dir=tmp_path / "b", num_workers=2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, 2 * DOC_LEN)


def test_a_given_index_is_checked(tmp_path):
    pipe = _pipe()
    np.save(tmp_path / "lengths.npy", DOC_LEN)
    np.testing.assert_array_equal(pipe.length_index(key="tokens", lengths=str(tmp_path / "lengths.npy")), DOC_LEN)
    np.testing.assert_array_equal(pipe.length_index(key="tokens", lengths=DOC_LEN.astype(np.int32)), DOC_LEN)
    with pytest.raises(ValueError, match=r"shape \(300,\).*shape \(299,\)"):
        pipe.length_index(key="tokens", lengths=DOC_LEN[:-1])
    wrong = DOC_LEN.copy()
    wrong[-1] += 1  # the last record is always checked
    with pytest.raises(ValueError, match=rf"record {N - 1} has {DOC_LEN[-1]} tokens, the index says {DOC_LEN[-1] + 1}"):
        pipe.length_index(key="tokens", lengths=wrong)
    negative = DOC_LEN.copy()
    negative[5] = -2
    with pytest.raises(ValueError, match=r"record 5 has length -2"):
        pipe.length_index(key="tokens", lengths=negative)
    with pytest.raises(ValueError, match="one integer per record"):
        pipe.length_index(key="tokens", lengths=DOC_LEN.astype(float))


def test_bad_records_and_places_are_clear_errors(tmp_path):
    with pytest.raises(quern.ScanError, match=r"record 0 of source 'Docs': the record is a dict .*pass key="):
        _pipe().length_index(cache_dir=tmp_path)
    with pytest.raises(quern.ScanError, match=r"record 0 of source 'Docs': no key 'ids' in the record"):
        _pipe().length_index(key="ids", cache_dir=tmp_path)
    with pytest.raises(quern.ScanError, match=r"record 0 .*key 'i': expected a 1-D array of tokens, got shape \(\)"):
        _pipe().length_index(key="i", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="before batch"):
        _pipe().batch(10).length_index(key="tokens")
    with pytest.raises(ValueError, match="random_map"):
        _pipe().random_map(lambda r, rng: r).length_index(key="tokens")
    mixed = quern.mix({"a": _pipe(), "b": _pipe()}, weights=[1, 1])
    with pytest.raises(ValueError, match="mixture"):
        mixed.length_index(key="tokens")


def test_balance_hosts_takes_its_lengths_from_the_index(tmp_path, monkeypatch):
    monkeypatch.setenv("QUERN_CACHE_DIR", str(tmp_path))
    by_index = _pipe().balance_hosts(key="tokens").map(only_i).batch(20)
    by_hand = _pipe().balance_hosts(DOC_LEN).map(only_i).batch(20)
    assert by_index.fingerprint() == by_hand.fingerprint()
    for s in range(5):
        glob = by_hand.batch_at(s)["i"]
        parts = [by_index.batch_at(s, h, 4)["i"] for h in range(4)]
        assert sorted(np.concatenate(parts).tolist()) == sorted(glob.tolist())
        tokens = [int(DOC_LEN[p].sum()) for p in parts]
        assert max(tokens) - min(tokens) <= DOC_LEN.max(), tokens  # balanced within the longest row
    filtered = _pipe().filter(odd, cache_dir=tmp_path).balance_hosts(key="tokens").map(only_i).batch(20)
    rows = np.concatenate([filtered.batch_at(0, h, 2)["i"] for h in range(2)])
    assert all(i % 2 == 1 for i in rows.tolist())
