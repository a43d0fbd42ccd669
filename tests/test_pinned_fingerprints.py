"""Pinned fingerprints: a refactor must not change what a saved checkpoint is compared with.

Each literal below is the fingerprint of a pipeline built here, computed once (after the one
deliberate fingerprint change of issue 22: quern's own transforms described by name, VERSION
and arguments) with the code at commit a2aae17 and pasted in; nothing is recomputed from the
code under test. A change of any of them means every checkpoint saved with such a pipeline is
refused on resume: it must be a deliberate, announced change (and these literals recomputed),
never a side effect of moving code.

Deliberate changes since: ``packed_concat`` (issue 38, 2026-12-05), whose lengths are now described
by the records they are measured from (so that concat plans without a pass over the data); its
literal was recomputed then.
"""

from __future__ import annotations

import numpy as np
import pytest

import quern
from quern.transforms import random as qrandom

PINNED = {
    "balanced_hosts": "3a04d156cfe215b28a1d57a9da47fe30",
    "batch_random_and_remainder": "33c5d53d622142638639571c7c75511e",
    "block_shuffle_random": "5ddad3e5ade07916633c38fa9baa1c51",
    "bucketed": "0fcbc07cdd8a21c03e3a70e9229e5cb8",
    "config": "39eaefd339888044bab12ed42b5d3e09",
    "filtered": "19c56102965d475db77cb6f81a25f87b",
    "global_shuffle_epochs": "cfe960af09708f8ddb4aa53ee8ea80de",
    "mixture_schedule": "347cb123006c77504da47e2a829ee52e",
    "packed_best_fit": "0592d2dabc9e14e596613c085a37f44b",
    "packed_concat": "1170bf1db2cc3c11c4183a6c154ed014",
    "packed_mixture": "a2ece57e5c3e445c051a3128cfb3f3ed",
    "pad_builtin": "6067ee75bba50b00ef98a008c0d94cb2",
    "plain": "c84c3f94b88c244329edbfa2728ca540",
}


def _tokens(n: int = 64, seed: int = 1) -> dict[str, np.ndarray]:
    """``n`` token records of lengths 1..40 (fixed by ``seed``), as a dict of object arrays."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 41, size=n)
    return {"tokens": np.array([np.arange(k, dtype=np.int32) + i for i, k in enumerate(lengths)], dtype=object)}


def _double(x):
    return {"x": x["x"] * 2}


def _noisy(batch, keys):
    return {**batch, "u": qrandom.uniform(keys)}


def _odd(x):
    return int(x["x"]) % 2 == 1


def _jitter(x, rng):
    return {"x": x["x"] + rng.integers(0, 3)}


def _source(n: int = 100):
    return {"x": np.arange(n, dtype=np.int64)}


def _write_array_record(path, n: int = 40) -> None:
    from array_record.python import array_record_module

    w = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for i in range(n):
        w.write(np.arange(i % 7 + 1, dtype=np.int32).tobytes())
    w.close()


def _pipelines(tmp_path) -> dict[str, quern.Pipeline]:
    src = quern.Pipeline.from_source
    tok = lambda seed=3: src(_tokens(), seed=seed).shuffle()  # noqa: E731
    out = {
        "plain": src(_source(), seed=0).batch(10),
        "global_shuffle_epochs": src(_source(), seed=7, num_epochs=3).shuffle().map(_double).batch(8),
        "block_shuffle_random": src(_source(), seed=2**64 - 1)
        .shuffle("block", block_size=4, window=3)
        .random_map(_jitter)
        .batch(5),
        "batch_random_and_remainder": src(_source(), seed=5, num_epochs=1)
        .batch(7, drop_remainder=False)
        .random_map_batch(_noisy),
        "filtered": src(_source(), seed=11).shuffle().filter(_odd, cache_dir=tmp_path).map(_double).batch(4),
        "pad_builtin": src(_tokens(), seed=2).map(quern.transforms.pad(16, key="tokens", mask_key="mask")).batch(8),
        "mixture_schedule": quern.mix(
            {"a": src(_source(), seed=1).shuffle(), "b": src(_source(30), seed=2)},
            schedule=[(0, {"a": 0.7, "b": 0.3}), (20, {"a": 0.2, "b": 0.8})],
            seed=9,
        ).batch(10),
        "packed_best_fit": tok().pack(32, key="tokens", cache_dir=tmp_path).batch(4),
        "packed_concat": src(_tokens(), seed=4).pack(24, mode="concat", key="tokens", cache_dir=tmp_path).batch(2),
        "bucketed": src(_tokens(), seed=6).shuffle().bucket([10, 20, 40], [8, 4, 2], key="tokens", cache_dir=tmp_path),
        "packed_mixture": quern.mix(
            {
                "p": tok(5).pack(32, key="tokens", cache_dir=tmp_path),
                "q": tok(6).pack(32, key="tokens", cache_dir=tmp_path),
            },
            weights={"p": 0.5, "q": 0.5},
            seed=3,
        ).batch(4),
        "balanced_hosts": src(_tokens(), seed=8)
        .balance_hosts(key="tokens")
        .map(quern.transforms.pad(40, key="tokens"))
        .batch(8),
    }
    path = tmp_path / "toks-0.array_record"
    _write_array_record(path)
    cfg = tmp_path / "pipe.yaml"
    cfg.write_text(
        "source: {type: array_record, paths: toks-0.array_record}\n"
        "seed: 2026\nshuffle: global\n"
        "transforms:\n  - {name: decode, kwargs: {dtype: int32}}\n  - {name: pad, kwargs: {length: 8}}\n"
        "batch: {size: 4}\n"
    )
    out["config"] = quern.load_config(str(cfg))
    return out


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return _pipelines(tmp_path_factory.mktemp("pinned"))


def test_every_pipeline_is_pinned(pipes):
    assert sorted(pipes) == sorted(PINNED) and len(PINNED) >= 12


@pytest.mark.parametrize("name", sorted(PINNED))
def test_fingerprint_is_pinned(name, pipes):
    assert pipes[name].fingerprint() == PINNED[name]
