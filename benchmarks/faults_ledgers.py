"""Reliability scenarios of ledgers checked by quern verify: huge steps, foreign ledgers (issue 36 points 7 and 9).

Each scenario is a function ``(trials, rng, tmp) -> (tried, held, notes)`` as in
:mod:`faults`, which runs the ones in :data:`SCENARIOS` with its own.

Both start from a real ledger: a config over an ArrayRecord file (96 records, batch 8,
2 epochs: 24 steps) run for 10 steps by 2 hosts with ``ledger=``, one file per host.
Each trial checks a damaged copy with ``quern verify CONFIG --ledger FILES`` in a fresh
process limited to 2 GiB of address space (so a check that materialises a range of steps
fails), within 60 s.

* ``ledger absurd lines``: 1-3 forged lines, each a real line with its step made absurd
  (``2**63``, past ``2**64``, in ``[2**62, 2**63)``, past the stream's end, negative, a
  float, a string, ``true``, ``null``) or its host count one that cannot split the batch (3,
  5, ``2**61``), inserted at a random position of a random host's file or replacing a line
  there. Held when the command exits 1, its first difference names one of the forged lines
  (``FILE:LINE: step ...``) as documented, and ``check_ledger`` in that process reports a
  bad line for exactly the forged lines, each by file and line.
* ``foreign ledger lines``: 1-3 lines of another pipeline's real ledger (another seed),
  each at a random position of a random host's file (at the same step and host slice as a
  line there, before or after it, in 7 trials of 10) or replacing a line, and perhaps a
  forged absurd line too; the config as run, or with an edit (a skip or an exclusion) from
  step 0 or a random later step. Held when the command exits 2 naming, as documented, the
  first foreign line in the order read (file and line), the line's fingerprint and this
  config's at that step. In 1 trial of 5 no foreign line is added (the control): held when
  the command exits 0 (1 when an edit from step 0 leaves nothing to check), noting the edit.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import common
import numpy as np
import yaml

import quern

SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {}

HOSTS = 2
STEPS = 10  # steps logged
NUM_STEPS = 24  # steps of the stream (96 records x 2 epochs, batch 8)

_CHILD = """
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from quern.pipeline.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    status = main(["verify", sys.argv[1], "--ledger", *sys.argv[2:]])
bad = None
if status == 1:
    import quern, quern.verify
    result = quern.verify.check_ledger(quern.load_config(sys.argv[1]), sys.argv[2:])
    bad = [d.text for d in result.differences if d.kind == "bad line"]
print(json.dumps({"status": status, "stdout": out.getvalue(), "bad": bad}))
"""
"""The child: ``quern verify`` (``main``) in 2 GiB, then ``check_ledger``'s bad lines when it exited 1."""


def _config(folder: str, seed: int, edit: dict[str, Any] | None = None) -> str:
    """A config over ``folder/data.array_record`` (written once), with ``edit`` sections; its path."""
    data = os.path.join(folder, "data.array_record")
    if not os.path.exists(data):
        rng = np.random.default_rng(0)
        common.write_array_record(data, [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(96)])
    cfg: dict[str, Any] = {
        "source": {"type": "array_record", "paths": "data.array_record"},
        "seed": seed,
        "shuffle": "global",
        "num_epochs": 2,
        "transforms": [{"name": "decode", "kwargs": {"dtype": "uint8"}}],
        "batch": {"size": 8},
        **(edit or {}),
    }
    path = os.path.join(folder, f"pipe-{seed}-{abs(hash(json.dumps(edit, sort_keys=True))) % 10**8}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _ledger(folder: str, config: str, name: str) -> list[list[str]]:
    """The lines of each host's file of a real ledger of ``config``'s first :data:`STEPS` steps."""
    pipe = quern.load_config(config)
    out = []
    for h in range(HOSTS):
        path = os.path.join(folder, f"{name}-{h}.jsonl")
        if not os.path.exists(path):
            with pipe.iterator(process_index=h, process_count=HOSTS, ledger=path) as it:
                for _ in range(STEPS):
                    next(it)
        with open(path) as f:
            out.append(f.read().splitlines(keepends=True))
    return out


_QUERN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(quern.__file__)))
"""The folder holding the quern this process imports: the child imports it too."""


def _verify(config: str, files: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The child's answer (``None``: it failed), and its stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_QUERN_ROOT, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, config, *files],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=os.path.dirname(config),
        )
    except subprocess.TimeoutExpired:
        return None, "timed out (60 s)"
    try:
        return json.loads(done.stdout.splitlines()[-1]), done.stderr
    except (IndexError, ValueError):
        return None, (done.stdout + done.stderr)[-300:]


def _absurd(line: str, rng: random.Random) -> tuple[str, str, tuple | None]:
    """A real line made absurd: its step, or its host count; the line, what was done, and its step and host
    slice when it is read as a line (a step past the end, a host count that cannot split the batch)."""
    doc = json.loads(line)
    how = rng.choice(["2**63", "2**64+", "2**62+", "past end", "negative", "float", "str", "true", "null", "hosts"])
    step = {
        "2**63": 2**63,
        "2**64+": 2**64 + rng.randrange(10**6),
        "2**62+": 2**62 + rng.randrange(2**62),
        "past end": NUM_STEPS + rng.randrange(10**6),
        "negative": -rng.randrange(1, 10**6),
        "float": rng.choice([1e30, float(doc["step"]), 2.5]),
        "str": str(doc["step"]),
        "true": True,
        "null": None,
        "hosts": doc["step"],
    }[how]
    doc["step"] = step
    if how == "hosts":
        n = rng.choice([3, 5, 2**61])
        doc["process_count"], doc["process_index"] = n, rng.randrange(min(n, 1000))
    key = (doc["step"], doc["process_count"], doc["process_index"]) if how in ("past end", "hosts") else None
    return json.dumps(doc) + "\n", how, key


def _tagged(files: list[list[str]]) -> list[list[tuple[str, bool]]]:
    return [[(line, False) for line in lines] for lines in files]


def _write(folder: str, t: int, files: list[list[tuple[str, bool]]]) -> tuple[list[str], list[tuple[str, int]]]:
    """The host files of trial ``t`` written; their paths, and the ``(file, line)`` of each marked line."""
    paths, marked = [], []
    for h, lines in enumerate(files):
        path = os.path.join(folder, f"trial{t}-{h}.jsonl")
        with open(path, "w") as f:
            f.write("".join(line for line, _ in lines))
        paths.append(path)
        marked += [(path, k) for k, (_, mark) in enumerate(lines, 1) if mark]
    return paths, marked


def _insert(files: list[list[tuple[str, bool]]], rng: random.Random, line: str, host: int | None = None) -> None:
    """:func:`_place` on marked lines: ``line`` marked, at a random place of a host's file or over a line."""
    h = rng.randrange(len(files)) if host is None else host
    lines = files[h]
    if lines and rng.random() < 0.3:
        lines[rng.randrange(len(lines))] = (line, True)
    else:
        lines.insert(rng.randrange(len(lines) + 1), (line, True))


def ledger_absurd_lines(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    folder = os.path.join(tmp, "ledgers-absurd")
    os.makedirs(folder, exist_ok=True)
    config = _config(folder, 5)
    real = _ledger(folder, config, "real")
    held, failures, kinds, times = 0, [], {}, []
    for t in range(trials):
        files = _tagged(real)
        keys: set[tuple] = set()  # two lines of one step and host slice would be one entry: a duplicate
        for _ in range(rng.randint(1, 3)):
            line, how, key = _absurd(rng.choice(real[rng.randrange(HOSTS)]), rng)
            while key is not None and key in keys:
                line, how, key = _absurd(rng.choice(real[rng.randrange(HOSTS)]), rng)
            keys.add(key)
            kinds[how] = kinds.get(how, 0) + 1
            _insert(files, rng, line)
        paths, forged = _write(folder, t, files)
        t0 = time.monotonic()
        got, err = _verify(config, paths)
        times.append(time.monotonic() - t0)
        ok = got is not None and got["status"] == 1
        if ok:
            first = next((x for x in got["stdout"].splitlines() if x.startswith("first difference: ")), "")
            named = {tuple(m.groups()) for m in (re.match(r"(.*?\.jsonl):(\d+): ", b) for b in got["bad"]) if m}
            ok = {(f, str(k)) for f, k in forged} == named and any(
                re.match(rf"first difference: {re.escape(f)}:{k}: step .*(is not a step|not a host slice)", first)
                for f, k in forged
            )
        if ok:
            held += 1
        else:
            failures.append(f"trial {t}: {(got or {}).get('stdout', '')[-200:]!r} {err[-200:]!r}")
    notes = f"{sum(kinds.values())} forged lines ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); "
    notes += f"median {sorted(times)[len(times) // 2]:.1f} s a check in 2 GiB"
    return trials, held, notes + ("; " + failures[0] if failures else "")


SCENARIOS["ledger absurd lines"] = ledger_absurd_lines


def _edit(rng: random.Random) -> tuple[dict[str, Any] | None, int | None]:
    """A random config edit (``None``: none) and its first step."""
    r = rng.random()
    if r < 0.25:
        return None, None
    start = 0 if rng.random() < 0.4 else rng.randrange(1, STEPS)
    if r < 0.65:
        return {"skip": [{"start": start, "stop": start + rng.randint(1, 3)}]}, start
    return {"exclude": [{"from_step": start, "ids": sorted(rng.sample(range(96), rng.randint(1, 5)))}]}, start


def foreign_ledger_lines(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    folder = os.path.join(tmp, "ledgers-foreign")
    os.makedirs(folder, exist_ok=True)
    real = _ledger(folder, _config(folder, 5), "real")
    foreign = _ledger(folder, _config(folder, 6), "foreign")
    held, failures, controls, added, beside, edited = 0, [], 0, 0, 0, 0
    for t in range(trials):
        edit, start = _edit(rng)
        edited += edit is not None
        config = _config(folder, 5, edit)
        files = _tagged(real)
        control = rng.random() < 0.2
        for _ in range(0 if control else rng.randint(1, 3)):
            h = rng.randrange(HOSTS)
            line = rng.choice(foreign[h])
            added += 1
            if rng.random() < 0.7:  # beside the real line of its step and host slice, before or after it
                beside += 1
                k = next(i for i, (x, _) in enumerate(files[h]) if json.loads(x)["step"] == json.loads(line)["step"])
                files[h].insert(k + rng.randrange(2), (line, True))
            else:
                _insert(files, rng, line, h)
        if not control and rng.random() < 0.3:
            files[rng.randrange(HOSTS)].insert(0, (_absurd(rng.choice(real[0]), rng)[0], False))  # a bad line first
        paths, marked = _write(folder, t, files)
        got, err = _verify(config, paths)
        pipe = quern.load_config(config)
        if control:
            controls += 1
            want = 1 if start == 0 else 0
            ok = got is not None and got["status"] == want
            ok = ok and (edit is None or "were logged before this pipeline's edits" in got["stdout"])
        else:
            path, k = marked[0]  # the first in the order read: host files in order, lines in order
            with open(path) as f:
                doc = json.loads(f.read().splitlines()[k - 1])
            s = doc["step"]
            want_text = (
                f"quern: ValueError: {path}:{k}: step {s} was logged by another pipeline: the line's fingerprint "
                f"{doc['fingerprint']}, this pipeline's {pipe.fingerprint_at(s)} (for step {s})"
            )
            last = err.strip().splitlines()[-1] if err.strip() else ""  # the error, after any warning
            ok = got is not None and got["status"] == 2 and last.startswith(want_text)
        if ok:
            held += 1
        else:
            failures.append(f"trial {t}: exit {(got or {}).get('status')}, {err[-300:]!r}")
    notes = (
        f"{added} foreign lines over {trials - controls} trials ({beside} beside their step's own line), "
        f"{edited} trials with an edit, "
        f"{controls} controls without a foreign line"
    )
    return trials, held, notes + ("; " + failures[0] if failures else "")


SCENARIOS["foreign ledger lines"] = foreign_ledger_lines
