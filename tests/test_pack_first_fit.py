"""Tests of pack(mode="first_fit"), several packed columns and pad_value (pipeline/definition/pack.py,
pipeline/order/packing.py, pipeline/streams/packed_rows.py): rows compared with grain's own
FirstFitPackIterDataset on the same documents."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers import assert_batches_equal, assert_host_slices_make_the_batch, assert_iterator_gives_batch_at, docs_folder

import quern


def documents(n: int, seed: int, room: dict[str, int], same: bool = False) -> list[dict[str, np.ndarray]]:
    """``n`` dict records with a column per key of ``room``, each of 1..room tokens (all one length if ``same``)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        first = int(rng.integers(1, min(room.values()) + 1))
        out.append(
            {
                k: rng.integers(1, 30_000, first if same else int(rng.integers(1, r + 1))).astype(np.int32)
                for k, r in room.items()
            }
        )
    return out


def grain_rows(docs, room, num_bins, max_per_bin, pads):
    import grain
    from grain._src.python.dataset.transformations.packing import FirstFitPackIterDataset

    ds = grain.MapDataset.source(docs).to_iter_dataset()
    ds = FirstFitPackIterDataset(
        ds,
        length_struct=dict(room),
        num_packing_bins=num_bins,
        shuffle_bins=False,
        max_sequences_per_bin=max_per_bin,
        padding_struct={k: pads.get(k, 0) for k in room},
    )
    return list(ds)


def quern_rows(pipe):
    rows = pipe.batch(1)
    return [{k: v[0] for k, v in rows.batch_at(s).items()} for s in range(rows.num_steps)]


CASES = [
    ({"inputs": 32, "targets": 32}, 4, None, {}, True),
    ({"inputs": 32, "targets": 24}, 3, 2, {"targets": -1}, False),
    ({"inputs": 16}, 1, None, {"inputs": 7}, False),
    ({"inputs": 40, "targets": 40}, 8, 3, {"inputs": 0, "targets": 5}, True),
]


@pytest.mark.parametrize("room,num_bins,max_per_bin,pads,same", CASES, ids=[str(i) for i in range(len(CASES))])
def test_first_fit_rows_are_grains_row_for_row(room, num_bins, max_per_bin, pads, same):
    docs = documents(300, seed=num_bins, room=room, same=same)
    pipe = quern.Pipeline.from_source(docs, num_epochs=1).pack(
        room, mode="first_fit", num_bins=num_bins, max_sequences_per_bin=max_per_bin, pad_value=pads
    )
    want = grain_rows(docs, room, num_bins, max_per_bin, pads)
    got = quern_rows(pipe)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), i
        for k in w:
            assert g[k].dtype == w[k].dtype and np.array_equal(g[k], w[k]), (i, k)


def test_the_one_column_form_keeps_its_names():
    docs = documents(120, seed=1, room={"tokens": 20})
    pipe = quern.Pipeline.from_source(docs, num_epochs=1).pack(20, mode="first_fit", key="tokens", num_bins=2)
    want = grain_rows(docs, {"tokens": 20}, 2, None, {})
    got = quern_rows(pipe)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.array_equal(g["tokens"], w["tokens"])
        assert np.array_equal(g["segment_ids"], w["tokens_segment_ids"])
        assert np.array_equal(g["positions"], w["tokens_positions"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_first_fit_is_step_addressable_across_epochs_hosts_workers_and_resumes(num_workers):
    docs = documents(200, seed=4, room={"inputs": 24, "targets": 24}, same=True)
    pipe = (
        quern.Pipeline.from_source(docs, seed=9, num_epochs=3)
        .shuffle()
        .pack({"inputs": 24, "targets": 24}, mode="first_fit", num_bins=4, pad_value={"targets": -1})
        .batch(4, drop_remainder=False)
    )
    stream = pipe.stream
    per_epoch = [stream.rows_before(e + 1) - stream.rows_before(e) for e in range(3)]
    tokens = sorted(t for d in docs for t in d["inputs"].tolist())
    assert all(r >= -(-len(tokens) // 24) for r in per_epoch)  # no row holds more than 24 tokens
    assert pipe.num_steps == -(-sum(per_epoch) // 4)
    assert_iterator_gives_batch_at(pipe, num_workers=num_workers)
    assert_iterator_gives_batch_at(pipe, start_step=11, count=6, num_workers=num_workers)
    assert_host_slices_make_the_batch(pipe, (0, 13))
    assert sorted(stream.pieces(np.arange(per_epoch[0])).ids.tolist()) == list(range(200))  # each once an epoch
    rows = quern_rows(quern.Pipeline(stream=stream))[: per_epoch[0]]
    assert sorted(t for r in rows for t in r["inputs"][r["inputs_segment_ids"] > 0].tolist()) == tokens


def test_several_columns_with_best_fit_and_concat_are_cut_together():
    docs = documents(80, seed=2, room={"inputs": 30, "targets": 30}, same=True)
    for mode in ("best_fit", "concat"):
        pipe = quern.Pipeline.from_source(docs, num_epochs=1).pack({"inputs": 16, "targets": 16}, mode=mode)
        for r in quern_rows(pipe):
            assert np.array_equal(r["inputs_segment_ids"], r["targets_segment_ids"])
            assert np.array_equal(r["inputs_positions"], r["targets_positions"])
    bad = documents(10, seed=2, room={"inputs": 30, "targets": 30})
    with pytest.raises(
        ValueError,
        match=r"record (\d+) of source 'list' has \d+ tokens in column 'targets' and \d+ in "
        r"'inputs'; best_fit and concat cut the columns together",
    ):
        quern.Pipeline.from_source(bad).pack({"inputs": 16, "targets": 16})
    with pytest.raises(ValueError, match=r"cuts documents, so its columns need one row length"):
        quern.Pipeline.from_source(docs).pack({"inputs": 16, "targets": 8}, mode="concat")


def test_bad_settings_are_clear_errors():
    docs = documents(20, seed=3, room={"tokens": 10})
    base = quern.Pipeline.from_source(docs)
    cases = [
        (dict(seq_len=10, mode="first_fit", key="tokens"), "needs num_bins"),
        (dict(seq_len=10, mode="first_fit", key="tokens", num_bins=0), "num_bins must be"),
        (dict(seq_len=10, key="tokens", num_bins=2), "num_bins=...) is first_fit's setting"),
        (dict(seq_len=10, key="tokens", mode="concat", max_sequences_per_bin=2), "places whole documents"),
        (dict(seq_len=10, mode="first_fit", key="tokens", num_bins=2, max_sequences_per_bin=0), "max_sequences"),
        (dict(seq_len={"tokens": 10}, key="tokens"), "leave key out"),
        (dict(seq_len={}), "name at least one column"),
        (dict(seq_len={"tokens": 10}, pad_value={"other": 1}), "no packed column 'other'"),
        (dict(seq_len=10, key="tokens", pad_value="x"), "must be a number"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            base.pack(**kwargs)
    long = docs[:3] + [{"tokens": np.arange(1, 12, dtype=np.int32)}] + docs
    message = (
        r"record 3 of source 'list' has 11 tokens in 'tokens', more than its row of 10; first_fit places whole "
        r"documents: truncate them first"
    )
    lazy = quern.Pipeline.from_source(long).pack(10, mode="first_fit", key="tokens", num_bins=2)
    with pytest.raises(ValueError, match=message):  # measured when the plan reaches it
        lazy.batch(1).batch_at(0)
    lengths = np.asarray([len(d["tokens"]) for d in long])
    with pytest.raises(ValueError, match=message):  # a length index given: at pack()
        quern.Pipeline.from_source(long).pack(10, mode="first_fit", key="tokens", num_bins=2, lengths=lengths)


def test_a_first_fit_config_of_two_columns_loads_back(tmp_path, isolated_cache):
    with docs_folder(tmp_path, 50, 30, seed=5, helpers="", prefix="ff") as (d, _):
        src = quern.sources.ParquetSource(str(d / "docs.parquet"))
        pipe = (
            quern.Pipeline.from_source(src, seed=3, num_epochs=2)
            .shuffle()
            .pack(
                {"tokens": 32, "mask": 32}, mode="first_fit", num_bins=3, max_sequences_per_bin=4, pad_value={"mask": 9}
            )
            .batch(3)
        )
        cfg = pipe.to_config()
        assert cfg["pack"] == {
            "seq_len": {"tokens": 32, "mask": 32},
            "mode": "first_fit",
            "key": None,
            "lengths": None,
            "num_bins": 3,
            "max_sequences_per_bin": 4,
            "pad_value": {"mask": 9},
        }
        path = d / "ff.yaml"
        path.write_text(yaml.safe_dump(cfg))
        back = quern.load_config(path)
        assert back.fingerprint() == pipe.fingerprint()
        for s in (0, 4):
            assert_batches_equal(back.batch_at(s), pipe.batch_at(s), f"step {s}")
        batch = pipe.batch_at(0)
        assert (batch["mask"][batch["mask_segment_ids"] == 0] == 9).all()
        other = (
            quern.Pipeline.from_source(src, seed=3, num_epochs=2)
            .shuffle()
            .pack(
                {"tokens": 32, "mask": 32}, mode="first_fit", num_bins=2, max_sequences_per_bin=4, pad_value={"mask": 9}
            )
            .batch(3)
        )
        assert other.fingerprint() != pipe.fingerprint()


def _reference_best_fit(lengths, room, cap):
    """Best-fit decreasing with a cap, one row at a time, written plainly: the rows' item lists."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if used[r] + lengths[i] <= room and len(rows[r]) < cap]
        if fits:
            r = min(fits, key=lambda r: (room - used[r], r))
        else:
            rows.append([])
            used.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        used[r] += lengths[i]
    return rows


@pytest.mark.parametrize("cap", [1, 2, 3, 5])
def test_best_fit_with_max_sequences_per_bin_is_best_fit_decreasing_with_a_cap(cap):
    from quern.pipeline.order.packing import best_fit_capped

    rng = np.random.default_rng(cap)
    for _ in range(20):
        lengths = rng.integers(1, 17, int(rng.integers(1, 80))).tolist()
        got, n = best_fit_capped(np.asarray(lengths), 16, cap)
        want = _reference_best_fit(lengths, 16, cap)
        assert n == len(want) and [sorted(np.flatnonzero(got == r).tolist()) for r in range(n)] == [
            sorted(r) for r in want
        ]
    docs = documents(150, seed=cap, room={"tokens": 20})
    pipe = quern.Pipeline.from_source(docs, num_epochs=1).pack(20, key="tokens", max_sequences_per_bin=cap)
    rows = quern_rows(pipe)
    assert max(int(r["segment_ids"].max()) for r in rows) <= cap  # segments 1..k: at most cap documents a row
    assert sorted(t for r in rows for t in r["tokens"][r["segment_ids"] > 0].tolist()) == sorted(
        t for d in docs for t in d["tokens"].tolist()
    )
