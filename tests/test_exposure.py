"""What quern exposes (issue 21, point 10): the metrics server listens on 127.0.0.1 unless told
otherwise; stage labels (metrics, ``it.stats()``, ``quern bench``, messages) name transforms, never
their argument values nor object addresses; a config's folder trusts only Python source, so compiled
code there (``.pyc``, ``.so``, ``__pycache__``) is refused and never run."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import pathlib
import py_compile
import socket
import subprocess
import sys
import textwrap
import urllib.request
import uuid

import jax
import numpy as np
import psutil
import pytest
from helpers import parquet_config, parquet_folder, unique_name
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import quern
import quern.metrics
from quern.pipeline.cli import bench

pytestmark = pytest.mark.timeout(300)

SECRET = "s3cr3t-api-key"


# --------------------------------------------------------------------------- where the server listens


def _other_addresses() -> list[str]:
    """This machine's IPv4 addresses outside the loopback network (none on some sandboxes)."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def test_the_metrics_server_listens_on_the_loopback_address_unless_told_otherwise():
    server, thread = quern.metrics.start_http_server(0, registry=CollectorRegistry())
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        assert "quern_" in _get(f"http://127.0.0.1:{port}/metrics")
        for address in _other_addresses():  # reachable from elsewhere only when asked for
            assert not _connects(address, port), address
    finally:
        server.shutdown()
        thread.join(timeout=10)
    server, thread = quern.metrics.start_http_server(0, "0.0.0.0", registry=CollectorRegistry())
    try:
        host, port = server.server_address[:2]
        assert host == "0.0.0.0"
        assert "quern_" in _get(f"http://127.0.0.1:{port}/metrics")
        for address in _other_addresses():
            assert _connects(address, port), address
    finally:
        server.shutdown()
        thread.join(timeout=10)


# --------------------------------------------------------------------------- stage names

_TRANSFORMS = """
import functools

import numpy as np


def tokenize(r, token):
    assert token == "s3cr3t-api-key"
    return {"x": r["x"] + 1}


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, r):
        return {"x": r["x"] * self.k}

    def shift(self, batch):
        return {"x": batch["x"] + self.k}


def pipe():
    return (
        quern.Pipeline.from_source({"x": np.arange(200, dtype=np.int64)}, seed=1)
        .map(functools.partial(tokenize, token="s3cr3t-api-key"))
        .map(Scale(3))
        .map(lambda r: r)
        .batch(10)
        .map_batch(Scale(2).shift)
    )
"""

_EXPECTED = {
    "read",
    "map[0] partial(tokenize)",
    "map[1] Scale",
    "map[2] pipe.<locals>.<lambda>",
    "collate",
    "map_batch[0] Scale.shift",
}


def _stage_labels(text: str) -> set[str]:
    return {
        s.labels["stage"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "quern_stage_seconds_total"
    }


def _assert_clean(names) -> None:
    for name in names:
        assert SECRET not in name and "s3cr3t" not in name and "0x" not in name, name


def test_stage_labels_name_transforms_not_their_arguments_nor_addresses(tmp_path):
    namespace: dict = {"quern": quern}
    exec(compile(_TRANSFORMS, "transforms_for_labels", "exec"), namespace)
    pipe = namespace["pipe"]()
    registry = CollectorRegistry()
    server, thread = quern.metrics.start_http_server(0, registry=registry)
    try:
        with pipe.iterator() as it:
            for _ in range(5):
                next(it)
            stages = set(it.stats()["stages"])
            scraped = _stage_labels(_get(f"http://127.0.0.1:{server.server_address[1]}/metrics"))
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert stages == _EXPECTED, stages
    assert scraped == _EXPECTED, scraped
    profile = bench.profile(pipe, 0, count=2)  # quern bench: its table, plot and diagnosis
    assert set(bench.stage_names(pipe)) == set(profile.stages) == _EXPECTED, profile.stages
    run = bench.loop(pipe, 0, count=4, num_workers=0, step_s=0.0)
    lines = bench.report(profile, run, diagnosis=bench.diagnose(pipe, run))
    assert not [line for line in lines if "s3cr3t" in line], lines
    _assert_clean([repr(pipe)])


def test_a_failing_stage_is_named_without_its_arguments():
    def boom(r, token):
        raise ValueError("no")

    pipe = quern.Pipeline.from_source({"x": np.arange(20)}, seed=1).map(functools.partial(boom, token=SECRET)).batch(4)
    with pytest.raises(quern.StepError) as e:
        pipe.batch_at(0)
    message = str(e.value)
    assert "stage map[0] partial(" in message and "boom)" in message, message
    _assert_clean([message])


class _Decorated:
    """A decorator object: named by what it wraps."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: functools.partial(functools.partial(len), SECRET), "partial(len)"),
        (lambda: quern.transforms.pad(16), "pad"),
        (lambda: np.sqrt, "sqrt"),
        (lambda: "a".upper, "str.upper"),
        (lambda: functools.wraps(len)(functools.partial(len)), "partial(len)"),
        (lambda: jax.jit(np.negative), "negative"),
        (lambda: _Decorated(len), "len"),
        (lambda: _Decorated, "_Decorated"),
    ],
)
def test_stage_names_of_other_callables(make, name):
    from quern.pipeline.core.ops import stage_name

    assert stage_name(make()) == name


_FRESH = """
import json, sys, urllib.request

import quern, quern.metrics
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

ns = {"quern": quern}
exec(compile(open(sys.argv[1]).read(), "transforms_for_labels", "exec"), ns)
server, thread = quern.metrics.start_http_server(0, registry=CollectorRegistry())
with ns["pipe"]().iterator() as it:
    for _ in range(3):
        next(it)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10).read().decode()
server.shutdown()
labels = sorted(
    {s.labels["stage"] for f in text_string_to_metric_families(text) for s in f.samples if "stage" in s.labels}
)
print(json.dumps(labels))
"""


def test_two_fresh_processes_give_the_same_stage_labels(tmp_path):
    (tmp_path / "transforms.py").write_text(_TRANSFORMS)
    (tmp_path / "scrape.py").write_text(_FRESH)
    runs = [
        subprocess.run(
            [sys.executable, str(tmp_path / "scrape.py"), str(tmp_path / "transforms.py")],
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
        for _ in range(2)
    ]
    labels = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert labels[0] == labels[1] == sorted(_EXPECTED), labels


# --------------------------------------------------------------------------- compiled code beside a config


@pytest.fixture
def folder(tmp_path):
    """A config folder ``cfg/`` with a 40-row parquet file ``d.parquet``."""
    return parquet_folder(tmp_path)


def _config(folder, fn: str):
    return parquet_config(folder, [{"fn": fn}])


def _hostile(marker, add: int = 100) -> str:
    """Source of a module whose code, once run, creates ``marker``."""
    return textwrap.dedent(f"""
        open({str(marker)!r}, "w").write("ran")


        def fn(r):
            return {{"x": r["x"] + {add}}}
        """)


def _compile(source: str, scratch, cfile, **kw) -> None:
    src = scratch / f"src_{uuid.uuid4().hex[:8]}.py"
    src.write_text(source)
    cfile.parent.mkdir(parents=True, exist_ok=True)
    py_compile.compile(str(src), cfile=str(cfile), doraise=True, **kw)
    src.unlink()


def test_a_pyc_beside_the_config_is_refused_and_not_run(folder, tmp_path):
    name, marker = unique_name("quern_exp"), tmp_path / "RAN"
    _compile(_hostile(marker), tmp_path, folder / f"{name}.pyc")
    with pytest.raises(quern.ConfigError, match=rf"module '{name}' is {name}\.pyc in the config's folder.*not Python"):
        quern.load_config(_config(folder, f"{name}:fn"))
    assert not marker.exists()
    assert name not in sys.modules


def test_a_package_of_compiled_code_is_refused_and_not_run(folder, tmp_path):
    name, marker = unique_name("quern_exp"), tmp_path / "RAN"
    _compile(_hostile(marker), tmp_path, folder / name / "__init__.pyc")
    with pytest.raises(quern.ConfigError, match=rf"module '{name}' is {name}/__init__\.pyc .*not Python source"):
        quern.load_config(_config(folder, f"{name}:fn"))
    (folder / name / "__init__.pyc").unlink()
    (folder / name / "__init__.py").write_text("")  # a package of source whose module is compiled
    _compile(_hostile(marker), tmp_path, folder / name / "ops.pyc")
    with pytest.raises(quern.ConfigError, match=rf"module '{name}\.ops' is {name}/ops\.pyc .*not Python source"):
        quern.load_config(_config(folder, f"{name}.ops:fn"))
    assert not marker.exists()


def test_an_extension_module_beside_the_config_is_refused_before_it_is_loaded(folder):
    name = unique_name("quern_exp")
    so = f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    (folder / so).write_bytes(b"\x7fELF not really")
    with pytest.raises(quern.ConfigError, match=rf"module '{name}' is {so} in the config's folder.*not Python"):
        quern.load_config(_config(folder, f"{name}:fn"))


def test_a_module_is_compiled_from_its_source_never_from_pycache(folder, tmp_path):
    """A ``__pycache__`` file that does not match the ``.py`` (an unchecked hash-based ``.pyc`` is
    never compared with it) would run code that the reader of the ``.py`` never saw."""
    name, marker = unique_name("quern_exp"), tmp_path / "RAN"
    (folder / f"{name}.py").write_text("def fn(r):\n    return {'x': r['x'] + 1}\n")
    cached = importlib.util.cache_from_source(str(folder / f"{name}.py"))
    _compile(
        _hostile(marker),
        tmp_path,
        pathlib.Path(cached),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    batch = quern.load_config(_config(folder, f"{name}:fn")).batch_at(0)
    assert not marker.exists()
    assert set(batch["x"].tolist()) <= set(range(1, 41))  # the .py's fn (+1), not the .pyc's (+100)


@pytest.mark.parametrize("kind", ["pycache", "pth"])
def test_compiled_leftovers_and_pth_files_are_not_modules(folder, tmp_path, kind):
    name, marker = unique_name("quern_exp"), tmp_path / "RAN"
    if kind == "pycache":
        cached = importlib.util.cache_from_source(str(folder / f"{name}.py"))
        _compile(_hostile(marker), tmp_path, pathlib.Path(cached))
        said = (
            rf"module '{name}' is not allowed: the config's folder has only compiled code of it \(__pycache__/{name}\."
        )
    else:
        (folder / f"{name}.pth").write_text(f"import os; open({str(marker)!r}, 'w')\n")
        said = rf"module '{name}' is not allowed"
    with pytest.raises(quern.ConfigError, match=said):
        quern.load_config(_config(folder, f"{name}:fn"))
    assert not marker.exists()
