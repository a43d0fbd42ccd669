"""The fingerprint covers what changes the bytes of a batch, and nothing else."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import quern
from quern.pipeline.core.errors import FingerprintError
from quern.pipeline.order import index

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pipe(fn, kind="map"):
    base = quern.Pipeline.from_source({"x": np.arange(40)}, seed=3).shuffle()
    if kind in ("map", "random_map"):
        return getattr(base, kind)(fn).batch(4)
    return getattr(base.batch(4), kind)(fn)


# ----------------------------------------------------------------------------- __main__ vs imported

TRAIN = """
import enum
import numpy as np
import quern

SCALE = {"a": [1, 2, (3, 4)], "b": np.arange(3)}

def helper(x):
    return x * SCALE["a"][0]

def double(rec):
    return {"x": helper(rec["x"]) * 2 + SCALE["b"][1]}

class Shift:
    def __init__(self, k):
        self.k = k
    def __call__(self, rec):
        return {"x": rec["x"] + self.k}

class Mode(enum.Enum):
    FAST = 1

class Declared:
    def fingerprint(self):
        return "v1"

DECLARED = Declared()
KIND = Mode.FAST

def by_mode(rec):
    return {"x": rec["x"] + (KIND.value if DECLARED else 0)}

class Rows:
    def __len__(self):
        return 30
    def __getitem__(self, i):
        return {"x": np.int64(i)}

def pipe():
    return (quern.Pipeline.from_source({"x": np.arange(30)}, seed=5).shuffle()
            .map(double).map(Shift(4)).map(by_mode).batch(6))

def report():
    generic = quern.Pipeline.from_source(Rows(), seed=5).map(double).batch(6)
    return pipe().fingerprint() + " " + generic.fingerprint()

if __name__ == "__main__":
    print(report())
"""


def _run(args, cwd, **env):
    return subprocess.run(
        args, cwd=cwd, env={**ENV, **env}, capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()


def test_script_run_as_main_and_imported_give_one_fingerprint(tmp_path):
    """Functions, callable objects, enum members, declared values and a source class of the
    script: the same whether the script is __main__ or an imported module."""
    (tmp_path / "train.py").write_text(TRAIN)
    as_main = _run([sys.executable, "train.py"], tmp_path)
    imported = _run([sys.executable, "-c", "import train; print(train.report())"], tmp_path)
    assert len(as_main) == 65 and as_main == imported
    # and the state a script saved resumes from a launcher that imports it
    state = {"step": 3, "fingerprint": as_main.split()[0]}
    code = f"import train; it = train.pipe().resume({state!r}); print(it.step); it.close()"
    assert _run([sys.executable, "-c", code], tmp_path) == "3"
    # a change to the code the script runs is a different fingerprint
    (tmp_path / "train.py").write_text(TRAIN.replace("* 2 +", "* 3 +"))
    changed = _run([sys.executable, "train.py"], tmp_path)
    assert changed.split()[0] != as_main.split()[0]


HASHSEED = """
import numpy as np
import quern

TABLE = {"b": {1, 2, 3}, "a": frozenset({"x", "y", "z"}), "c": ["p", "q"]}

def keep(rec):
    if rec["x"] in {4, 5, 6} or "x" in TABLE["a"] or "w" in {"u", "v", "w"}:
        return {"x": rec["x"] + len(TABLE["b"])}
    return rec

print(quern.Pipeline.from_source({"x": np.arange(30)}, seed=5).map(keep).batch(6).fingerprint())
"""


def test_the_fingerprint_does_not_depend_on_the_string_hash_seed(tmp_path):
    (tmp_path / "s.py").write_text(HASHSEED)
    runs = {_run([sys.executable, "s.py"], tmp_path, PYTHONHASHSEED=str(seed)) for seed in (1, 2, 3)}
    assert len(runs) == 1 and len(runs.pop()) == 32


# ----------------------------------------------------------------------------- module-level values

TABLE = {"scale": [1, 2, 3], "nested": ({"k": np.arange(4)}, {5, 6}), "name": "a"}


def _reads_table(rec):
    return {"x": rec["x"] * TABLE["scale"][0]}


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t["scale"].append(4),
        lambda t: t["nested"][0]["k"].__setitem__(2, 99),
        lambda t: t["nested"][1].add(7),
        lambda t: t.__setitem__("name", "b"),
    ],
)
def test_module_level_values_are_hashed_by_content(change, monkeypatch):
    before = _pipe(_reads_table).fingerprint()
    table = {"scale": [1, 2, 3], "nested": ({"k": np.arange(4)}, {5, 6}), "name": "a"}
    monkeypatch.setitem(globals(), "TABLE", table)
    assert _pipe(_reads_table).fingerprint() == before  # an equal value: the same fingerprint
    change(table)
    assert _pipe(_reads_table).fingerprint() != before


class Opaque:
    """No content quern can read."""

    __slots__ = ()


OPAQUE = Opaque()


def _reads_opaque(rec):
    return {"x": rec["x"] if OPAQUE is not None else 0}


def test_a_value_it_cannot_describe_is_an_error_naming_it():
    with pytest.raises(
        FingerprintError, match=r"map\[0\] _reads_opaque reads global 'OPAQUE'.*Opaque.*fingerprint\(\)"
    ):
        _pipe(_reads_opaque).fingerprint()


class Declared:
    """Declares its content with fingerprint()."""

    def __init__(self, version: str) -> None:
        self.version = version

    def fingerprint(self) -> str:
        return self.version


DECLARED = Declared("v1")


def _reads_declared(rec):
    return {"x": rec["x"] + len(DECLARED.version)}


def test_a_declared_value_is_described_by_its_fingerprint_method(monkeypatch):
    before = _pipe(_reads_declared).fingerprint()
    monkeypatch.setitem(globals(), "DECLARED", Declared("v2"))
    assert _pipe(_reads_declared).fingerprint() != before
    monkeypatch.setitem(globals(), "DECLARED", Declared("v1"))
    assert _pipe(_reads_declared).fingerprint() == before


# ----------------------------------------------------------------------------- callables by their state


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, rec):
        return {"x": rec["x"] * self.k}

    def apply(self, rec):
        return {"x": rec["x"] * self.k}


def _times(rec, k):
    return {"x": rec["x"] * k}


def test_callable_instances_partials_and_bound_methods_are_described_by_state():
    assert _pipe(Scale(2)).fingerprint() != _pipe(Scale(3)).fingerprint()
    assert _pipe(Scale(2)).fingerprint() == _pipe(Scale(2)).fingerprint()
    assert _pipe(functools.partial(_times, k=2)).fingerprint() != _pipe(functools.partial(_times, k=3)).fingerprint()
    assert _pipe(functools.partial(_times, k=2)).fingerprint() == _pipe(functools.partial(_times, k=2)).fingerprint()
    assert _pipe(Scale(2).apply).fingerprint() != _pipe(Scale(3).apply).fingerprint()
    assert _pipe(Scale(2).apply).fingerprint() == _pipe(Scale(2).apply).fingerprint()
    # a registered transform's parameters
    pad8 = quern.Pipeline.from_source({"x": np.arange(9)}, seed=0).map(quern.transforms.pad(8, key="x")).batch(3)
    pad9 = quern.Pipeline.from_source({"x": np.arange(9)}, seed=0).map(quern.transforms.pad(9, key="x")).batch(3)
    assert pad8.fingerprint() != pad9.fingerprint()


def test_closures_defaults_and_recursion():
    def make(k):
        return lambda rec: {"x": rec["x"] + k}

    assert _pipe(make(1)).fingerprint() != _pipe(make(2)).fingerprint()
    assert _pipe(make(1)).fingerprint() == _pipe(make(1)).fingerprint()

    def with_default(rec, k=1):
        return {"x": rec["x"] + k}

    other = functools.partial(with_default, k=2)
    assert _pipe(with_default).fingerprint() != _pipe(other).fingerprint()
    assert _pipe(_recursive).fingerprint() == _pipe(_recursive).fingerprint()


def _recursive(rec, depth=2):
    return rec if depth == 0 else _recursive(rec, depth - 1)


# ----------------------------------------------------------------------------- balance_hosts, version, states


def test_balance_hosts_lengths_take_part_in_equality_and_fingerprint():
    base = quern.Pipeline.from_source({"x": np.arange(16)}, seed=0).batch(8)
    a = base.balance_hosts(np.arange(16))
    b = base.balance_hosts(np.arange(16).copy())
    c = base.balance_hosts(np.arange(16)[::-1].copy())
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a != c and a.fingerprint() != c.fingerprint()
    assert a != base and a.fingerprint() != base.fingerprint()


def test_the_index_format_version_is_in_the_fingerprint(monkeypatch):
    pipe = quern.Pipeline.from_source({"x": np.arange(16)}, seed=0).shuffle().batch(4)
    state = {"step": 2, "fingerprint": pipe.fingerprint()}
    assert pipe.describe()["index_format"] == index.INDEX_FORMAT_VERSION
    monkeypatch.setattr(index, "INDEX_FORMAT_VERSION", index.INDEX_FORMAT_VERSION + 1)
    bumped = quern.Pipeline.from_source({"x": np.arange(16)}, seed=0).shuffle().batch(4)
    assert bumped.fingerprint() != state["fingerprint"]
    with pytest.raises(ValueError, match="data order version"):
        bumped.check_state(state)


@pytest.mark.parametrize("state", [{"step": 3}, {"step": 3, "fingerprint": None}])
def test_a_state_without_fingerprint_is_refused_unless_forced(state):
    pipe = quern.Pipeline.from_source({"x": np.arange(16)}, seed=0).batch(4)
    with pytest.raises(ValueError, match="no fingerprint.*force=True"):
        pipe.check_state(state)
    with pytest.raises(ValueError, match="no fingerprint"):
        pipe.resume(state)
    assert pipe.check_state(state, force=True) == 3
    with pipe.resume(state, force=True) as it:
        assert it.step == 3
        np.testing.assert_array_equal(next(it)["x"], pipe.batch_at(3)["x"])


def test_quern_run_refuses_a_state_without_fingerprint(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": np.arange(40)}), tmp_path / "d.parquet")
    (tmp_path / "c.yaml").write_text(
        textwrap.dedent("""
        source: {type: parquet, paths: d.parquet}
        batch: 4
    """)
    )
    (tmp_path / "s.json").write_text(json.dumps({"step": 2}))
    quern_cmd = [
        sys.executable,
        "-m",
        "quern.pipeline.cli",
        "run",
        str(tmp_path / "c.yaml"),
        "--steps",
        "1",
        "--state",
        str(tmp_path / "s.json"),
    ]
    refused = subprocess.run(quern_cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no fingerprint" in refused.stderr and "--force" in refused.stderr
    forced = subprocess.run(quern_cmd + ["--force"], capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert "next step 3" in forced.stdout


def test_the_fingerprint_does_not_depend_on_names_that_change_no_byte():
    def first(rec):
        return {"x": rec["x"] + 1}

    def second(rec):
        return {"x": rec["x"] + 1}

    assert _pipe(first).fingerprint() == _pipe(second).fingerprint()


@functools.cache
def _cached_double(x):
    return 2 * x


@functools.cache
def _cached_triple(x):
    return 3 * x


def _uses_cached(rec):
    return {"x": rec["x"] + _cached_double(1)}


def test_library_wrappers_are_described_by_the_function_they_wrap(monkeypatch):
    import jax

    before = _pipe(_uses_cached).fingerprint()
    monkeypatch.setitem(globals(), "_cached_double", _cached_triple)
    assert _pipe(_uses_cached).fingerprint() != before
    jitted = [jax.jit(lambda x: x * 2), jax.jit(lambda x: x * 2), jax.jit(lambda x: x * 3)]
    fps = [_pipe(lambda rec, f=f: {"x": rec["x"] + int(f(1))}).fingerprint() for f in jitted]
    assert fps[0] == fps[1] != fps[2]


# ----------------------------------------------------------------------------- review findings, pinned


def _take_first(rec):
    return {"x": rec["x"][..., 0]}


def test_code_constants_such_as_ellipsis_are_described_and_iteration_works():
    pipe = quern.Pipeline.from_source({"x": np.arange(30).reshape(10, 3)}, seed=0).map(_take_first).batch(2)
    assert len(pipe.fingerprint()) == 32
    with pipe.iterator() as it:
        np.testing.assert_array_equal(next(it)["x"], [0, 3])


def test_c_callables_are_described_by_what_they_pickle_to():
    import operator

    src = {"x": np.arange(8), "y": np.arange(8) * 10}
    fps = [
        quern.Pipeline.from_source(src).map(f).batch(2).fingerprint()
        for f in (operator.itemgetter("x"), operator.itemgetter("y"), operator.itemgetter("x"))
    ]
    assert fps[0] == fps[2] != fps[1]


def _add(a, b):
    return a + b


def _mul(a, b):
    return a * b


OPS = {"combine": _add}
DTYPES = {"out": np.int32}


def _dispatch(rec):
    return {"x": OPS["combine"](rec["x"], 2).astype(DTYPES["out"])}


def test_containers_of_functions_and_classes_are_described_element_by_element(monkeypatch):
    before = _pipe(_dispatch).fingerprint()
    monkeypatch.setitem(OPS, "combine", _mul)
    assert _pipe(_dispatch).fingerprint() != before
    monkeypatch.setitem(OPS, "combine", _add)
    monkeypatch.setitem(DTYPES, "out", np.int64)
    assert _pipe(_dispatch).fingerprint() != before
    monkeypatch.setitem(DTYPES, "out", np.int32)
    assert _pipe(_dispatch).fingerprint() == before
    monkeypatch.setitem(OPS, "lock", OPAQUE)  # the element is named, not just the container
    with pytest.raises(FingerprintError, match=r"global 'OPS'\['lock'\], a .*Opaque"):
        _pipe(_dispatch).fingerprint()


SELF_REF: dict = {}
SELF_REF["me"] = SELF_REF


def _reads_self_ref(rec):
    return {"x": rec["x"] + len(SELF_REF)}


def test_a_value_that_contains_itself_is_a_fingerprint_error():
    with pytest.raises(FingerprintError, match="contains itself"):
        _pipe(_reads_self_ref).fingerprint()


class Helped:
    FACTOR = 2

    def helper(self, x):
        return x * self.FACTOR

    def apply(self, rec):
        return {"x": self.helper(rec["x"])}


def test_a_bound_method_is_described_with_its_class(monkeypatch):
    before = _pipe(Helped().apply).fingerprint()
    monkeypatch.setattr(Helped, "FACTOR", 3)
    assert _pipe(Helped().apply).fingerprint() != before
    monkeypatch.setattr(Helped, "FACTOR", 2)
    monkeypatch.setattr(Helped, "helper", lambda self, x: x + self.FACTOR)
    assert _pipe(Helped().apply).fingerprint() != before


def _uses_library_functions(rec):
    from json import loads
    from re import sub

    return {"x": np.clip(rec["x"], 0, len(sub("a", "", loads('"abc"'))))}


def test_library_functions_are_described_by_name():
    pipe = _pipe(functools.partial(np.clip, a_min=0, a_max=5), kind="map_batch")
    assert len(pipe.fingerprint()) == 32
    assert len(_pipe(_uses_library_functions).fingerprint()) == 32


def _chain(depth):
    def make(next_fn):
        return lambda x: next_fn(x) + 1

    fn = lambda x: x  # noqa: E731
    for _ in range(depth):
        fn = make(fn)
    return fn


def test_long_chains_of_helpers_are_described():
    deep = _chain(40)
    pipe = _pipe(lambda rec: {"x": deep(rec["x"])})
    assert len(pipe.fingerprint()) == 32
    np.testing.assert_array_equal(
        pipe.batch_at(0)["x"],
        quern.Pipeline.from_source({"x": np.arange(40)}, seed=3).shuffle().batch(4).batch_at(0)["x"] + 40,
    )


lock = OPAQUE  # a global whose name is also an attribute name read below


def test_attribute_names_are_not_taken_for_globals():
    class Rec(dict):
        lock = None

    assert len(_pipe(lambda rec: {"x": Rec(rec).lock or rec["x"]}).fingerprint()) == 32


def test_a_transform_it_cannot_describe_stops_checkpointing_not_iteration():
    pipe = _pipe(_reads_opaque)
    with pipe.iterator() as it:
        assert next(it)["x"].shape == (4,)
        with pytest.raises(FingerprintError, match="OPAQUE"):
            it.state()


def test_structured_arrays_with_the_same_bytes_and_other_fields_differ():
    from quern.pipeline.identity.hashing import digest

    a = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")])
    b = np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])
    assert digest(a) != digest(b)


def test_the_cli_says_a_definition_it_cannot_fingerprint_and_bad_state_steps_are_usage_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": np.arange(40)}), tmp_path / "d.parquet")
    (tmp_path / "opaque_transforms.py").write_text(
        "import threading\nLOCK = threading.Lock()\n\ndef f(rec):\n    return rec if LOCK else rec\n"
    )
    (tmp_path / "c.yaml").write_text(
        "source: {type: parquet, paths: d.parquet}\ntransforms: [{fn: 'opaque_transforms:f'}]\nbatch: 4\n"
    )
    (tmp_path / "s.json").write_text(json.dumps({"step": "3", "fingerprint": "x"}))
    cmd = [sys.executable, "-m", "quern"]
    saved = subprocess.run(
        cmd + ["run", str(tmp_path / "c.yaml"), "--steps", "2", "--save-state", str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert saved.returncode == 2 and "global 'LOCK'" in saved.stderr and "Traceback" not in saved.stderr
    bad_step = subprocess.run(
        cmd + ["run", str(tmp_path / "c.yaml"), "--state", str(tmp_path / "s.json"), "--force"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad_step.returncode == 2 and "state['step']" in bad_step.stderr
    before = subprocess.run(
        cmd
        + ["--traceback", "run", str(tmp_path / "c.yaml"), "--steps", "2", "--save-state", str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert before.returncode == 2 and "Traceback" in before.stderr


def test_builtin_transforms_are_described_by_name_version_and_arguments(monkeypatch):
    """quern's own registered transforms are in the fingerprint by name, VERSION and arguments: an edit of
    their code (a docstring, a refactor) changes no fingerprint; a VERSION bump or another argument does.
    A user's registered transform is still described by its code."""
    from quern.pipeline.identity.fingerprint import describe_callable
    from quern.transforms.pad import Pad

    base = quern.Pipeline.from_source({"x": np.arange(9)}, seed=0)
    p = base.map(quern.transforms.pad(8, key="x")).batch(3)
    d = describe_callable(quern.transforms.pad(8, key="x"))
    assert d["transform"] == "pad" and d["version"] == Pad.VERSION and d["args"]["length"] != d["args"]["key"]
    before = p.fingerprint()

    original = Pad._fields

    def _fields(self, record, out, n, mask):  # same behaviour, other code (a docstring added)
        """Edited."""
        return original(self, record, out, n, mask)

    monkeypatch.setattr(Pad, "_fields", _fields)
    assert base.map(quern.transforms.pad(8, key="x")).batch(3).fingerprint() == before
    monkeypatch.setattr(Pad, "VERSION", Pad.VERSION + 1)
    assert base.map(quern.transforms.pad(8, key="x")).batch(3).fingerprint() != before
    monkeypatch.undo()
    assert base.map(quern.transforms.pad(9, key="x")).batch(3).fingerprint() != before

    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Mine:
        VERSION = 1
        k: int = 1

        def __call__(self, r):
            return r + self.k

    monkeypatch.setitem(quern.pipeline.core.registry.REGISTRY, "mine_for_test", Mine)
    assert "code" in json.dumps(describe_callable(Mine()))  # not quern's own: by its code


def test_quern_functions_a_transform_calls_are_described_by_name():
    """A user transform that calls a quern function imported by name (``from quern.transforms.random import
    uniform``) is described with that function by its name, not its code: quern's docstrings and refactors
    change no fingerprint (its outputs are versioned by the index format and pinned by the golden tests)."""
    from quern.pipeline.identity.fingerprint import describe_callable
    from quern.transforms.random import uniform

    def noisy(batch, keys):
        return {**batch, "u": uniform(keys)}

    d = json.dumps(describe_callable(noisy))
    assert "function quern.transforms.random.uniform" in d
