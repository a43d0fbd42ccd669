"""Tests of pipeline/ledger.py and the iterator's ``ledger=`` option (issue 24, point 2).

A ledger written while iterating, with threads or worker processes, holds for every step
yielded the digests of ``batch_at`` of that host slice; ``{process_index}`` names one file per
host; a writer SIGKILLed mid-write leaves at most a torn last line, which reading ignores and
reports and a resumed writer drops; gaps, differing duplicates, torn lines in the middle and
another pipeline's lines are reported or refused, never skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import quern
import quern.verify
from quern.pipeline.integrity.batch_digest import digests_of
from quern.pipeline.integrity.digesting import made_of
from quern.pipeline.integrity.ledger import LedgerWriter
from quern.pipeline.integrity.ledger_read import read_ledger
from quern.pipeline.iterate import threads

pytestmark = pytest.mark.timeout(180)


def _pipe(seed=0):
    src = {"tokens": np.arange(3000, dtype=np.int32).reshape(300, 10), "w": np.linspace(0, 1, 300)}
    return quern.Pipeline.from_source(src, seed=seed).shuffle().map(lambda r: {**r, "w": r["w"] * 2}).batch(8)


def _lines(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_ledger_holds_the_digests_of_batch_at_for_every_step_and_host(tmp_path, workers):
    pipe = _pipe()
    path = tmp_path / "run" / "ledger-{process_index}.jsonl"  # the folder is made
    stages = []
    for h in range(2):
        with pipe.iterator(5, process_index=h, process_count=2, num_workers=workers, ledger=path) as it:
            batches = [next(it) for _ in range(12)]
            stages.append(it.stats()["stages"])
        assert all(
            quern.pipeline.integrity.batch_digest.row_digests_of(b) == pipe.row_digests(s, h, 2)
            for s, b in enumerate(batches, 5)
        )
    assert sorted(os.listdir(tmp_path / "run")) == ["ledger-0.jsonl", "ledger-1.jsonl"]
    for h in range(2):
        lines = _lines(tmp_path / "run" / f"ledger-{h}.jsonl")
        assert [x["step"] for x in lines] == list(range(5, 17))
        assert lines[0]["description"] == pipe.leaves_at(5)  # the first line under a fingerprint says what it is
        assert all("description" not in x for x in lines[1:])
        for x in lines:
            assert [k for k in x if k != "description"] == [
                "step",
                "fingerprint",
                "process_index",
                "process_count",
                "digest_format",
                "rows",
                "row_digests",
                "leaf_digests",
            ]
            s = x["step"]
            d = digests_of(pipe.batch_at(s, h, 2))
            assert x["fingerprint"] == pipe.fingerprint_at(s) == pipe.fingerprint()
            assert (x["process_index"], x["process_count"], x["rows"]) == (h, 2, [4 * h, 4 * h + 4])
            assert x["digest_format"] == 2
            assert x["row_digests"] == d.rows == pipe.row_digests(s, h, 2)
            assert x["leaf_digests"] == d.leaves
    ledger = read_ledger(str(tmp_path / "run" / "ledger-{process_index}.jsonl"))
    assert (ledger.issues, ledger.notes, ledger.steps()) == ([], [], list(range(5, 17)))
    for s in ledger.steps():
        assert [r for e in ledger.slices(s)[2] for r in e.row_digests()] == pipe.row_digests(s)
    if workers:  # computed in the worker processes, whose stage times the pool reports
        assert all(st.get("digest", 0) > 0 for st in stages), stages


def test_without_a_ledger_nothing_is_written_or_computed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with _pipe().iterator(num_workers=0) as it:
        next(it)
        assert "digest" not in it.stats()["stages"]
    assert os.listdir(tmp_path) == []


def test_lines_are_written_at_state_close_the_end_and_an_error(tmp_path):
    path = tmp_path / "l.jsonl"
    it = _pipe().iterator(ledger=path)
    for _ in range(3):
        next(it)
    assert path.read_text() == ""  # kept in memory: a few steps are written at once
    state = it.state()
    assert [x["step"] for x in _lines(path)] == [0, 1, 2] and state["step"] == 3
    next(it)
    it.close()
    assert [x["step"] for x in _lines(path)] == [0, 1, 2, 3]
    finite = quern.Pipeline.from_source({"x": np.arange(20)}, seed=0, num_epochs=1).batch(4)
    with finite.iterator(ledger=tmp_path / "end.jsonl") as it:
        assert len(list(it)) == 5
        assert [x["step"] for x in _lines(tmp_path / "end.jsonl")] == [0, 1, 2, 3, 4]  # at the end, before close

    def fail_at_2(batch):
        if batch["x"][0] == 8:
            raise RuntimeError("boom")
        return batch

    with finite.map_batch(fail_at_2).iterator(ledger=tmp_path / "err.jsonl") as it:
        next(it), next(it)
        with pytest.raises(quern.StepError, match="boom"):
            next(it)
        assert [x["step"] for x in _lines(tmp_path / "err.jsonl")] == [0, 1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_written_to_after_it_is_yielded_keeps_its_ledger_line(tmp_path, workers):
    # the line of a step is made later than the step is yielded (every 16 steps): what it needs
    # of the batch must be kept when it is yielded, the small leaves too (here "w", 8 bytes a row)
    pipe, path = _pipe(), tmp_path / "l.jsonl"
    with pipe.iterator(num_workers=workers, ledger=path) as it:
        for _ in range(6):
            batch = next(it)
            batch["tokens"][:] = -1  # a user's in-place edit of the batch it got
            batch["w"][:] = -1.0
    lines = _lines(path)
    assert [x["step"] for x in lines] == list(range(6))
    for x in lines:
        d = digests_of(pipe.batch_at(x["step"]))
        assert x["row_digests"] == d.rows and x["leaf_digests"] == d.leaves, x["step"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_leaf_without_a_row_axis_fails_the_step_with_a_ledger_only(tmp_path, workers):
    pipe = _pipe().map_batch(lambda b: {**b, "scale": np.float32(2)})
    with pipe.iterator(num_workers=workers) as it:
        next(it)
    with pipe.iterator(num_workers=workers, ledger=tmp_path / "l.jsonl") as it:
        with pytest.raises(quern.StepError, match=r"step 0 \(host 0 of 1\), stage 'digest'.*leaf batch\['scale'\]"):
            next(it)


def test_with_0_workers_the_prefetch_threads_digest_full_chunks_and_a_bad_batch_fails_at_its_step(
    tmp_path, monkeypatch
):
    seen = []
    real = threads.made_of

    def made_of(batches):  # the real one, noting where it runs
        seen.append((threading.current_thread().name, len(batches)))
        return real(batches)

    monkeypatch.setattr(threads, "made_of", made_of)
    given = {}  # step -> how its line got its digests

    def noting(name):
        real = getattr(LedgerWriter, name)

        def call(self, step, value):
            given[step] = name
            return real(self, step, value)

        return call

    for name in ("add_made", "add_batch"):
        monkeypatch.setattr(LedgerWriter, name, noting(name))
    plain = quern.Pipeline.from_source({"x": np.arange(400, dtype=np.int64)}, seed=0).batch(4)
    pipe = plain.map_batch(lambda b: {**b, "s": np.int64(1)} if b["x"][0] == 80 else b)  # step 20: no row axis
    with pipe.iterator(num_workers=0, ledger=tmp_path / "l.jsonl") as it:
        assert it._feed.read_ahead == 16  # chunks of 1, 2, 4 and 8 steps (hashed as yielded), then of 16
        assert [int(next(it)["x"][0]) for _ in range(20)] == list(range(0, 80, 4))
        with pytest.raises(quern.StepError, match=r"step 20 \(host 0 of 1\), stage 'digest'.*leaf batch\['s'\]"):
            next(it)
        assert it.stats()["stages"]["digest"] > 0
    lines = _lines(tmp_path / "l.jsonl")
    assert [x["step"] for x in lines] == list(range(20))
    assert all(x["row_digests"] == plain.row_digests(x["step"]) for x in lines)
    assert all(x["leaf_digests"] == digests_of(plain.batch_at(x["step"])).leaves for x in lines)
    assert seen and all(name.startswith("quern-prefetch") for name, _ in seen), seen
    assert all(n == 16 for _, n in seen), seen  # the full chunks' batches digested together, the first ones not
    assert given == {s: "add_made" if 15 <= s < 20 else "add_batch" for s in range(21)}  # step 20 raised there


def test_lines_of_batches_digested_where_made_or_as_yielded_are_the_same(tmp_path):
    pipe = _pipe()
    batches = [pipe.batch_at(s) for s in range(40)]
    made = made_of(batches)
    one = LedgerWriter(tmp_path / "one.jsonl", pipe, 0, 1, 0)
    mixed = LedgerWriter(tmp_path / "mixed.jsonl", pipe, 0, 1, 0)
    for s, (batch, m) in enumerate(zip(batches, made)):
        one.add_batch(s, batch)
        if s % 7 in (2, 3, 4):  # runs of both kinds, across the writes every 16 lines
            mixed.add_batch(s, batch)
        else:
            mixed.add_made(s, m)
    one.close()
    mixed.close()
    assert (tmp_path / "mixed.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert [x["step"] for x in _lines(tmp_path / "one.jsonl")] == list(range(40))


def test_a_resumed_run_appending_to_its_ledger_gives_a_valid_ledger(tmp_path):
    pipe, path = _pipe(), tmp_path / "l.jsonl"
    with pipe.iterator(ledger=path) as it:
        for _ in range(5):
            next(it)
        state = it.state()
        for _ in range(3):  # steps 5..7, then a "crash" (their checkpoint never saved)
            next(it)
    with pipe.resume(state, num_workers=2, ledger=path) as it:
        for _ in range(6):  # steps 5..10: 5..7 logged again, identically
            next(it)
    ledger = read_ledger(path)
    assert ledger.issues == [] and ledger.steps() == list(range(11))
    assert ledger.notes == ["3 line(s) log a step and host slice again identically (a resumed run): fine"]
    assert quern.verify.check_ledger(pipe, path).ok


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, quern
    pipe = quern.Pipeline.from_source({"x": np.arange(1 << 20, dtype=np.int8)}, seed=1).batch(1 << 14)
    with pipe.iterator(ledger=sys.argv[1]) as it:
        while True:
            next(it)
    """
)


def test_a_writer_sigkilled_mid_write_leaves_a_torn_last_line_that_is_ignored_and_dropped_on_resume(tmp_path):
    path = tmp_path / "l.jsonl"
    for _attempt in range(8):  # SIGKILL while a write is half done: the file does not end with a newline
        path.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    with open(path, "rb") as f:
                        f.seek(0, os.SEEK_END)
                        if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                            proc.send_signal(signal.SIGKILL)
                            break
                except (FileNotFoundError, OSError):
                    pass
        finally:
            proc.kill()
            proc.wait(30)
        if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            break
    data = path.read_bytes()
    assert not data.endswith(b"\n"), "no SIGKILL landed mid-write in 8 attempts"
    ledger = read_ledger(path)
    complete = data.count(b"\n")
    assert ledger.issues == [] and ledger.steps() == list(range(complete))
    assert len(ledger.notes) == 1 and f"l.jsonl:{complete + 1}: the last line" in ledger.notes[0]
    pipe = quern.Pipeline.from_source({"x": np.arange(1 << 20, dtype=np.int8)}, seed=1).batch(1 << 14)
    with pipe.iterator(complete - 1, ledger=path) as it:  # a resume: one step logged again, then new ones
        for _ in range(3):
            next(it)
    again = read_ledger(path)
    assert again.issues == [] and again.steps() == list(range(complete + 2))
    assert not any("torn" in n for n in again.notes)  # the torn tail was dropped before appending
    assert path.read_bytes().startswith(data[: data.rindex(b"\n") + 1])


def _two_host_ledger(tmp_path, steps=10):
    pipe = _pipe()
    for h in range(2):
        with pipe.iterator(process_index=h, process_count=2, ledger=tmp_path / "l-{process_index}.jsonl") as it:
            for _ in range(steps):
                next(it)
    return pipe, [tmp_path / "l-0.jsonl", tmp_path / "l-1.jsonl"]


def _rewrite(path, keep):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if keep(json.loads(line))))


def test_gaps_in_steps_and_host_slices_are_reported_never_skipped(tmp_path):
    pipe, (a, b) = _two_host_ledger(tmp_path)
    _rewrite(b, lambda x: x["step"] != 4)  # host 1's slice of step 4
    _rewrite(a, lambda x: x["step"] not in (6, 7))
    _rewrite(b, lambda x: x["step"] not in (6, 7))
    ledger = read_ledger(str(tmp_path / "l-*.jsonl"))
    assert [(i.kind, i.step, i.text) for i in ledger.issues] == [
        ("gap", 4, "step 4: host slice(s) 1 of 2 missing from the ledger"),
        ("gap", 6, "steps 6..7 are missing from the ledger"),
    ]
    result = quern.verify.check_ledger(pipe, [a, b])
    assert not result.ok and result.first is not None
    assert (result.first.kind, result.first.step) == ("gap", 4)


def test_a_step_logged_twice_differently_is_a_difference_and_identically_a_note(tmp_path):
    pipe, (a, b) = _two_host_ledger(tmp_path, steps=4)
    lines = a.read_text().splitlines(keepends=True)
    x = json.loads(lines[2])
    x["row_digests"][1] = "0" * 32
    with open(a, "a") as f:
        f.write(lines[1] + json.dumps(x) + "\n")
    ledger = read_ledger([a, b])
    assert [(i.kind, i.step) for i in ledger.issues] == [("duplicate", 2)]
    assert f"{a}:3 and {a}:6" in ledger.issues[0].text
    assert ledger.notes == ["1 line(s) log a step and host slice again identically (a resumed run): fine"]
    assert not quern.verify.check_ledger(pipe, [a, b]).ok


def test_torn_or_bad_lines_in_the_middle_are_reported(tmp_path):
    pipe, (a, b) = _two_host_ledger(tmp_path, steps=4)
    lines = a.read_text().splitlines(keepends=True)
    a.write_text(lines[0] + lines[1][:40] + "\n" + '{"step": 9}\n' + "".join(lines[2:]))
    ledger = read_ledger([a, b])
    assert [(i.kind, i.text.split(": ", 1)[0]) for i in ledger.issues] == [
        ("torn", f"{a}:2"),
        ("bad line", f"{a}:3"),
        ("gap", "step 1"),
    ]
    assert "no fingerprint, process_index" in ledger.issues[1].text


def test_another_pipelines_ledger_is_refused_naming_both_fingerprints_file_and_line(tmp_path):
    pipe, paths = _two_host_ledger(tmp_path, steps=3)
    other = _pipe(seed=1)
    with pytest.raises(ValueError) as e:
        quern.verify.check_ledger(other, paths)
    text = str(e.value)
    assert f"{paths[0]}:1: step 0 was logged by another pipeline" in text
    assert pipe.fingerprint() in text and other.fingerprint() in text
    with pytest.raises(ValueError, match="no such file"):
        read_ledger(tmp_path / "missing.jsonl")
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="no ledger line"):
        read_ledger(tmp_path / "notes.txt")


def test_a_ledger_checks_the_steps_before_a_later_edit(tmp_path):
    pipe, paths = _two_host_ledger(tmp_path, steps=8)
    edited = pipe.skip_steps(5, 7)
    assert quern.verify.check_ledger(edited, paths, steps=range(5)).ok  # the steps before the edit: unchanged
    whole = quern.verify.check_ledger(edited, paths)  # the steps the edit changes: left out, with a note
    assert whole.ok and "5 step(s) (0..4)" in whole.summary_lines[0]
    assert any("were logged before this pipeline's edits" in n and "skip_steps(5, 7)" in n for n in whole.notes)
    other = quern.Pipeline.from_source({"x": np.arange(50)}, seed=99).batch(pipe.batch_size)
    with pytest.raises(ValueError, match="step 0 was logged by another pipeline"):
        quern.verify.check_ledger(other, paths)


def test_a_resume_on_an_edited_pipeline_is_checked_by_its_later_lines(tmp_path):
    pipe = quern.Pipeline.from_source({"x": np.arange(200)}, seed=3).shuffle().batch(4)
    path = tmp_path / "run.jsonl"
    with pipe.iterator(ledger=path) as it:
        for _ in range(20):
            next(it)
    edited = pipe.skip_steps(12, 15)
    with edited.resume(pipe.state_at(10), ledger=path) as it:  # the run goes on from its checkpoint at 10
        for _ in range(12):
            next(it)
    result = quern.verify.check_ledger(edited, path)
    assert result.ok, result.lines()
    assert "22 step(s) (0..21)" in result.summary_lines[0]
    assert any("under another definition" in n for n in result.notes)
    lines = path.read_text().splitlines()
    doc = json.loads(lines[-8])  # a line of the resumed run, after the edit: step 14
    assert doc["step"] == 14
    doc["row_digests"][1] = "0" * 32
    lines[-8] = json.dumps(doc)
    path.write_text("\n".join(lines) + "\n")
    bad = quern.verify.check_ledger(edited, path)
    assert not bad.ok and bad.first.step == 14 and bad.first.row == 1


def test_steps_asked_for_but_not_logged_and_foreign_ledgers_fail(tmp_path):
    pipe = quern.Pipeline.from_source({"x": np.arange(200)}, seed=3).shuffle().batch(4)
    path = tmp_path / "run.jsonl"
    with pipe.iterator(ledger=path) as it:
        for _ in range(10):
            next(it)
    missing = quern.verify.check_ledger(pipe, path, steps=range(5, 15))
    assert not missing.ok and missing.first.step == 10 and "missing" in missing.first.text
    other = quern.Pipeline.from_source({"x": np.arange(200)}, seed=4).shuffle().batch(4)
    with pytest.raises(ValueError, match=r"run\.jsonl:1: step 0 was logged by another pipeline.*before its edits"):
        quern.verify.check_ledger(other.skip_steps(0, 1), path)  # every step is after the edit: refused all the same
    before = quern.verify.check_ledger(pipe.skip_steps(0, 1), path)  # this pipeline's run before the edit
    assert not before.ok and before.steps == 0 and "no logged step could be checked" in " ".join(before.lines())
    assert before.summary_lines == [f"ledger {path}: no step checked of the 10 step(s) (0..9) logged by 1 host(s)"]


def _edit_line(path, k, **fields):
    """Line ``k`` (from 1) of a ledger file with ``fields`` set."""
    lines = path.read_text().splitlines(keepends=True)
    doc = json.loads(lines[k - 1])
    doc.update(fields)
    lines[k - 1] = json.dumps(doc) + "\n"
    path.write_text("".join(lines))


def test_a_line_at_a_step_or_host_count_the_pipeline_cannot_have_is_a_bad_line(tmp_path):
    """Issue 36, point 7: named by file and line, the other lines still checked (before: a refusal naming no line)."""
    pipe = quern.Pipeline.from_source({"x": np.arange(40)}, seed=3, num_epochs=1).shuffle().batch(4)
    path = tmp_path / "run.jsonl"
    with pipe.iterator(ledger=path) as it:
        for _ in range(6):
            next(it)
    _edit_line(path, 3, step=10)  # past the end (10 steps)
    _edit_line(path, 5, process_count=3)  # 3 hosts cannot split a batch of 4
    result = quern.verify.check_ledger(pipe, path)
    assert not result.ok
    assert [(d.kind, d.text.split(" (", 1)[0]) for d in result.differences[:2]] == [
        ("bad line", f"{path}:3: step 10 is not a step of this pipeline"),
        ("bad line", f"{path}:5: step 4, host 0 of 3: not a host slice here"),
    ]
    assert "past the end of the stream: 10 steps" in result.differences[0].text
    assert "not divisible by the host count" in result.differences[1].text
    assert [(d.kind, d.step) for d in result.differences[2:]] == [("gap", 2)]  # steps 2 and 4 lack a line
    assert "steps 2, 4 are missing" in result.differences[2].text
    assert result.summary_lines[0].startswith(f"ledger {path}: 4 step(s) (0..1, 3, 5) logged by 1 host(s)")


def test_missing_host_slices_of_a_huge_host_count_are_counted_not_listed(tmp_path):
    pipe = _pipe()
    path = tmp_path / "run.jsonl"
    with pipe.iterator(ledger=path) as it:
        for _ in range(3):
            next(it)
    _edit_line(path, 2, process_count=10**6, process_index=3)
    ledger = read_ledger(path)
    assert [(i.kind, i.step, i.text) for i in ledger.issues] == [
        (
            "gap",
            1,
            "step 1: host slice(s) 0, 1, 2, 4, 5, 6, 7, 8, ... (999999 in all) of 1000000 missing from the ledger",
        )
    ]


def test_a_ledger_of_an_earlier_version_is_told_from_another_pipelines(tmp_path):
    """Issue 36, point 9: a line is left out only when it is this pipeline's before (some of) its edits."""
    pipe = quern.Pipeline.from_source({"x": np.arange(200)}, seed=3).shuffle().batch(4)
    first = pipe.skip_steps(4, 6)  # the run after the first edit
    path = tmp_path / "run.jsonl"
    with first.iterator(ledger=path) as it:
        for _ in range(10):
            next(it)
    both = first.exclude([7, 8], from_step=7)  # a second edit, from step 7
    result = quern.verify.check_ledger(both, path)
    assert result.ok, result.lines()
    assert "7 step(s) (0..6)" in result.summary_lines[0]
    assert any(n.startswith("3 step(s) (7..9) were logged before this pipeline's edits") for n in result.notes)
    other = quern.Pipeline.from_source({"x": np.arange(200)}, seed=4).shuffle().batch(4)
    other_edited = other.skip_steps(4, 6).exclude([7, 8], from_step=7)
    with pytest.raises(ValueError, match=r"run\.jsonl:1: step 0 was logged by another pipeline"):
        quern.verify.check_ledger(other_edited, path)
    foreign = tmp_path / "foreign.jsonl"
    with other.iterator(7, ledger=foreign) as it:  # another pipeline's steps 7..9, after both edits start
        for _ in range(3):
            next(it)
    spliced = tmp_path / "spliced.jsonl"
    spliced.write_text("".join(path.read_text().splitlines(keepends=True)[:7]) + foreign.read_text())
    with pytest.raises(ValueError, match=r"spliced\.jsonl:8: step 7 was logged by another pipeline.*before its edits"):
        quern.verify.check_ledger(both, spliced)
    foreign.unlink()
    with other.iterator(20, ledger=foreign) as it:
        next(it)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(path.read_text() + foreign.read_text())  # a foreign line at step 20, outside the steps asked for
    with pytest.raises(ValueError, match=r"mixed\.jsonl:11: step 20 was logged by another pipeline"):
        quern.verify.check_ledger(both, mixed, steps=range(5))


def test_a_ledger_of_another_digest_format_is_refused_not_reported_as_differing(tmp_path):
    """Digest format 2 describes a dtype by name (issue 36): a ledger of format 1 cannot be compared."""
    pipe, (a, b) = _two_host_ledger(tmp_path, steps=3)
    assert quern.verify.check_ledger(pipe, [a, b]).ok
    lines = [json.loads(line) for line in b.read_text().splitlines()]
    for fmt, why in (
        (None, "digest format 1 .it has no digest_format: an older quern"),
        (3, "digest format 3 .a newer quern"),
    ):
        for x in lines[1:]:
            x.pop("digest_format")
            if fmt is not None:
                x["digest_format"] = fmt
        b.write_text("".join(json.dumps(x) + "\n" for x in lines))
        want = rf"^{b}:2: the line's digests are of {why}.*this quern computes digest format 2.*record the run again"
        for check in (
            lambda: read_ledger([a, b]),
            lambda: quern.verify.check_ledger(pipe, [a, b]),
            lambda: quern.verify.compare_ledgers(a, b),
        ):
            with pytest.raises(ValueError, match=want):
                check()
        for x in lines[1:]:
            x["digest_format"] = 2


def _fields_writer(tmp_path):
    pipe = quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(400, dtype=np.int64)), seed=0).batch(8)
    return pipe, quern.pipeline.integrity.ledger.LedgerWriter(tmp_path / "l.jsonl", pipe, 0, 1, 0)


def test_lines_made_from_the_reused_digest_buffer_survive_later_batches(tmp_path):
    # Lines of hashed batches are kept as views of one buffer until written; a worker's line
    # (add) between two runs of batches makes them, and the next run writes that buffer again.
    pipe, w = _fields_writer(tmp_path)
    step_fields = quern.pipeline.integrity.ledger.step_fields
    for s in range(3):
        w.add_batch(s, pipe.batch_at(s))
    w.add(3, step_fields(pipe, pipe.batch_at(3), 3, 0, 1))  # makes lines 0-2, not yet written
    for s in range(4, 7):
        w.add_batch(s, pipe.batch_at(s))  # hashed into the same buffer when made
    w.close()
    lines = _lines(tmp_path / "l.jsonl")
    assert [x["step"] for x in lines] == list(range(7))
    for x in lines:
        want = json.loads("{" + step_fields(pipe, pipe.batch_at(x["step"]), x["step"], 0, 1) + "}")
        assert x["row_digests"] == want["row_digests"] and x["leaf_digests"] == want["leaf_digests"]


WRITE_CUT_SHORT = """
import json, os, resource, signal, sys
import numpy as np
import quern
from quern.pipeline.integrity import ledger
from quern.pipeline.integrity.ledger import LedgerWriter, FLUSH_LINES

ledger.FLUSH_SECONDS = 1e9  # only the 16th line writes, however slow this machine is

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG, not a signal
path, limit = sys.argv[1], int(sys.argv[2])
pipe = quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(4000, dtype=np.int64)), seed=0).batch(64)
w = LedgerWriter(path, pipe, 0, 1, 0)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
errors = []
for s in range(FLUSH_LINES):
    try:
        w.add_batch(s, pipe.batch_at(s))  # the last one writes: cut short at the limit, then EFBIG
    except OSError as e:
        errors.append(e.errno)
size = os.path.getsize(path)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
w.close()  # writes what was not written
print(json.dumps({"errors": errors, "size_at_limit": size}))
"""


def test_a_write_cut_short_keeps_what_was_not_written_and_writes_it_once(tmp_path):
    # RLIMIT_FSIZE makes the kernel write part of the lines and then refuse (EFBIG): the rest is
    # written by the next flush, once, so the file holds every line whole and none twice.
    path = tmp_path / "l.jsonl"
    run = subprocess.run(
        [sys.executable, "-c", WRITE_CUT_SHORT, str(path), "5000"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["errors"] == [27] and out["size_at_limit"] == 5000  # EFBIG after a write of part of a line
    lines = _lines(path)
    pipe = quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(4000, dtype=np.int64)), seed=0).batch(64)
    assert [x["step"] for x in lines] == list(range(16))
    assert all(x["row_digests"] == pipe.row_digests(x["step"], 0, 1) for x in lines)


class _FailsOnce:
    """A pipeline whose fingerprint of one step fails the first time it is asked (a transient error)."""

    def __init__(self, pipe, step):
        self.pipe, self.step, self.failed = pipe, step, False
        self.batch_size, self.num_steps = pipe.batch_size, pipe.num_steps

    def fingerprint_at(self, step):
        if step == self.step and not self.failed:
            self.failed = True
            raise RuntimeError(f"fingerprint of step {step}: transient")
        return self.pipe.fingerprint_at(step)

    def leaves_at(self, step):
        return self.pipe.leaves_at(step)


def test_an_error_making_the_lines_loses_none_and_changes_no_digest(tmp_path):
    # A flush that fails while making its lines (here at step 1's fingerprint) keeps every step
    # it had; the next flush writes them, and later batches, hashed into the same buffer, change
    # no digest of theirs.
    pipe = quern.Pipeline.from_source(quern.sources.ArraySource(np.arange(400, dtype=np.int64)), seed=0).batch(8)
    w = quern.pipeline.integrity.ledger.LedgerWriter(tmp_path / "l.jsonl", _FailsOnce(pipe, 1), 0, 1, 0)
    w.add_batch(0, pipe.batch_at(0))
    w.add_batch(1, pipe.batch_at(1))
    with pytest.raises(RuntimeError, match="fingerprint of step 1"):
        w.flush()
    w.add_batch(2, pipe.batch_at(2))
    w.add_batch(3, pipe.batch_at(3))
    w.close()
    lines = _lines(tmp_path / "l.jsonl")
    assert [x["step"] for x in lines] == [0, 1, 2, 3]  # none lost with the error
    assert all(x["row_digests"] == pipe.row_digests(x["step"], 0, 1) for x in lines)
