"""transforms/ (decode, pad, metadata_range, counter-based random); collation: test_collate.py."""

import numpy as np
import pytest

import quern
from quern.transforms import decode, pad
from quern.transforms import random as qr


def test_decode_bytes_to_arrays():
    a = np.arange(12, dtype=np.int32)
    assert np.array_equal(decode(np.int32)(a.tobytes()), a)
    assert decode("<i4", shape=(3, -1))(a.tobytes()).shape == (3, 4)
    rec = decode(np.int32, key="t")({"t": a.tobytes(), "y": 1})
    assert rec["y"] == 1 and np.array_equal(rec["t"], a)
    many = decode(np.int32).map_many([a.tobytes(), a[:5].tobytes(), b""])
    assert [len(x) for x in many] == [12, 5, 0]


def test_decode_rejects_bad_input():
    with pytest.raises(ValueError, match="not a whole number"):
        decode(np.int32)(b"12345")
    with pytest.raises(ValueError, match="not a whole number"):
        decode(np.int32).map_many([b"1234", b"123"])
    with pytest.raises(TypeError, match="expects bytes"):
        decode(np.int32)(np.zeros(3))


def test_pad_and_truncate_with_length_and_mask():
    p = pad(4, mask_key="mask", pad_value=-1)
    short, long_ = np.array([1, 2]), np.array([1, 2, 3, 4, 5, 6])
    out = p(short)
    assert out["tokens"].tolist() == [1, 2, -1, -1] and int(out["length"]) == 2
    assert out["mask"].tolist() == [True, True, False, False]
    out = p(long_)
    assert out["tokens"].tolist() == [1, 2, 3, 4] and int(out["length"]) == 4 and out["mask"].all()


def test_pad_map_many_equals_per_record_calls():
    rng = np.random.default_rng(0)
    recs = [rng.integers(0, 100, rng.integers(0, 20)).astype(np.int32) for _ in range(50)]
    p = pad(10)
    batch = quern.collate(p.map_many(recs))
    single = quern.collate([p(r) for r in recs])
    for k in ("tokens", "length"):
        np.testing.assert_array_equal(batch[k], single[k])
    for i, r in enumerate(recs):
        n = min(len(r), 10)
        assert batch["tokens"][i, :n].tolist() == r[:n].tolist() and not batch["tokens"][i, n:].any()
        assert batch["length"][i] == n


def test_pad_dict_records_keep_other_fields():
    p = pad(3, key="ids", output="ids")
    out = quern.collate(p.map_many([{"ids": np.array([5]), "label": 1}, {"ids": np.array([1, 2, 3, 4]), "label": 0}]))
    assert out["ids"].tolist() == [[5, 0, 0], [1, 2, 3]] and out["label"].tolist() == [1, 0]
    assert out["length"].tolist() == [1, 3]


def test_pad_multidimensional_rows_and_bad_length():
    out = pad(3)(np.ones((2, 4)))
    assert out["tokens"].shape == (3, 4) and out["tokens"][2].sum() == 0
    with pytest.raises(ValueError, match="positive integer"):
        pad(0)
    with pytest.raises(ValueError, match=r"row 1 has shape \(2, 5\)"):
        pad(3).map_many([np.ones((2, 4)), np.ones((2, 5))])


def test_random_helpers_are_deterministic_and_well_spread():
    keys = qr.row_keys(7, np.arange(20_000))
    u = qr.uniform(keys, (3,))
    assert u.shape == (20_000, 3) and u.min() >= 0 and u.max() < 1
    np.testing.assert_array_equal(u, qr.uniform(keys, (3,)))
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - np.sqrt(1 / 12)) < 0.01
    # a row's values do not depend on which other rows are in the call
    np.testing.assert_array_equal(qr.uniform(keys[100:110], (3,)), u[100:110])
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.03
    ints = qr.integers(keys, 3, 9)
    assert ints.min() == 3 and ints.max() == 8 and set(np.unique(ints)) == set(range(3, 9))
    z = qr.normal(keys, (2,))
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.03
    assert not np.array_equal(qr.uniform(qr.row_keys(8, np.arange(5))), qr.uniform(keys[:5]))
    with pytest.raises(ValueError, match="low < high"):
        qr.integers(keys, 5, 5)


def test_pad_of_records_with_differing_fields_leaves_the_error_to_collate():
    out = pad(3, key="ids").map_many([{"ids": np.array([1]), "a": 1}, {"ids": np.array([2]), "b": 2}])
    assert isinstance(out, list) and out[0]["a"] == 1 and out[1]["b"] == 2
    with pytest.raises(ValueError, match="row 1 has keys"):
        quern.collate(out)
