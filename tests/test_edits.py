"""Edits that keep the past: ``skip_steps`` and ``exclude`` (issue 24, point 5).

Every check compares the edited pipeline with the unedited one computed by the code
paths that existed before the edits (``batch_at`` of the original pipeline, its
``record_ids``), never with values the edit code computes for itself.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import assert_batches_equal, assert_iterator_gives_batch_at, run_quern

import quern

N = 23


def _plain(shuffle: str | None = "global", num_epochs: int | None = None, seed: int = 5) -> quern.Pipeline:
    base = quern.Pipeline.from_source({"x": np.arange(N, dtype=np.int64)}, seed=seed, num_epochs=num_epochs)
    if shuffle == "global":
        base = base.shuffle()
    elif shuffle == "block":
        base = base.shuffle("block", block_size=4, window=3)
    return base


def _ids(pipe: quern.Pipeline, steps: range) -> list[int]:
    return [int(i) for s in steps for i in pipe.batch_at(s)["x"].tolist()]


def _stream_of(pipe: quern.Pipeline, count: int) -> list[int]:
    """The unedited stream's record ids at positions [0, count), from its own index arithmetic."""
    return pipe.stream.record_ids(np.arange(count, dtype=np.int64)).tolist()


# --------------------------------------------------------------------------- skip_steps


@pytest.mark.parametrize("shuffle", [None, "global", "block"])
def test_skip_steps_gives_the_later_steps_data_and_keeps_the_past(shuffle):
    pipe = _plain(shuffle).batch(4)
    edited = pipe.skip_steps(3, 7)
    for t in range(3):
        assert_batches_equal(edited.batch_at(t), pipe.batch_at(t), f"step {t}")
    for t in range(3, 20):
        assert_batches_equal(edited.batch_at(t), pipe.batch_at(t + 4), f"step {t}")


def test_skips_compose_in_the_steps_of_the_pipeline_they_are_made_on():
    pipe = _plain().batch(2)
    twice = pipe.skip_steps(2, 5).skip_steps(4, 6)  # the second in the first edit's steps
    once = pipe.skip_steps(2, 5)
    for t in range(4):
        assert_batches_equal(twice.batch_at(t), once.batch_at(t))
    for t in range(4, 15):
        assert_batches_equal(twice.batch_at(t), once.batch_at(t + 2))
        assert_batches_equal(twice.batch_at(t), pipe.batch_at(t + 5))


def test_skip_steps_shortens_a_finite_stream():
    pipe = _plain(num_epochs=2).batch(3, drop_remainder=False)  # 46 records: 16 steps, the last partial
    edited = pipe.skip_steps(5, 9)
    assert edited.num_steps == pipe.num_steps - 4
    assert_batches_equal(edited.batch_at(edited.num_steps - 1), pipe.batch_at(pipe.num_steps - 1))
    with pytest.raises(IndexError, match="past the end"):
        edited.batch_at(edited.num_steps)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((3, 3), ValueError, "stop must be greater than start"),
        ((5, 2), ValueError, "stop must be greater than start"),
        ((-1, 2), ValueError, "start must be >= 0"),
        ((1.5, 2), TypeError, "start must be an integer"),
        ((1, 99), ValueError, "past the end of the stream"),
    ],
)
def test_skip_steps_refuses_bad_steps(args, error, match):
    pipe = _plain(num_epochs=1).batch(2)
    with pytest.raises(error, match=match):
        pipe.skip_steps(*args)


def test_edits_need_a_batch():
    with pytest.raises(ValueError, match=r"skip_steps\(\) needs batch\(\) first"):
        _plain().skip_steps(1, 2)
    with pytest.raises(ValueError, match=r"exclude\(\) needs batch\(\) first"):
        _plain().exclude([1], from_step=0)


# --------------------------------------------------------------------------- exclude


@pytest.mark.parametrize("shuffle", [None, "global", "block"])
@pytest.mark.parametrize("num_epochs", [None, 3])
def test_exclude_continues_with_the_remaining_records(shuffle, num_epochs):
    pipe = _plain(shuffle, num_epochs).batch(4, drop_remainder=False)
    gone = {2, 7, 19}
    edited = pipe.exclude(sorted(gone), from_step=3)
    total = N * 3 if num_epochs else N * 8
    stream = _stream_of(pipe, total)
    want = stream[:12] + [i for i in stream[12:] if i not in gone]
    steps = edited.num_steps if num_epochs else (len(want) - 12) // 4
    got = _ids(edited, range(steps))
    assert got == want[: len(got)]
    if num_epochs:
        assert got == want  # nothing lost at the end either
        assert edited.num_steps == -(-len(want) // 4)
    for t in range(3):
        assert_batches_equal(edited.batch_at(t), pipe.batch_at(t))


def test_exclusions_compose_and_stack():
    pipe = _plain().batch(4)
    edited = pipe.exclude([1, 2], from_step=2).exclude([5], from_step=6).exclude([2, 8], from_step=6)
    stream = _stream_of(pipe, N * 10)
    first = stream[:8] + [i for i in stream[8:] if i not in (1, 2)]
    second = first[:24] + [i for i in first[24:] if i not in (1, 2, 5, 8)]
    assert _ids(edited, range(40)) == second[:160]


def test_exclude_on_a_filtered_stream():
    pipe = (
        quern.Pipeline.from_source({"x": np.arange(40)}, seed=2)
        .shuffle()
        .filter(lambda r: int(r["x"]) % 3 != 0, num_workers=0)
        .batch(5)
    )
    edited = pipe.exclude([4, 5, 3], from_step=1)  # 3 is filtered out already: no effect, no error
    stream = _stream_of(pipe, 26 * 4)
    want = stream[:5] + [i for i in stream[5:] if i not in (4, 5)]
    assert _ids(edited, range(15)) == want[:75]


def test_skip_and_exclude_compose():
    pipe = _plain().batch(2)
    edited = pipe.skip_steps(2, 4).exclude([3], from_step=5)
    skipped = pipe.skip_steps(2, 4)
    for t in range(5):
        assert_batches_equal(edited.batch_at(t), skipped.batch_at(t))
    stream = _stream_of(pipe, N * 6)
    # training step 5 runs step 7 of the original: positions from 14 on, without record 3
    want = stream[:14] + [i for i in stream[14:] if i != 3]
    assert _ids(edited, range(5, 30)) == want[14 : 14 + 50]


@pytest.mark.parametrize(
    ("records", "kw", "error", "match"),
    [
        ([N], {}, ValueError, f"record id {N} is out of range: source 'arrays' has {N} records"),
        ([-1], {}, ValueError, "record id -1 is out of range"),
        ([], {}, ValueError, "at least one record id"),
        (["a"], {}, TypeError, "integer record ids"),
        ([[1, 2]], {}, TypeError, "1-D sequence"),
        (list(range(N)), {}, ValueError, "every record"),
        ([1], {"component": "web"}, ValueError, "not a mixture"),
    ],
)
def test_exclude_refuses_bad_ids(records, kw, error, match):
    with pytest.raises(error, match=match):
        _plain().batch(2).exclude(records, from_step=1, **kw)


def test_exclude_refuses_a_step_before_an_earlier_exclusion():
    pipe = _plain().batch(2).exclude([1], from_step=5)
    with pytest.raises(ValueError, match="in step order"):
        pipe.exclude([2], from_step=3)


def test_exclude_refuses_balance_hosts_and_buckets():
    lengths = np.arange(N) % 5 + 1
    balanced = _plain().balance_hosts(lengths).batch(2)
    with pytest.raises(ValueError, match="balance_hosts"):
        balanced.exclude([1], from_step=1)
    src = [{"tokens": np.arange(int(n), dtype=np.int32)} for n in lengths]
    bucketed = quern.Pipeline.from_source(src).bucket([2, 5], [2, 2], key="tokens", lengths=lengths)
    with pytest.raises(ValueError, match="not supported on a BucketedStream"):
        bucketed.exclude([1], from_step=1)
    skipped = bucketed.skip_steps(1, 3)  # skip is a step map: it works on any stream
    assert_batches_equal(skipped.batch_at(1), bucketed.batch_at(3))


# --------------------------------------------------------------------------- hosts, workers, identity


def test_edited_pipelines_split_over_hosts_and_run_on_workers():
    pipe = _plain().batch(4).skip_steps(2, 5).exclude([0, 11], from_step=4)
    for t in (0, 3, 4, 9):
        whole = pipe.batch_at(t)
        halves = [pipe.batch_at(t, h, 2)["x"] for h in range(2)]
        assert np.concatenate(halves).tolist() == whole["x"].tolist()
    assert_iterator_gives_batch_at(pipe, 1, count=12, num_workers=2)


def test_edits_appear_in_describe_explain_and_repr():
    pipe = _plain().batch(2)
    edited = pipe.skip_steps(1, 3).exclude([4, 5], from_step=2)
    assert [e[0] for e in edited.describe()["edits"]] == ["skip_steps", "exclude"]
    assert "edits" not in pipe.describe()
    assert edited.fingerprint() != pipe.fingerprint()
    assert edited.explain(1) == pipe.explain(3)
    assert repr(edited).endswith(".batch(2, drop_remainder=True).skip_steps(1, 3).exclude([4, 5], from_step=2)")


def test_resume_follows_the_schedule_rule():
    pipe = _plain().batch(2)
    edited = pipe.skip_steps(5, 8)
    for k in range(6):  # saved at or before the edit's first step: the same past
        it = edited.resume(pipe.state_at(k))
        assert_batches_equal(next(it), edited.batch_at(k))
        it.close()
    with pytest.raises(ValueError, match=r"skip_steps\(5, 8\) changes step 5 and later"):
        edited.resume(pipe.state_at(6))
    it = edited.resume(pipe.state_at(6), force=True)
    assert_batches_equal(next(it), edited.batch_at(6))
    it.close()
    # a state of the edited pipeline resumes on a later edit of it, and not on an earlier one
    more = edited.exclude([3], from_step=9)
    assert more.check_state(edited.state_at(9)) == 9
    with pytest.raises(ValueError, match=r"exclude\(\[3\], from_step=9\) changes step 9 and later"):
        more.check_state(edited.state_at(10))


def test_resume_rule_with_a_mixture_schedule():
    a = quern.Pipeline.from_source({"x": np.arange(10)}, seed=1).shuffle()
    b = quern.Pipeline.from_source({"x": np.arange(100, 130)}, seed=2).shuffle()
    mixed = quern.mix({"a": a, "b": b}, schedule=[(0, {"a": 1, "b": 1}), (20, {"a": 1, "b": 3})], seed=4).batch(4)
    edited = mixed.skip_steps(10, 12)
    assert edited.check_state(mixed.state_at(10)) == 10
    with pytest.raises(ValueError, match="skip_steps"):
        edited.check_state(mixed.state_at(11))
    for t in (0, 9):
        assert_batches_equal(edited.batch_at(t), mixed.batch_at(t))
    assert_batches_equal(edited.batch_at(18), mixed.batch_at(20))  # the later stage's weights, as before


# --------------------------------------------------------------------------- configs


def _config(tmp_path, **extra):
    spec = {"driver": "array", "array": list(range(N)), "dtype": "int64"}
    cfg = {"source": {"type": "tensorstore", "spec": spec}, "seed": 3, "shuffle": "global", "batch": 4, **extra}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return path


def test_config_sections_build_the_same_edits(tmp_path):
    np.save(tmp_path / "gone.npy", np.asarray([9, 1]))
    (tmp_path / "more.txt").write_text("# takedown 2\n11, 12\n13\n")
    path = _config(
        tmp_path,
        skip=[{"start": 2, "stop": 4}],
        exclude=[
            {"from_step": 5, "file": "gone.npy"},
            {"from_step": 7, "file": "more.txt"},
            {"from_step": 6, "ids": [3]},
        ],
    )
    got = quern.load_config(path)
    base = quern.load_config(_config(tmp_path))
    want = (
        base.skip_steps(2, 4).exclude([1, 9], from_step=5).exclude([3], from_step=6).exclude([11, 12, 13], from_step=7)
    )
    assert got.fingerprint() == want.fingerprint()
    for t in (0, 2, 5, 6, 7, 30):
        assert_batches_equal(got.batch_at(t), want.batch_at(t))
    again = quern.load_config(got.to_config())
    assert again.fingerprint() == got.fingerprint()
    assert again.to_config()["exclude"] == got.to_config()["exclude"]


def test_to_config_refuses_edits_out_of_step_order(tmp_path):
    base = quern.load_config(_config(tmp_path))
    with pytest.raises(ValueError, match="not made in step order"):
        base.skip_steps(10, 12).skip_steps(3, 4).to_config()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"skip": [{"start": 3, "stop": 3}]}, r"skip.0: stop \(3\) must be greater than start \(3\)"),
        ({"skip": [{"start": 3}]}, "skip.0.stop"),
        ({"exclude": [{"from_step": 1}]}, "exactly one of 'ids'"),
        ({"exclude": [{"from_step": 1, "ids": [N]}]}, f"exclude.0: exclude\\(\\): record id {N} is out of range"),
        ({"exclude": [{"from_step": 1, "file": "nope.npy"}]}, "exclude.0: cannot read the ids of"),
        ({"exclude": [{"from_step": 1, "ids": [1], "component": "web"}]}, "exclude.0: .*not a mixture"),
    ],
)
def test_config_edits_errors_name_the_key(tmp_path, extra, match):
    with pytest.raises(quern.ConfigError, match=match):
        quern.load_config(_config(tmp_path, **extra))


def test_text_ids_file_with_a_bad_token_names_the_line(tmp_path):
    (tmp_path / "ids.txt").write_text("1\n2 x3\n")
    with pytest.raises(quern.ConfigError, match=r"ids.txt, line 2: 'x3' is not an integer"):
        quern.load_config(_config(tmp_path, exclude=[{"from_step": 1, "file": "ids.txt"}]))


# --------------------------------------------------------------------------- mixtures and packed streams


def _mixture() -> quern.Pipeline:
    a = quern.Pipeline.from_source({"x": np.arange(10)}, seed=1).shuffle()
    b = quern.Pipeline.from_source({"x": np.arange(100, 130)}, seed=2).shuffle()
    return quern.mix({"a": a, "b": b}, weights={"a": 1, "b": 2}, seed=4).batch(4)


def test_exclude_in_a_mixture_component_keeps_the_assignment():
    mixed = _mixture()
    edited = mixed.exclude([3, 4], from_step=5, component="a")
    for t in range(5):
        assert_batches_equal(edited.batch_at(t), mixed.batch_at(t))
    # the component's own stream from its draws before step 5 on, without 3 and 4
    a = mixed.leaves[0]
    drawn = sum(1 for t in range(5) for row in mixed.explain(t) if row[0][0] == "a")
    stream = _stream_of(a, 200)
    want = iter(stream[:drawn] + [i for i in stream[drawn:] if i not in (3, 4)])
    next_a = [next(want) for _ in range(drawn)]
    assert next_a == stream[:drawn]
    for t in range(5, 40):
        for got, was in zip(edited.explain(t), mixed.explain(t)):
            assert got[0][0] == was[0][0]  # the same component in every row
            if was[0][0] == "b":
                assert got == was  # the other component's rows do not move
            else:
                assert got[0][1] == next(want)


def test_exclude_in_a_mixture_needs_a_component():
    with pytest.raises(ValueError, match=r"needs component=.*\['a', 'b'\]"):
        _mixture().exclude([1], from_step=2)
    with pytest.raises(ValueError, match=r"has no component 'c'.*\['a', 'b'\]"):
        _mixture().exclude([1], from_step=2, component="c")
    with pytest.raises(ValueError, match="record id 10 is out of range: source 'arrays' has 10 records"):
        _mixture().exclude([10], from_step=2, component="a")


def _packed() -> quern.Pipeline:
    lengths = np.arange(30) % 7 + 1
    docs = [{"tokens": np.full(int(n), i, dtype=np.int32)} for i, n in enumerate(lengths)]
    return quern.Pipeline.from_source(docs, seed=3).shuffle().pack(8, key="tokens", lengths=lengths).batch(2)


def test_exclude_in_a_packed_stream_pads_the_pieces_and_moves_no_row():
    packed = _packed()
    edited = packed.exclude([5, 6], from_step=3)
    for t in range(3):
        assert_batches_equal(edited.batch_at(t), packed.batch_at(t))
    padded = 0
    for t in range(3, 40):
        got, was = edited.batch_at(t), packed.batch_at(t)
        for r in range(2):
            real, old = got["tokens"][r][got["segment_ids"][r] > 0], was["tokens"][r][was["segment_ids"][r] > 0]
            assert not np.isin(real, [5, 6]).any()
            assert real.tolist() == [i for i in old.tolist() if i not in (5, 6)]  # the others, in their order
            padded += int((got["segment_ids"][r] == 0).sum() - (was["segment_ids"][r] == 0).sum())
        assert [[x for x in row if x[1] not in (5, 6)] for row in was_explain(packed, t)] == edited.explain(t)
    assert padded > 0


def was_explain(pipe: quern.Pipeline, t: int) -> list:
    return pipe.explain(t)


@pytest.mark.parametrize("make", [_plain, _mixture, _packed], ids=["plain", "mixture", "packed"])
def test_where_of_an_edited_pipeline_agrees_with_explain(make):
    pipe = make() if make is not _plain else _plain().batch(4)
    component = "a" if make is _mixture else None
    edited = pipe.skip_steps(2, 4).exclude([1, 3], from_step=5, component=component)
    n = len(edited.leaves[0].source) if component else len(edited.sources[0])
    name = "a" if component else edited.leaf_names[0]
    steps = 40
    for record in range(n):
        scan = [(t, r) for t in range(steps) for r, row in enumerate(edited.explain(t)) if (name, record) in row]
        got = [x for x in edited.where(record, component=component, epochs=10) if x[0] < steps]
        assert got == sorted(set(scan)), record
        if record in (1, 3):
            assert all(t < 5 for t, _ in got)


def test_quern_explain_names_the_edits_that_change_a_step(tmp_path):
    path = _config(tmp_path, skip=[{"start": 2, "stop": 4}], exclude=[{"from_step": 5, "ids": [3]}])
    before = run_quern("explain", path, "--step", 1)
    assert before.returncode == 0, before.stderr
    assert "edits" not in before.stdout
    after = run_quern("explain", path, "--step", 6, "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["edits"] == [
        "skip_steps(2, 4) changes step 2 and later",
        "exclude([3], from_step=5) changes step 5 and later",
    ]
    shown = run_quern("explain", path, "--step", 3)
    assert "edits that change this step: skip_steps(2, 4) changes step 2 and later" in shown.stdout
    assert "exclude" not in shown.stdout


def test_verify_proves_the_steps_before_the_edits_unchanged(tmp_path):
    pipe = _plain().batch(4)
    ledger = tmp_path / "run.jsonl"
    with pipe.iterator(ledger=str(ledger)) as it:
        for _ in range(12):
            next(it)
    edited = pipe.skip_steps(8, 10).exclude([4], from_step=9)
    result = quern.verify.check_ledger(edited, str(ledger))
    assert result.ok, result.lines()
    assert "steps 8..11" in " ".join(result.notes) or "8..11" in " ".join(result.notes)
    assert "skip_steps(8, 10) changes step 8 and later" in " ".join(result.notes)
    assert "8 step(s) (0..7)" in result.summary_lines[0]
    # the same from the command line, on the edited config
    run = _config(tmp_path)
    log = tmp_path / "cli.jsonl"
    assert run_quern("run", run, "--steps", 12, "--ledger", log).returncode == 0
    edited_config = _config(tmp_path, skip=[{"start": 8, "stop": 10}])
    checked = run_quern("verify", edited_config, "--ledger", log)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "8 step(s) (0..7)" in checked.stdout and "skip_steps(8, 10)" in checked.stdout


def test_exclude_every_document_of_a_packed_stream_is_refused():
    with pytest.raises(ValueError, match="every record"):
        _packed().exclude(list(range(30)), from_step=2)


def test_exclude_on_a_one_component_mixture():
    a = quern.Pipeline.from_source({"x": np.arange(10)}, seed=1).shuffle()
    mixed = quern.mix({"a": a}, weights={"a": 1}).batch(2)
    with pytest.raises(ValueError, match=r"needs component=NAME.*\['a'\]"):
        mixed.exclude([1], from_step=1)
    edited = mixed.exclude([1], from_step=1, component="a")
    assert all(("a", 1) not in row for t in range(1, 30) for row in edited.explain(t))


def test_edits_at_the_end_of_a_finite_stream_lose_no_step():
    pipe = _plain(num_epochs=1).batch(2)  # 23 records: 11 steps
    assert pipe.exclude([0], from_step=pipe.num_steps).num_steps == pipe.num_steps
    shrunk = pipe.skip_steps(5, 10).exclude(list(range(8)), from_step=3)  # the skip's target is past the end now
    stream = _stream_of(pipe, N)
    rest = stream[:6] + [i for i in stream[6:] if i >= 8]
    inner_steps = len(rest) // 2
    want = [t for t in range(inner_steps) if t < 5 or t >= 10]
    assert shrunk.num_steps == len(want)


def test_a_state_of_an_edited_pipeline_resumes_without_its_later_edits():
    pipe = _plain().batch(2)
    edited = pipe.skip_steps(20, 30)
    assert pipe.check_state(edited.state_at(10)) == 10
    with pytest.raises(ValueError, match="does not match"):
        pipe.check_state(edited.state_at(25))


def test_the_refusal_names_the_edit_that_changes_the_past():
    pipe = _plain().batch(2)
    edited = pipe.skip_steps(20, 30).skip_steps(5, 6)
    with pytest.raises(ValueError, match=r"skip_steps\(5, 6\), which changes the steps from 5 on") as e:
        edited.check_state(pipe.skip_steps(20, 30).state_at(10))
    assert "skip_steps(20, 30), which" not in str(e.value)


# --------------------------------------------------------------------------- odd ids (issue 36, point 10)


def _huge_npy(path, count: int) -> None:
    """A .npy file whose header claims ``count`` int64 ids, followed by 64 bytes: what ``np.save`` writes, cut."""
    header = {"descr": "<i8", "fortran_order": False, "shape": (count,)}
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(bytes(64))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"ids": [2**64]}, r"exclude\.0: record id 18446744073709551616 is out of range \(record ids fit in int64"),
        ({"ids": [-(2**63) - 1]}, r"exclude\.0: record id -9223372036854775809 is out of range"),
        ({"file": "big.txt"}, r"exclude\.0: .*big\.txt, line 2: record id 99999999999999999999 is out of range"),
        ({"file": "u64.npy"}, r"exclude\.0: .*u64\.npy: record id 18446744073709551615 is out of range"),
        (
            {"file": "huge.npy"},
            r"exclude\.0: .*huge\.npy: its \.npy header claims 962072674304 ids of int64 \(7\.0 TiB\)",
        ),
        ({"file": "obj.npy"}, r"exclude\.0: .*obj\.npy: needs a 1-D array of integer ids, got object"),
    ],
    ids=["ids-2**64", "ids-below-int64", "text-file", "npy-uint64", "npy-header-7TiB", "npy-object"],
)
def test_exclude_ids_that_do_not_fit_are_config_errors_naming_the_file_and_value(tmp_path, entry, match):
    """Ids past int64 and a .npy header claiming 7 TiB were an OverflowError, a MemoryError or "id -1"."""
    (tmp_path / "big.txt").write_text("1 2\n3 99999999999999999999\n")
    np.save(tmp_path / "u64.npy", np.asarray([1, 2**64 - 1], dtype=np.uint64))
    np.save(tmp_path / "obj.npy", np.asarray([1, None], dtype=object))
    _huge_npy(tmp_path / "huge.npy", 7 * 2**40 // 8)
    path = _config(tmp_path, exclude=[{"from_step": 1, **entry}])
    with pytest.raises(quern.ConfigError, match=match):
        quern.load_config(path)
    done = run_quern("explain", path, "--step", 0)
    assert done.returncode == 2, done.stdout + done.stderr  # a usage error, not an unexpected one (1)
    assert re.search(match, done.stderr) and "Traceback" not in done.stderr, done.stderr


def test_uint64_ids_that_fit_are_read(tmp_path):
    np.save(tmp_path / "u64.npy", np.asarray([9, 1], dtype=np.uint64))
    got = quern.load_config(_config(tmp_path, exclude=[{"from_step": 5, "file": "u64.npy"}]))
    want = quern.load_config(_config(tmp_path)).exclude([1, 9], from_step=5)
    assert got.fingerprint() == want.fingerprint()


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda: _plain().batch(2), f"would leave no record of source 'arrays' ({N} records): it excludes"),
        (
            lambda: _plain().filter(lambda r: r["x"] % 2 == 0).batch(2),
            f"would leave no record of source 'arrays' ({N} records, 12 kept by the filter): it excludes",
        ),
    ],
    ids=["source", "filtered"],
)
def test_the_message_of_an_exclusion_of_every_record_reads_as_a_sentence(make, want):
    """It read "would leave no record of source 'arrays' has 23 records"."""
    with pytest.raises(ValueError) as e:
        make().exclude(list(range(N)), from_step=1)
    assert want in str(e.value)


def test_size_texts_read_as_noun_phrases_in_their_messages():
    few = quern.Pipeline.from_source({"x": np.arange(3)}, num_epochs=1)
    with pytest.raises(ValueError, match=r"^source 'arrays' \(3 records\) x 1 epoch\(s\), fewer than one batch of 4"):
        few.batch(4)
    edited = _plain(num_epochs=1).batch(2).exclude([1, 2], from_step=3)
    with pytest.raises(IndexError, match=r"\(source 'arrays' \(23 records\), 2 of them excluded from position 6 on x"):
        edited.batch_at(100)
