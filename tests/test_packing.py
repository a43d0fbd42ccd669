"""Tests of pipeline/streams/packed.py and pipeline/plan/packing.py.

Pipeline.pack: documents packed into rows of ``seq_len`` tokens, planned from the length
index alone (issue 12, points 2 and 3).

Document ``i`` holds the tokens ``1000 * (i + 1) + arange(DOC_LEN[i])``, so every token
names its document and its offset in it (and no token is 0, the padding). Every
expected row, piece and count is computed here from ``DOC_LEN`` and a brute-force
best-fit decreasing written below, never by the code under test; the order of an
epoch's documents comes from ``record_ids`` of the pipeline before ``pack``. Cache
folders are ``tmp_path``.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from helpers import assert_batches_equal, assert_iterator_gives_batch_at

import quern
from quern.pipeline.order.packing import EpochPlan, best_fit_decreasing, plan_epoch

pytestmark = pytest.mark.timeout(120)

N = 200
S = 16  # seq_len of the pipelines here
B = 8  # rows per step
DOC_LEN = (np.arange(N) * 7919) % 53  # 0..52 tokens: 4 empty documents, 136 longer than S, 12 multiples of S
TOTAL = int(DOC_LEN.sum())  # 5214 tokens per epoch, 5214 % 16 = 14: concat's last row is padded
KEYS = {"tokens", "segment_ids", "positions", "mask"}

CALLS = types.ModuleType("quern_test_packing_calls")  # counts reads (a module: fingerprinted by name only)
CALLS.n = 0


def doc_tokens(i):
    return np.arange(1000 * (i + 1), 1000 * (i + 1) + int(DOC_LEN[i]), dtype=np.int32)


def mask_of(tokens):
    return (np.asarray(tokens) % 3 != 0).astype(np.int8)


class Docs:
    """Record ``i``: per-token ``tokens`` and ``mask``; a scalar ``i``, an array one longer than
    the tokens and a 2-D array (none of them per-token: dropped by pack). Counts the reads."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        CALLS.n += 1
        i = int(i)
        t = doc_tokens(i)
        n = len(t)
        return {"tokens": t, "mask": mask_of(t), "i": i, "longer": np.arange(n + 1), "grid": np.zeros((n, 2))}

    def identity(self):
        return {"type": "Docs", "n": N}


class BadDocs(Docs):
    """Record 37's tokens are 2-D."""

    def __getitem__(self, i):
        rec = super().__getitem__(i)
        if int(i) == 37:
            rec["tokens"] = np.zeros((2, 3), dtype=np.int32)
        return rec

    def identity(self):
        return {"type": "BadDocs", "n": N}


class NoTokens(Docs):
    def __getitem__(self, i):
        return {"tokens": np.zeros(0, dtype=np.int32)}

    def identity(self):
        return {"type": "NoTokens", "n": N}


def add_one(row):  # a transform after pack: it sees rows
    assert row["tokens"].shape == (S,), row["tokens"].shape
    return {**row, "tokens": row["tokens"] + 1}


# --------------------------------------------------------------------------- helpers


def _inner(seed=3, num_epochs=None, shuffle=True):
    pipe = quern.Pipeline.from_source(Docs(), seed=seed, num_epochs=num_epochs)
    return pipe.shuffle() if shuffle else pipe


def _packed(cache, mode="best_fit", seed=3, num_epochs=2, shuffle=True, seq_len=S):
    return _inner(seed, num_epochs, shuffle).pack(seq_len, mode=mode, key="tokens", cache_dir=cache)


def _pipe(cache, mode="best_fit", seed=3, num_epochs=2, batch=B, drop_remainder=False, shuffle=True):
    return _packed(cache, mode, seed, num_epochs, shuffle).batch(batch, drop_remainder=drop_remainder)


def _all_rows(pipe):
    """Every row of a finite pipeline, in order: a dict of (rows, S) arrays."""
    batches = pipe.batches_at(0, pipe.num_steps)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _decode(rows, mode):
    """The pieces ``(document, start, length)`` of each row, read from its tokens, after
    checking the row's layout: segments 1..k in order, then padding (segment 0, tokens,
    positions and mask 0); each segment a run of consecutive tokens of one document; the
    positions of ``mode``; the mask packed alongside the tokens."""
    out = []
    for r in range(len(rows["tokens"])):
        tok, seg, pos, mask = (rows[k][r] for k in ("tokens", "segment_ids", "positions", "mask"))
        used = int((seg > 0).sum())
        assert used >= 1, f"row {r} is empty"
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all(), f"row {r}: padding inside the row: {seg}"
        assert (tok[used:] == 0).all() and (pos[used:] == 0).all() and (mask[used:] == 0).all(), f"row {r}"
        assert seg[0] == 1 and set(np.diff(seg[:used]).tolist()) <= {0, 1}, f"row {r}: segment ids {seg}"
        pieces = []
        for j in range(1, int(seg.max()) + 1):
            t = tok[seg == j].astype(np.int64)
            doc = int(t[0]) // 1000 - 1
            off = t - 1000 * (doc + 1)
            assert (t // 1000 == doc + 1).all(), f"row {r} segment {j} mixes documents: {t}"
            np.testing.assert_array_equal(off, np.arange(off[0], off[0] + len(t)), err_msg=f"row {r} segment {j}")
            want_pos = np.arange(len(t)) if mode == "best_fit" else off
            np.testing.assert_array_equal(pos[seg == j], want_pos, err_msg=f"row {r} segment {j}: positions")
            np.testing.assert_array_equal(mask[seg == j], mask_of(t), err_msg=f"row {r} segment {j}: mask")
            pieces.append((doc, int(off[0]), len(t)))
        out.append(pieces)
    return out


def _reference_bfd(lengths, seq_len):
    """Best-fit decreasing, one item at a time: longest first (ties by index), each into the
    open row with the least room that fits it (ties: the row opened first), else a new row.
    Rows are numbered in the order they are opened."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    room: list[int] = []
    row = [0] * len(lengths)
    for i in order:
        ell = int(lengths[i])
        best = None
        for r, left in enumerate(room):
            if left >= ell and (best is None or left < room[best]):
                best = r
        if best is None:
            room.append(seq_len)
            best = len(room) - 1
        room[best] -= ell
        row[i] = best
    return row, len(room)


def _reference_rows(stream_ids, seq_len):
    """The rows of a best_fit epoch (as sorted lists of pieces, in no particular order) by
    the reference: full pieces a row each, remainders by ``_reference_bfd``."""
    rows = []
    rem_docs, rem = [], []
    for d in stream_ids.tolist():
        n = int(DOC_LEN[d])
        for k in range(n // seq_len):
            rows.append([(d, k * seq_len, seq_len)])
        if n % seq_len:
            rem_docs.append((d, n - n % seq_len, n % seq_len))
            rem.append(n % seq_len)
    bins, n_bins = _reference_bfd(rem, seq_len)
    packed = [[] for _ in range(n_bins)]
    for piece, b in zip(rem_docs, bins):
        packed[b].append(piece)
    return rows + packed


def _profiles(rows):
    """Each row's piece lengths, sorted; the list of them sorted: what best-fit decreasing
    fixes whatever rows it picks among those with equal room."""
    return sorted(tuple(sorted(n for _, _, n in row)) for row in rows)


def _stream_ids(epoch, seed=3, shuffle=True):
    return _inner(seed, None, shuffle).record_ids(np.arange(epoch * N, (epoch + 1) * N))


def _expected_best_fit_rows(seed=3, shuffle=True):
    return len(_reference_rows(_stream_ids(0, seed, shuffle), S))


# --------------------------------------------------------------------------- 1. best_fit rows


def test_best_fit_epochs_hold_every_document_once(tmp_path):
    pipe = _pipe(tmp_path, "best_fit", num_epochs=2)
    rows = _all_rows(pipe)
    assert set(rows) == KEYS  # the scalar, the longer array and the 2-D array are dropped
    assert rows["tokens"].dtype == np.int32 and rows["mask"].dtype == np.int8
    assert rows["segment_ids"].dtype == np.int32 and rows["positions"].dtype == np.int32
    assert rows["tokens"].shape[1] == S
    per_epoch = _expected_best_fit_rows()
    assert len(rows["tokens"]) == 2 * per_epoch
    pieces = _decode(rows, "best_fit")
    for e in range(2):
        mine = pieces[e * per_epoch : (e + 1) * per_epoch]
        ids = _stream_ids(e)
        rank = np.empty(N, dtype=np.int64)
        rank[ids] = np.arange(N)
        by_doc: dict[int, list] = {}
        for r, row in enumerate(mine):
            docs = [d for d, _, _ in row]
            assert rank[docs].tolist() == sorted(rank[docs].tolist()), f"epoch {e} row {r}: not in stream order"
            assert sum(n for _, _, n in row) <= S
            for d, start, n in row:
                by_doc.setdefault(d, []).append((start, n))
                if n == S:
                    assert len(row) == 1, f"epoch {e} row {r}: a full piece shares its row"
        assert sorted(by_doc) == sorted(np.flatnonzero(DOC_LEN > 0).tolist()), f"epoch {e}"
        for d, got in by_doc.items():
            n = int(DOC_LEN[d])
            want = [(k * S, S) for k in range(n // S)] + ([(n - n % S, n % S)] if n % S else [])
            assert sorted(got) == want, f"epoch {e} document {d}"
        assert _profiles(mine) == _profiles(_reference_rows(ids, S)), f"epoch {e}: not best-fit decreasing"


def test_best_fit_rows_come_in_a_keyed_order_per_epoch(tmp_path):
    """Without shuffle every epoch has the same documents in the same order, so the same
    rows: only their keyed order differs (between epochs, and with the seed)."""
    rows = _all_rows(_pipe(tmp_path, "best_fit", num_epochs=2, shuffle=False))
    per_epoch = _expected_best_fit_rows(shuffle=False)
    pieces = [tuple(p) for p in _decode(rows, "best_fit")]
    first, second = pieces[:per_epoch], pieces[per_epoch:]
    assert sorted(first) == sorted(second)
    assert sorted(first) == sorted(tuple(sorted(r)) for r in _reference_rows(np.arange(N), S))
    assert first != second
    other = [tuple(p) for p in _decode(_all_rows(_pipe(tmp_path, "best_fit", seed=4, shuffle=False)), "best_fit")]
    assert sorted(other[:per_epoch]) == sorted(first) and other[:per_epoch] != first
    # long and short documents are spread: the rows of full pieces are not all at the start
    full = [len(p) == 1 and p[0][2] == S for p in first]
    assert not all(full[: sum(full)])


# --------------------------------------------------------------------------- 2. concat rows


def _concat_epoch(epoch, seed=3):
    """The epoch's documents in stream order, concatenated and cut into padded rows:
    tokens, segment ids, positions and mask, built by hand."""
    ids = _stream_ids(epoch, seed)
    tokens = np.concatenate([doc_tokens(i) for i in ids.tolist()])
    doc = np.repeat(np.arange(N), DOC_LEN[ids])
    offset = np.concatenate([np.arange(DOC_LEN[i]) for i in ids.tolist()])
    rows = -(-len(tokens) // S)
    pad = rows * S - len(tokens)
    seg = np.zeros(rows * S, dtype=np.int32)
    for r in range(rows):
        d = doc[r * S : (r + 1) * S]
        seg[r * S : r * S + len(d)] = 1 + np.concatenate([[0], np.cumsum(d[1:] != d[:-1])])
    out = {
        "tokens": np.concatenate([tokens, np.zeros(pad, np.int32)]),
        "segment_ids": seg,
        "positions": np.concatenate([offset, np.zeros(pad, np.int64)]).astype(np.int32),
        "mask": np.concatenate([mask_of(tokens), np.zeros(pad, np.int8)]),
    }
    return {k: v.reshape(rows, S) for k, v in out.items()}


def test_concat_rows_are_the_stream_cut_into_rows(tmp_path):
    pipe = _pipe(tmp_path, "concat", num_epochs=3)
    rows = _all_rows(pipe)
    assert set(rows) == KEYS
    per_epoch = -(-TOTAL // S)
    assert len(rows["tokens"]) == 3 * per_epoch  # the same in every epoch
    for e in range(3):
        want = _concat_epoch(e)
        assert len(want["tokens"]) == per_epoch
        got = {k: v[e * per_epoch : (e + 1) * per_epoch] for k, v in rows.items()}
        assert_batches_equal(got, want, f"epoch {e}")
        assert (got["segment_ids"][-1] == 0).sum() == per_epoch * S - TOTAL > 0  # the last row is padded
    pieces = _decode(rows, "concat")  # positions count from each piece's offset in its document
    continued = [r for r in range(1, len(pieces)) if pieces[r][0][1] > 0]
    assert continued, "no document continues into the next row"
    for r in continued:
        d, start, _ = pieces[r][0]
        prev = pieces[r - 1][-1]
        assert prev[0] == d and prev[1] + prev[2] == start, f"row {r}"


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("num_epochs", [1, 2, 3])
@pytest.mark.parametrize("batch", [5, 8, 13])
def test_concat_num_steps_is_a_closed_form(tmp_path, drop_remainder, num_epochs, batch):
    pipe = _pipe(tmp_path, "concat", num_epochs=num_epochs, batch=batch, drop_remainder=drop_remainder)
    rows = num_epochs * -(-TOTAL // S)
    assert pipe.num_steps == (rows // batch if drop_remainder else -(-rows // batch))


# --------------------------------------------------------------------------- 3. the plan: fill and best-fit decreasing


def _check_plan(plan, lengths, seq_len):
    """A plan is valid: rows non-empty and at most seq_len tokens, every document's tokens in
    exactly one piece each."""
    assert isinstance(plan, EpochPlan)
    assert plan.row_ptr[0] == 0 and plan.row_ptr[-1] == len(plan.doc)
    per_row = np.diff(plan.row_ptr)
    assert (per_row >= 1).all()
    tokens = np.add.reduceat(plan.length, plan.row_ptr[:-1]) if plan.rows else np.zeros(0)
    assert (tokens <= seq_len).all() and (plan.length >= 1).all()
    order = np.lexsort((plan.start, plan.doc))  # each document's pieces, by start
    doc, start, length = plan.doc[order], plan.start[order], plan.length[order]
    first = np.concatenate([[True], doc[1:] != doc[:-1]])
    np.testing.assert_array_equal(np.unique(doc), np.flatnonzero(np.asarray(lengths) > 0))
    assert (start[first] == 0).all(), "a document's first piece does not start at 0"
    assert (start[1:][~first[1:]] == (start + length)[:-1][~first[1:]]).all(), "pieces overlap or leave a gap"
    ends = np.concatenate([np.flatnonzero(first[1:]), [len(doc) - 1]])
    np.testing.assert_array_equal(start[ends] + length[ends], np.asarray(lengths)[doc[ends]])


def test_best_fit_fill_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 20000), 1, 8000).astype(np.int64)
    plan = plan_epoch(lengths, seq_len=2048, mode="best_fit", seed=1, epoch=0)
    _check_plan(plan, lengths, 2048)
    fill = lengths.sum() / (plan.rows * 2048)
    assert fill >= 0.97, fill
    concat = plan_epoch(lengths, seq_len=2048, mode="concat", seed=1, epoch=0)
    _check_plan(concat, lengths, 2048)
    assert concat.rows == -(-int(lengths.sum()) // 2048)


def _bfd_inputs():
    rng = np.random.default_rng(12)
    cases = []
    for seq_len, kind in [(1, "uniform"), (7, "uniform"), (10, "uniform"), (16, "geometric"),
                          (64, "uniform"), (100, "few"), (2048, "lognormal")]:  # fmt: skip
        if kind == "uniform":
            lengths = rng.integers(1, seq_len + 1, 200)
        elif kind == "geometric":
            lengths = np.clip(rng.geometric(0.3, 200), 1, seq_len)
        elif kind == "few":
            lengths = rng.choice(rng.integers(1, seq_len + 1, 4), 200)
        else:
            lengths = np.clip(rng.lognormal(5.5, 1.0, 200), 1, seq_len).astype(np.int64)
        cases.append(pytest.param(lengths, seq_len, id=f"S{seq_len}-{kind}"))
    return cases


@pytest.mark.parametrize("lengths, seq_len", _bfd_inputs())
def test_best_fit_decreasing_places_each_item_like_the_reference(lengths, seq_len):
    got, rows = best_fit_decreasing(lengths, seq_len)
    want, want_rows = _reference_bfd(lengths, seq_len)
    assert rows == want_rows
    diff = np.flatnonzero(got != np.asarray(want))
    assert not diff.size, (
        f"{diff.size} items placed otherwise than best-fit decreasing with ties to the row opened first; "
        f"first: item {diff[0]} (length {lengths[diff[0]]}) in row {got[diff[0]]}, the reference's row {want[diff[0]]}"
    )


@pytest.mark.parametrize("lengths, seq_len", _bfd_inputs())
def test_best_fit_decreasing_is_a_valid_best_fit_decreasing(lengths, seq_len):
    """Whatever the tie rule between rows of equal room: items longest first (ties by
    index), each into a row of the least room that fits, a new row (the next number) only
    when none fits, no row over seq_len."""
    got, rows = best_fit_decreasing(lengths, seq_len)
    assert got.dtype == np.int64 and got.shape == lengths.shape
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        ell, r = int(lengths[i]), int(got[i])
        fits = [left for left in room if left >= ell]
        if r == len(room):
            assert not fits, f"item {i}: a new row although a row fits"
            room.append(seq_len)
        assert r < len(room), f"item {i}: row {r} is not the next row to open"
        assert room[r] >= ell and room[r] == min(fits or [seq_len]), f"item {i}: not the least room that fits"
        room[r] -= ell
    assert rows == len(room)
    empty, none = best_fit_decreasing(np.zeros(0, dtype=np.int64), seq_len)
    assert none == 0 and empty.shape == (0,)


GOLDEN_LENGTHS = np.array([3, 9, 0, 5, 8, 2, 7, 1, 4, 17, 6, 3, 5, 2])


def test_golden_plans():
    # computed by this implementation on 2026-11-30; the packing plan is part of the
    # published order: a change must be a deliberate, versioned event
    best = plan_epoch(GOLDEN_LENGTHS, seq_len=8, mode="best_fit", seed=5, epoch=0)
    assert best.row_ptr.tolist() == [0, 1, 5, 6, 7, 9, 11, 13, 15, 16]
    assert best.doc.tolist() == [4, 7, 8, 9, 13, 9, 1, 0, 3, 5, 10, 11, 12, 1, 6, 9]
    assert best.start.tolist() == [0, 0, 0, 16, 0, 8, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0]
    assert best.length.tolist() == [8, 1, 4, 1, 2, 8, 8, 3, 5, 2, 6, 3, 5, 1, 7, 8]
    concat = plan_epoch(GOLDEN_LENGTHS, seq_len=8, mode="concat", seed=5, epoch=0)
    assert concat.row_ptr.tolist() == [0, 2, 4, 6, 9, 13, 14, 15, 17, 20]
    assert concat.doc.tolist() == [0, 1, 1, 3, 3, 4, 4, 5, 6, 6, 7, 8, 9, 9, 9, 10, 11, 11, 12, 13]
    assert concat.start.tolist() == [0, 0, 5, 0, 4, 0, 7, 0, 0, 5, 0, 0, 0, 1, 9, 0, 0, 2, 0, 0]
    assert concat.length.tolist() == [3, 5, 4, 4, 1, 7, 1, 2, 5, 2, 1, 4, 1, 8, 8, 6, 2, 1, 5, 2]
    for plan in (best, concat):
        _check_plan(plan, GOLDEN_LENGTHS, 8)
    # by hand: best_fit's rows are the reference's (in another order), inside a row in stream order
    pieces = list(zip(best.doc.tolist(), best.start.tolist(), best.length.tolist()))
    rows = [pieces[best.row_ptr[r] : best.row_ptr[r + 1]] for r in range(best.rows)]
    for row in rows:
        assert [d for d, _, _ in row] == sorted(d for d, _, _ in row)
    by_ref = []
    whole = GOLDEN_LENGTHS // 8
    for d in np.flatnonzero(whole).tolist():
        by_ref += [[(d, 8 * k, 8)] for k in range(int(whole[d]))]
    small = np.flatnonzero(GOLDEN_LENGTHS % 8).tolist()
    bins, n_bins = _reference_bfd([int(GOLDEN_LENGTHS[d]) % 8 for d in small], 8)
    for b in range(n_bins):
        by_ref.append([(d, 8 * int(whole[d]), int(GOLDEN_LENGTHS[d]) % 8) for d, x in zip(small, bins) if x == b])
    assert sorted(rows) == sorted(by_ref)
    # by hand: concat is the concatenation cut every 8 tokens
    flat = [(d, k) for d, n in enumerate(GOLDEN_LENGTHS.tolist()) for k in range(n)]
    for r in range(concat.rows):
        sel = slice(concat.row_ptr[r], concat.row_ptr[r + 1])
        got = [(d, s + k) for d, s, n in zip(concat.doc[sel], concat.start[sel], concat.length[sel]) for k in range(n)]
        assert got == flat[8 * r : 8 * r + 8]
    # the plan depends on the epoch and the seed for best_fit (order only), not for concat
    for seed, epoch in [(5, 1), (6, 0)]:
        other = plan_epoch(GOLDEN_LENGTHS, 8, "best_fit", seed, epoch)
        assert other.doc.tolist() != best.doc.tolist()
        assert sorted(map(tuple, np.stack(other[1:], 1).tolist())) == sorted(map(tuple, np.stack(best[1:], 1).tolist()))
        assert all(np.array_equal(a, b) for a, b in zip(plan_epoch(GOLDEN_LENGTHS, 8, "concat", seed, epoch), concat))
    again = plan_epoch(GOLDEN_LENGTHS.tolist(), 8, "best_fit", 5, 0)
    assert all(np.array_equal(a, b) for a, b in zip(again, best))


# --------------------------------------------------------------------------- 4. steps: addressable, deterministic


@pytest.mark.parametrize("mode", ["best_fit", "concat"])
def test_iterator_equals_batch_at(tmp_path, mode):
    pipe = _pipe(tmp_path, mode, num_epochs=2)
    assert_iterator_gives_batch_at(pipe)


def test_worker_processes_give_the_same_batches(tmp_path):
    pipe = _pipe(tmp_path, "best_fit", num_epochs=None)
    start = _expected_best_fit_rows() // B - 3  # a few steps on either side of the first epoch's end
    with pipe.iterator(start_step=start, num_workers=2) as it:
        assert it.wait_for_workers(60), "workers did not start"
        got = [{k: np.array(v) for k, v in next(it).items()} for _ in range(8)]  # copies: slots are lent
    with pipe.iterator(start_step=start, num_workers=0) as it:
        want = [next(it) for _ in range(8)]
    for s, (g, w) in enumerate(zip(got, want), start):
        assert_batches_equal(g, w, f"step {s}")


@pytest.mark.parametrize("mode", ["best_fit", "concat"])
def test_host_slices_concatenate_to_the_global_batch(tmp_path, mode):
    pipe = _pipe(tmp_path, mode, num_epochs=2)
    per_epoch = _expected_best_fit_rows() if mode == "best_fit" else -(-TOTAL // S)
    boundary = per_epoch // B  # holds the end of epoch 0 and the start of epoch 1
    assert per_epoch % B
    for s in [0, 1, boundary, pipe.num_steps - 1]:  # the last one is partial (4 rows)
        whole = pipe.batch_at(s)
        parts = [pipe.batch_at(s, h, 2) for h in range(2)]
        assert_batches_equal({k: np.concatenate([p[k] for p in parts]) for k in whole}, whole, f"step {s}")
        assert pipe.explain(s, 0, 2) + pipe.explain(s, 1, 2) == pipe.explain(s)
    assert len(pipe.batch_at(pipe.num_steps - 1)["tokens"]) == 4


def test_resume_mid_epoch_gives_the_remaining_batches(tmp_path):
    pipe = _pipe(tmp_path, "best_fit", num_epochs=2)
    with pipe.iterator() as it:
        for _ in range(20):  # 160 of 326 rows: mid-epoch
            next(it)
        state = json.loads(json.dumps(it.state()))
        rest = list(it)
    assert state["step"] == 20
    again = _pipe(tmp_path, "best_fit", num_epochs=2)  # rebuilt: the index from the cache
    with again.resume(state) as it:
        resumed = list(it)
    assert len(resumed) == len(rest) == again.num_steps - 20
    for s, (g, w) in enumerate(zip(resumed, rest), 20):
        assert_batches_equal(g, w, f"step {s}")
    other = _inner(3, 2).pack(S + 1, key="tokens", cache_dir=tmp_path).batch(B, drop_remainder=False)
    with pytest.raises(ValueError, match="fingerprint"):
        other.resume(state)


@pytest.mark.parametrize("mode", ["best_fit", "concat"])
def test_a_step_in_epoch_3_is_the_same_cold_and_warm(tmp_path, mode):
    per_epoch = _expected_best_fit_rows() if mode == "best_fit" else -(-TOTAL // S)
    target = 3 * per_epoch // B + 5  # in epoch 3
    warm = _pipe(tmp_path, mode, num_epochs=None)
    with warm.iterator() as it:
        seen = [next(it) for _ in range(4 * per_epoch // B + 2)]  # into epoch 4
    for s in [target, 3, target + 10]:  # then back to epoch 0: its plan was dropped since
        assert_batches_equal(warm.batch_at(s), seen[s], f"warm step {s}")
    cold = _pipe(tmp_path, mode, num_epochs=None)  # a fresh object: no plan known yet
    assert_batches_equal(cold.batch_at(target), seen[target], f"cold step {target}")
    assert cold.explain(target) == warm.explain(target)
    fresh = _pipe(tmp_path, mode, num_epochs=None)
    assert fresh.explain(target + 10) == warm.explain(target + 10)


# --------------------------------------------------------------------------- 5. finite streams


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_a_finite_best_fit_stream_loses_no_document(tmp_path, drop_remainder):
    per_epoch = _expected_best_fit_rows()
    rows_total = 2 * per_epoch
    assert rows_total % B, "the test needs a partial last batch"
    full = _all_rows(_pipe(tmp_path, "best_fit", num_epochs=2, drop_remainder=False))
    pipe = _pipe(tmp_path, "best_fit", num_epochs=2, drop_remainder=drop_remainder)
    if not drop_remainder:
        assert pipe.num_steps == -(-rows_total // B)
        assert len(pipe.batch_at(pipe.num_steps - 1)["tokens"]) == rows_total % B
        seen = {}
        for row in _decode(full, "best_fit"):
            for d, start, n in row:
                seen.setdefault(d, []).append((start, n))
        for d in range(N):  # every token of every document, once per epoch
            n = int(DOC_LEN[d])
            assert sum(k for _, k in seen.get(d, [])) == 2 * n, f"document {d}"
    else:
        assert pipe.num_steps == rows_total // B
        got = _all_rows(pipe)
        assert_batches_equal(
            got, {k: v[: pipe.num_steps * B] for k, v in full.items()}
        )  # only the partial batch is dropped
        with pytest.raises(IndexError, match="past the end"):
            pipe.batch_at(pipe.num_steps)
    with pytest.raises(ValueError, match="fewer than one batch"):
        _packed(tmp_path, "best_fit", num_epochs=1).batch(per_epoch + 1)


# --------------------------------------------------------------------------- 6. explain


@pytest.mark.parametrize("mode", ["best_fit", "concat"])
def test_explain_lists_every_document_of_each_row(tmp_path, mode):
    pipe = _pipe(tmp_path, mode, num_epochs=2)
    for s in range(pipe.num_steps):
        rows = _decode(pipe.batch_at(s), mode)
        assert pipe.explain(s) == [[("Docs", d) for d, _, _ in row] for row in rows], f"step {s}"


# --------------------------------------------------------------------------- 7. the plan reads nothing


def test_the_plan_reads_nothing(tmp_path):
    CALLS.n = 0
    _packed(tmp_path, "best_fit", num_epochs=None)
    assert CALLS.n == N  # the length index: one scan
    CALLS.n = 0
    pipe = _packed(tmp_path, "best_fit", num_epochs=None)
    assert CALLS.n == 0  # the index from the cache
    pieces = pipe.pieces(np.arange(0, 5 * _expected_best_fit_rows(), 7))  # five epochs planned
    assert len(pieces.ids) and CALLS.n == 0
    batched = pipe.batch(B)
    batched.explain(200)
    assert batched.num_steps is None and CALLS.n == 0
    _packed(tmp_path, "concat", num_epochs=4).batch(B).explain(100)
    assert CALLS.n == 0
    batched.batch_at(200)
    docs = {d for row in batched.explain(200) for _, d in row}
    assert CALLS.n == len(docs)  # a step reads its documents, each once
    CALLS.n = 0
    given = _inner().pack(S, key="tokens", lengths=DOC_LEN)
    assert CALLS.n <= 5  # a given index: a few records checked
    assert given.fingerprint() == pipe.fingerprint()
    assert_batches_equal(given.batch(B).batch_at(200), batched.batch_at(200))


def test_pieces_match_the_rows(tmp_path):
    pipe = _pipe(tmp_path, "best_fit", num_epochs=2)
    positions = np.arange(B * 40, B * 42)  # across the end of the first epoch
    pieces = pipe.pieces(positions)
    rows = [row for batch in pipe.batches_at(40, 2) for row in _decode(batch, "best_fit")]
    want = [(r, d, st, n) for r, row in enumerate(rows) for d, st, n in row]
    got = list(zip(pieces.row.tolist(), pieces.ids.tolist(), pieces.start.tolist(), pieces.length.tolist()))
    assert got == want
    with pytest.raises(TypeError, match="pieces"):
        pipe.segments(positions)
    with pytest.raises(TypeError, match="packed"):
        _inner().pieces(positions)


# --------------------------------------------------------------------------- 8. bad input


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        _inner().pack(0, key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="seq_len"):
        _inner().pack(-3, key="tokens", cache_dir=tmp_path)
    for bad in [16.0, "16", True, None]:
        with pytest.raises(TypeError, match="seq_len must be an integer"):
            _inner().pack(bad, key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"mode must be one of \('best_fit', 'concat', 'first_fit'\), got 'greedy'"):
        _inner().pack(S, mode="greedy", key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="mode must be one of"):
        plan_epoch(DOC_LEN, S, "greedy", 0, 0)


def test_bad_records_are_scan_errors_naming_them(tmp_path):
    bad = quern.Pipeline.from_source(BadDocs(), seed=3).shuffle()
    with pytest.raises(quern.ScanError, match=r"record 37 of source 'BadDocs'.*1-D"):
        bad.pack(S, key="tokens", cache_dir=tmp_path)
    with pytest.raises(quern.ScanError, match=r"record 0 .*key 'grid'.*1-D"):
        _inner().pack(S, key="grid", cache_dir=tmp_path)
    with pytest.raises(quern.ScanError, match=r"record 0 of source 'Docs': no key 'ids' in the record"):
        _inner().pack(S, key="ids", cache_dir=tmp_path)
    with pytest.raises(quern.ScanError, match=r"record 0 of source 'Docs': the record is a dict .*pass key="):
        _inner().pack(S, cache_dir=tmp_path)
    empty = quern.Pipeline.from_source(NoTokens(), seed=3)
    with pytest.raises(ValueError, match="hold no token"):
        empty.pack(S, key="tokens", cache_dir=tmp_path)


def test_a_given_length_index_is_checked(tmp_path):
    wrong = DOC_LEN.copy()
    wrong[N - 1] += 1  # the last record is always checked
    with pytest.raises(ValueError, match=rf"record {N - 1} has {DOC_LEN[N - 1]} tokens, the index says"):
        _inner().pack(S, key="tokens", lengths=wrong)
    with pytest.raises(ValueError, match="one integer per record"):
        _inner().pack(S, key="tokens", lengths=DOC_LEN[:-1])
    # a wrong length the sample misses: the step that packs that record names it
    wrong = DOC_LEN.copy()
    rid = 101
    wrong[rid] += 3
    pipe = _inner(num_epochs=1).pack(S, key="tokens", lengths=wrong).batch(B, drop_remainder=False)
    step = next(s for s in range(pipe.num_steps) if any(d == rid for row in pipe.explain(s) for _, d in row))
    with pytest.raises(quern.StepError, match=rf"record {rid} of source 'Docs'.*length index says"):
        pipe.batch_at(step)


def test_pack_is_refused_where_it_cannot_apply(tmp_path):
    packed = _packed(tmp_path, num_epochs=None)
    with pytest.raises(ValueError, match=r"pack\(\) after batch\(\)"):
        _inner().batch(B).pack(S, key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"pack\(\) on a mixture"):
        quern.mix({"a": _inner(), "b": _inner(4)}, weights=[1, 1]).pack(S, key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="packed already"):
        packed.pack(S, key="tokens", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"shuffle\(\) after pack\(\)"):
        packed.shuffle()
    with pytest.raises(ValueError, match=r"filter\(\) after pack\(\)"):
        packed.filter(lambda row: True, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"length_index\(\) after pack\(\)"):
        packed.length_index("tokens")
    with pytest.raises(ValueError, match=r"balance_hosts\(\).*packed"):
        packed.balance_hosts(np.ones(N, dtype=np.int64))
    with pytest.raises(ValueError, match=r"bucket\(\).*packed"):
        packed.bucket([8, 64], [4, 2], key="tokens")


def test_transforms_after_pack_see_rows(tmp_path):
    plain = _pipe(tmp_path, "best_fit", num_epochs=2)
    mapped = _packed(tmp_path, "best_fit", num_epochs=2).map(add_one).batch(B, drop_remainder=False)
    for s in [0, 40]:
        want = plain.batch_at(s)
        assert_batches_equal(mapped.batch_at(s), {**want, "tokens": want["tokens"] + 1}, f"step {s}")


# --------------------------------------------------------------------------- 10. fingerprint


def test_the_fingerprint_follows_the_packing(tmp_path):
    base = _packed(tmp_path, num_epochs=2).fingerprint()
    assert _packed(tmp_path, num_epochs=2).fingerprint() == base  # the same definition built again
    others = [
        _packed(tmp_path, num_epochs=2, seq_len=S + 1),
        _packed(tmp_path, "concat", num_epochs=2),
        _inner(3, 2).pack(S, key="mask", cache_dir=tmp_path),
        _packed(tmp_path, num_epochs=2, seed=4),
        _packed(tmp_path, num_epochs=3),
        _packed(tmp_path, num_epochs=2, shuffle=False),
    ]
    prints = [p.fingerprint() for p in others]
    assert base not in prints and len(set(prints)) == len(prints)
    assert _inner(3, 2).fingerprint() != base
