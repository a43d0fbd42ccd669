"""What a live stream's commit record means (issue 36, points 1 and 2).

A commit records the first entry not yet trained and what mapped steps to entries (the batch
size, the ``shuffle("steps", steps=W)`` window and its seed). A trainer killed (SIGKILL) and
resumed with another batch size or window either continues exactly at the first untrained entry
(every entry trained once) or is refused with a message naming what changed and the committed
position. ``committed()`` never goes backwards: a late commit of a run on another host count
(or of a run that a later one took over) leaves the record as it is, with a warning.

Every test starts its own redis-server (tests/redisserver.py) on 127.0.0.1.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redisserver import RedisServer, produce

import quern
from quern.pipeline.sources import RedisStreamSource, live_commits
from quern.pipeline.sources.live_commits import StepMap

KEY = "ev"

TRAINER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import quern
    from quern.pipeline.sources import RedisStreamSource

    url, key, out = sys.argv[1], sys.argv[2], sys.argv[3]
    stop, b, w, every, how = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]

    def tonum(rec):
        return {"v": np.int64(int(rec["v"]))}

    src = RedisStreamSource(url, key, timeout=60, retry_seconds=10)
    pipe = quern.Pipeline.from_source(src, seed=5)
    if w:
        pipe = pipe.shuffle("steps", steps=w)
    pipe = pipe.map(tonum).batch(b)
    start = src.committed(pipe) if how == "pipe" else src.committed()
    print("start", start, flush=True)
    with pipe.iterator(start_step=start) as it:
        for step in range(start, stop):
            batch = next(it)
            path = os.path.join(out, f"step{step:03d}")
            with open(path + ".tmp", "wb") as f:
                f.write(batch["v"].tobytes())
            os.replace(path + ".tmp", path)  # this step was trained
            if (step + 1) % every == 0:  # a durable checkpoint that includes the step, then the commit
                with open(os.path.join(out, "checkpoint"), "w") as f:
                    f.write(str(step + 1))
                it.commit(step + 1)
    print("done", flush=True)
    """
)


def trained(folder: Path) -> dict[int, list[int]]:
    """The entries (their ``v``) of each step the trainer in ``folder`` wrote."""
    return {
        int(p.name[4:]): np.frombuffer(p.read_bytes(), dtype=np.int64).tolist()
        for p in folder.iterdir()
        if p.name.startswith("step") and "." not in p.name
    }


def checkpoint(folder: Path) -> int:
    path = folder / "checkpoint"
    return int(path.read_text()) if path.exists() else 0


def wait_until(cond: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def trainer(srv: RedisServer, tmp: Path, name: str, *args: int | str) -> tuple[list[str], Path]:
    """The trainer's command line and its folder (made)."""
    script = tmp / "trainer.py"
    if not script.exists():
        script.write_text(TRAINER)
    folder = tmp / name
    folder.mkdir()
    return [sys.executable, str(script), srv.url, KEY, str(folder), *map(str, args)], folder


def killed_run(srv: RedisServer, tmp: Path, b: int, w: int, every: int, steps: int, ckpt: int) -> dict[int, list[int]]:
    """A trainer (batch size ``b``, window ``w``) SIGKILLed once it wrote ``steps`` steps and committed
    ``ckpt``; the entries of the steps its checkpoint holds (those before ``ckpt``)."""
    cmd, folder = trainer(srv, tmp, "run1", 10_000, b, w, every, "committed")
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: len(trained(folder)) >= steps and checkpoint(folder) == ckpt, 60), (
            f"the first trainer did not reach step {steps} and checkpoint {ckpt}: {proc.poll()}"
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    steps_done = trained(folder)
    assert sorted(steps_done)[:ckpt] == list(range(ckpt))
    return {s: v for s, v in steps_done.items() if s < ckpt}  # what the restored model learned from


def resumed(srv: RedisServer, tmp: Path, stop: int, b: int, w: int, how: str) -> tuple[Any, dict[int, list[int]]]:
    cmd, folder = trainer(srv, tmp, f"run2-{how}", stop, b, w, 5, how)
    done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=120)
    return done, trained(folder)


def every_entry_once(*runs: dict[int, list[int]]) -> list[int]:
    return sorted(v for run in runs for entries in run.values() for v in entries)


# ------------------------------------------------------------------ point 1: a resume with another mapping


def test_a_killed_trainer_resumed_with_a_larger_batch_continues_at_the_first_untrained_entry(srv, tmp_path):
    r = srv.client()
    produce(r, 0, 12 * 4)  # steps 0-11 of batch size 4: the first trainer then waits for step 12
    first = killed_run(srv, tmp_path, b=4, w=0, every=5, steps=12, ckpt=10)  # entries 0-39 trained
    produce(r, 12 * 4, 80)
    src = RedisStreamSource(srv.url, KEY, timeout=5)
    assert src.commit_record().position == 40
    done, second = resumed(srv, tmp_path, 10, b=8, w=0, how="pipe")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["start", "5", "done"]  # step 5 of batch size 8 begins at entry 40
    assert every_entry_once(first, second) == list(range(80))  # none lost, none twice
    record = src.commit_record()
    assert (record.done, record.position, record.steps.batch) == (10, 80, 8)


def test_a_killed_trainer_resumed_with_a_larger_window_continues_at_the_first_untrained_entry(srv, tmp_path):
    r = srv.client()
    produce(r, 0, 12 * 4)  # three whole windows of 4 steps of 4 entries
    first = killed_run(srv, tmp_path, b=4, w=4, every=8, steps=12, ckpt=8)  # windows 0-1: entries 0-31
    produce(r, 12 * 4, 64)
    done, second = resumed(srv, tmp_path, 16, b=4, w=8, how="pipe")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["start", "8", "done"]  # steps 8-15: the window of entries 32-63
    assert every_entry_once(first, second) == list(range(64))


@pytest.mark.parametrize(
    ("b2", "w1", "w2", "every", "ckpt", "names"),
    [
        (6, 0, 0, 5, 10, ["batch size 6 (was 4)", "position 40"]),  # 40 is not a step boundary of 6
        (4, 4, 8, 5, 10, ["window of 8 steps (was 4)", "position 32", "8 of the 16 entries"]),  # mid-window
    ],
    ids=["batch-4-to-6", "window-4-to-8-mid-window"],
)
def test_a_resume_that_cannot_continue_exactly_is_refused_naming_what_changed(
    srv, tmp_path, b2, w1, w2, every, ckpt, names
):
    r = srv.client()
    produce(r, 0, 12 * 4)
    killed_run(srv, tmp_path, b=4, w=w1, every=every, steps=12, ckpt=ckpt)
    produce(r, 12 * 4, 200)
    for how in ("pipe", "committed"):
        done, second = resumed(srv, tmp_path, 30, b=b2, w=w2, how=how)
        assert done.returncode != 0 and not second, done.stdout
        assert "ValueError" in done.stderr and all(n in done.stderr for n in names), done.stderr
    assert RedisStreamSource(srv.url, KEY, timeout=5).committed() == ckpt  # the record is as it was


def test_resuming_at_the_old_step_number_with_another_batch_size_is_refused(srv, tmp_path):
    """The guide's ``start_step=src.committed()`` with batch size 8 after commits of batch size 4:
    step 10 of 8 begins at entry 80, so entries 40-79 would never be trained; refused, naming the
    step that continues (5)."""
    r = srv.client()
    produce(r, 0, 12 * 4)
    first = killed_run(srv, tmp_path, b=4, w=0, every=5, steps=12, ckpt=10)
    produce(r, 12 * 4, 200)
    done, second = resumed(srv, tmp_path, 15, b=8, w=0, how="committed")
    trained_twice_or_lost = every_entry_once(first, second) != list(range(8 * max([*second, 4]) + 8))
    assert done.returncode != 0 and not second, f"trained {sorted(second)}; entries lost: {trained_twice_or_lost}"
    assert "batch size 8 (was 4)" in done.stderr and "position 40" in done.stderr, done.stderr
    assert "start_step=5" in done.stderr or "step 5" in done.stderr, done.stderr


def test_same_mapping_resumes_anywhere_and_a_new_group_starts_fresh(srv):
    """A resume with the batch size and window of the record is free to start where it likes (a
    checkpoint older than the commit, say); another group is another record."""
    produce(srv.client(), 0, 64)
    src = RedisStreamSource(srv.url, KEY, timeout=5)
    pipe = quern.Pipeline.from_source(src).batch(4)
    with pipe.iterator() as it:
        next(it), next(it)
        it.commit(2)
    with pipe.iterator(start_step=1) as it:  # older than the commit: allowed
        next(it)
    with pytest.raises(ValueError, match=r"batch size 8 \(was 4\)"):
        quern.Pipeline.from_source(src).batch(8).iterator(start_step=0)
    other = RedisStreamSource(srv.url, KEY, timeout=5, group="eval")
    with quern.Pipeline.from_source(other).batch(8).iterator() as it:
        next(it)
        it.commit(1)
    assert (other.committed(), src.committed()) == (1, 2)
    assert src.committed(quern.Pipeline.from_source(src).batch(2)) == 4  # entry 8 is step 4 of batch size 2
    with pytest.raises(ValueError, match="batch size 3 \\(was 4\\).*position 8"):
        src.committed(quern.Pipeline.from_source(src).batch(3))


# ------------------------------------------------------------------ point 2: committed() never goes backwards


def hosts(srv: RedisServer, start: int, count: int) -> list[Any]:
    """One iterator per host of a run on ``count`` hosts (each its own source, as separate processes)."""
    out = []
    for h in range(count):
        src = RedisStreamSource(srv.url, KEY, timeout=5)
        pipe = quern.Pipeline.from_source(src).batch(4)
        out.append(pipe.iterator(start, process_index=h, process_count=count))
    return out


def test_a_late_commit_of_an_old_host_count_never_moves_committed_back(srv):
    produce(srv.client(), 0, 200)
    src = RedisStreamSource(srv.url, KEY, timeout=5)
    seen = [src.committed()]

    def commit(it: Any, step: int) -> None:
        while it.step < step:
            next(it)
        it.commit(step)
        seen.append(src.committed())

    old = hosts(srv, 0, 2)  # a run on 2 hosts
    commit(old[0], 10)
    commit(old[1], 10)
    commit(old[1], 11)  # host 1 trained on; host 0 is gone
    assert src.committed() == 10
    new = hosts(srv, 10, 4)  # the run moved to 4 hosts, resumed at the commit
    for it in new:
        commit(it, 20)
    assert src.committed() == 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commit(old[1], 12)  # late: host 1 of the old run commits again
    assert src.committed() == 20, f"committed() went backwards: {seen}"
    assert len(caught) == 1, caught
    assert re.search(r"host 1 of 2.*ignored.*4 hosts.*committed\(\) stays 20", str(caught[0].message)), caught[0]
    never_committed = hosts(srv, 0, 2)[1]  # an old host whose first commit comes late
    with pytest.warns(UserWarning, match="ignored"):
        commit(never_committed, 11)
    assert src.committed() == 20
    commit(new[2], 25)
    for it in (new[0], new[1], new[3]):
        commit(it, 24)
    assert src.committed() == 24
    assert seen == sorted(seen), f"committed() went backwards: {seen}"
    for it in old + new + [never_committed]:
        it.close()


def test_a_run_on_the_old_host_count_again_ignores_the_first_runs_late_commit(srv):
    """2 hosts, then 4, then 2 again: a host of the first 2-host run committing late does not count
    for the third run (its run was taken over), and committed() stays."""
    produce(srv.client(), 0, 200)
    src = RedisStreamSource(srv.url, KEY, timeout=5)

    def upto(it: Any, step: int) -> None:
        while it.step < step:
            next(it)
        it.commit(step)

    first = hosts(srv, 0, 2)
    for it in first:
        upto(it, 5)
    for it in hosts(srv, 5, 4):
        upto(it, 10)
    third = hosts(srv, 10, 2)
    upto(third[0], 12)
    assert src.committed() == 10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        upto(first[1], 30)  # would make committed() 12 if it counted as host 1 of the third run
    assert src.committed() == 10
    assert [w.category for w in caught] == [UserWarning] and "ignored" in str(caught[0].message)
    upto(third[1], 12)
    assert src.committed() == 12


def runs(srv: RedisServer, start: int, count: int, key: str = KEY) -> list[tuple[RedisStreamSource, Any]]:
    """``(source, run)`` per host of a run on ``count`` hosts resumed at ``start`` (batch size 4)."""
    out = []
    for h in range(count):
        src = RedisStreamSource(srv.url, key, timeout=5)
        out.append((src, src.resuming(StepMap(4), start, h, count)))
    return out


def commit_as(host: tuple[RedisStreamSource, Any], step: int, i: int, n: int) -> bool:
    src, run = host
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return src.commit(step, i, n, run=run)


def test_hosts_of_a_new_run_racing_their_first_commit_all_count(srv, monkeypatch):
    """A host whose first commit finds the old run's record, and that reads it again after a peer of
    its own run took it over, joins the peer's run: it never takes the record over a second time
    (which wiped the peer's commit and left committed() stuck at the base for good)."""
    r = srv.client()
    for trial in range(12):
        key = f"ev{trial}"
        produce(r, 0, 60, key)
        for i, host in enumerate(runs(srv, 0, 2, key)):
            commit_as(host, 10, i, 2)
        new = runs(srv, 10, 4, key)
        if trial == 0:  # forced: host 0's first commit lands inside host 1's, before it reads the record
            real = live_commits.read
            fired: list[int] = []

            def read(src: Any, real: Any = real, fired: list[int] = fired, new: Any = new) -> Any:
                if src is new[1][0] and not fired:
                    fired.append(1)
                    assert commit_as(new[0], 12, 0, 4)
                return real(src)

            monkeypatch.setattr(live_commits, "read", read)
            assert commit_as(new[1], 12, 1, 4)
            monkeypatch.undo()
            assert fired
        barrier = threading.Barrier(4)

        def first(i: int, new: Any = new, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            commit_as(new[i], 12, i, 4)

        threads = [threading.Thread(target=first, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(commit_as(new[i], 30, i, 4) for i in range(4)), new[0][0].commit_record()
        assert new[0][0].committed() == 30, f"trial {trial}: {new[0][0].commit_record()}"


def test_a_take_over_decided_on_a_stale_record_is_not_made(srv, monkeypatch):
    """The record's own run commits between a new run's read of the record and its take-over: the
    take-over (made on that version of the record) is not made, and committed() stays 16."""
    produce(srv.client(), 0, 100)
    old = runs(srv, 0, 2)
    for i, host in enumerate(old):
        commit_as(host, 10, i, 2)
    new0 = runs(srv, 10, 4)[0]
    real = live_commits.read
    fired: list[int] = []

    def read(src: Any) -> Any:
        record = real(src)
        if src is new0[0] and not fired:  # between the new host's read and its take-over
            fired.append(1)
            for i, host in enumerate(old):
                assert commit_as(host, 16, i, 2)
        return record

    monkeypatch.setattr(live_commits, "read", read)
    with pytest.warns(UserWarning, match=r"host 0 of 4 ignored.*started at step 10.*stays 16"):
        assert not new0[0].commit(11, 0, 4, run=new0[1])
    monkeypatch.undo()
    assert fired and new0[0].committed() == 16


@pytest.mark.filterwarnings("ignore::UserWarning")  # the old run's commits after a take-over: ignored
def test_a_take_over_races_the_records_own_run_with_threads(srv):
    """The same race unforced: an old run commits on while a new run's first commit may take the record
    over; a poller never sees committed() decrease."""
    r = srv.client()
    for trial in range(10):
        key = f"ev{trial}"
        produce(r, 0, 60, key)
        old = runs(srv, 0, 2, key)
        for i, host in enumerate(old):
            commit_as(host, 10, i, 2)
        new0 = runs(srv, 10, 4, key)[0]
        poll = RedisStreamSource(srv.url, key, timeout=5)
        seen: list[int] = []
        stop = threading.Event()
        barrier = threading.Barrier(2)

        def old_run(old: Any = old, barrier: threading.Barrier = barrier, trial: int = trial) -> None:
            barrier.wait()
            time.sleep(0.0002 * trial)
            for s in range(11, 30):
                for i, host in enumerate(old):
                    commit_as(host, s, i, 2)

        def poller(poll: Any = poll, seen: list[int] = seen, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                seen.append(poll.committed())

        threads = [threading.Thread(target=old_run), threading.Thread(target=poller)]
        for t in threads:
            t.start()
        barrier.wait()
        commit_as(new0, 11, 0, 4)
        threads[0].join()
        stop.set()
        threads[1].join()
        seen.append(poll.committed())
        assert seen == sorted(seen), f"trial {trial}: committed() went backwards: {seen}"


def test_a_late_first_commit_of_an_older_run_never_takes_the_record_back(srv):
    """A host of a 2-host run that started before the current 4-host run took the record over, and that
    commits only now, is older than the record's run: ignored, and the 4-host run goes on counting."""
    produce(srv.client(), 0, 200)
    for i, host in enumerate(runs(srv, 0, 2)):
        commit_as(host, 10, i, 2)
    zombie = runs(srv, 10, 2)[1]  # a 2-host run resumed at 10 that never committed; then killed
    current = runs(srv, 10, 4)
    assert commit_as(current[0], 12, 0, 4)
    with pytest.warns(UserWarning, match=r"host 1 of 2 ignored.*later than this iterator"):
        assert not zombie[0].commit(14, 1, 2, run=zombie[1])
    for step in (20, 40):
        assert all(commit_as(current[i], step, i, 4) for i in range(4))
    assert current[0][0].committed() == 40


def test_two_iterators_over_one_source_keep_their_own_step_maps(srv):
    """An iterator of batch size 8 made (not committed) beside a trainer of batch size 4 over the same
    source object: the trainer's commits still carry its own step map and start."""
    produce(srv.client(), 0, 200)
    src = RedisStreamSource(srv.url, KEY, timeout=5)
    pipe4 = quern.Pipeline.from_source(src).batch(4)
    pipe8 = quern.Pipeline.from_source(src).batch(8)
    with pipe4.iterator() as it:
        for _ in range(10):
            next(it)
        it.commit(10)
        with pipe8.iterator(start_step=src.committed(pipe8)) as peek:
            next(peek)
            for _ in range(10):
                next(it)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                it.commit(20)  # entries 0-79 trained
    record = src.commit_record()
    assert (record.steps, record.done, record.position) == (StepMap(4), 20, 80)
    assert (src.committed(pipe4), src.committed(pipe8)) == (20, 10)


def test_a_resume_inside_a_window_is_refused_naming_the_windows_first_step(srv):
    produce(srv.client(), 0, 100)
    src = RedisStreamSource(srv.url, KEY, timeout=5)
    with quern.Pipeline.from_source(src, seed=5).batch(4).iterator() as it:
        for _ in range(8):
            next(it)
        it.commit(8)  # entries 0-31
    windowed = quern.Pipeline.from_source(src, seed=5).shuffle("steps", steps=4).batch(4)
    with pytest.raises(ValueError) as e:
        windowed.iterator(start_step=9)
    message = str(e.value)
    assert "step 9 is not the first of its window of steps 8-11" in message, message
    assert "Resume at its step 8" in message and "not at 32" not in message, message
    with windowed.iterator(start_step=8) as it:
        next(it)
