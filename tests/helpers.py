"""What the tests share: one copy each of what they used to repeat.

- batches: :func:`batches_equal`, :func:`assert_batches_equal`, :func:`assert_iterator_gives_batch_at`,
  :func:`assert_same_pipeline`;
- files written with their own libraries: :func:`write_array_record`, :func:`write_shards`,
  :func:`write_parquets`, :func:`write_zarr`, :func:`write_files`, :func:`docs_folder`, and read back:
  :func:`read_array_records`, :func:`prepared_records`, :func:`tree`;
- modules and configs: :func:`unique_name`, :func:`write_module`, :func:`importable`,
  :func:`parquet_folder`, :func:`parquet_config`, :func:`write_config`, :func:`load_without_scan`,
  :func:`set_path` (with :data:`DELETE`), :func:`case_ids`, :func:`doubled_prefixes`, :func:`config_refusal`;
- commands: :func:`run_quern`, :func:`quern_cmd`, :func:`run_prepare`, :func:`prepare_cli`,
  :func:`sidecars`, :func:`on_a_terminal`;
- processes and ports: :func:`alive`, :func:`free_port`, :func:`spy_scan_processes`, :func:`sha256`.

Tests import it as ``from helpers import ...`` (``tests/`` is on ``sys.path``: pytest puts the
folder of ``conftest.py`` there). Libraries that start threads or take long to import (pyarrow,
TensorStore, pytest) are imported where they are used, so that a child script importing this
module starts as lean as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import cli_server
import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
QUERN = (sys.executable, "-m", "quern")  # the command line of ``python -m quern``
SCRIPT = os.path.join(os.path.dirname(sys.executable), "quern")  # the installed console script
DELETE = object()  # the value of :func:`set_path` that deletes the key
STAGING = ".quern-prepare"  # the working folder of ``quern prepare`` inside its output folder


# --------------------------------------------------------------------------- batches


def batches_equal(a: Any, b: Any) -> bool:
    """Whether two dict batches have the same keys and, key by key, the same dtype and values.

    Args:
        a: a batch (a dict of arrays).
        b: another.

    Returns:
        ``True`` when they are equal.
    """
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).dtype == np.asarray(b[k]).dtype and np.array_equal(a[k], b[k]) for k in a
    )


def assert_batches_equal(got: Any, want: Any, where: str = "") -> None:
    """Assert that ``got`` is ``want``: the same nesting (dicts by keys, tuples and lists by type
    and length), and leaves of the same type, arrays of the same dtype, shape and values.

    Args:
        got: a batch (or any nesting of dicts, tuples, lists and arrays).
        want: the expected one.
        where: said in a failure (``"step 3"``); the key path is added to it.

    Raises:
        AssertionError: the first difference, with its key path.
    """
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_batches_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_batches_equal(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and got.shape == want.shape, where
        np.testing.assert_array_equal(got, want, err_msg=where)


def assert_iterator_gives_batch_at(pipe: Any, start_step: int = 0, count: int | None = None, **options: Any) -> None:
    """Assert that ``pipe.iterator(start_step, **options)`` yields ``pipe.batch_at(s)`` for each step
    ``s`` from ``start_step``: ``count`` steps, or (``None``) every step to the end of the stream.

    Each batch is compared as it comes (a worker's batch lends its slot until the next one).

    Args:
        pipe: a pipeline (finite, when ``count`` is ``None``).
        start_step: the first step.
        count: how many steps.
        **options: the iterator's options.
    """
    s = start_step
    with pipe.iterator(start_step, **options) as it:
        for batch in it if count is None else itertools.islice(it, count):
            assert_batches_equal(batch, pipe.batch_at(s), f"step {s}")
            s += 1
    assert s - start_step == (pipe.num_steps - start_step if count is None else count)


def assert_host_slices_make_the_batch(pipe: Any, steps: Sequence[int], hosts: int = 2) -> None:
    """Assert that at each of ``steps`` the ``hosts`` host slices of a dict batch, concatenated in host
    order, are ``pipe.batch_at(step)``.

    Args:
        pipe: a batched pipeline of dict batches.
        steps: the steps.
        hosts: the host count.
    """
    for s in steps:
        parts = [pipe.batch_at(s, h, hosts) for h in range(hosts)]
        whole = pipe.batch_at(s)
        assert_batches_equal({k: np.concatenate([p[k] for p in parts]) for k in whole}, whole, f"step {s}")


def assert_same_pipeline(a: Any, b: Any, steps: Sequence[int] = (0, 7, 123)) -> None:
    """Assert that two pipelines have one fingerprint and the same batches at ``steps``.

    Args:
        a: a pipeline.
        b: another (say, ``a`` loaded back from its config).
        steps: the steps compared.
    """
    assert a.fingerprint() == b.fingerprint()
    for s in steps:
        assert_batches_equal(b.batch_at(s), a.batch_at(s), f"step {s}")


# --------------------------------------------------------------------------- files


def write_array_record(path: str | os.PathLike, records: Iterable[bytes], options: str = "group_size:1") -> None:
    """Write ``records`` into the ArrayRecord file ``path`` with array_record's own writer.

    Args:
        path: the file.
        records: the records, in order.
        options: the writer's options.
    """
    from array_record.python import array_record_module

    w = array_record_module.ArrayRecordWriter(str(path), options)
    for r in records:
        w.write(r)
    w.close()


def read_array_records(paths: Iterable[str | os.PathLike]) -> list[bytes]:
    """Every record of the ArrayRecord files ``paths``, in order, read with array_record's own reader.

    Args:
        paths: the files.

    Returns:
        The records.
    """
    from array_record.python import array_record_module

    out: list[bytes] = []
    for p in paths:
        reader = array_record_module.ArrayRecordReader(str(p))
        out += reader.read_all()
        reader.close()
    return out


def prepared_records(folder: str | os.PathLike) -> list[bytes]:
    """Every record of a prepared folder (or ArrayRecord paths), in order, read with quern's source.

    Args:
        folder: what ``ArrayRecordSource`` opens.

    Returns:
        The records, as bytes.
    """
    import quern

    src = quern.sources.ArrayRecordSource(folder)
    return [bytes(r) for r in src.read_many(np.arange(len(src), dtype=np.int64))]


def tree(folder: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too).

    Args:
        folder: the folder.

    Returns:
        ``{relative POSIX path: bytes}``, sorted by path.
    """
    folder = pathlib.Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_files(folder: pathlib.Path, files: dict[str, bytes]) -> pathlib.Path:
    """Write ``files`` (``{relative path: bytes}``) under ``folder``, making the folders they need.

    Returns:
        ``folder``.
    """
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def write_shards(d: pathlib.Path, seed: int = 0) -> None:
    """Two ArrayRecord shards ``toks-{0,1}.array_record`` of 300 variable-length byte records each.

    Args:
        d: the folder.
        seed: the records' random seed.
    """
    rng = np.random.default_rng(seed)
    for k in range(2):
        records = [rng.integers(0, 255, size=int(rng.integers(1, 40)), dtype=np.uint8).tobytes() for _ in range(300)]
        write_array_record(d / f"toks-{k}.array_record", records)


def write_parquets(d: pathlib.Path) -> None:
    """``part.parquet`` (200 rows: a list column ``v`` and ``i``) and ``empty.parquet`` (no rows) in ``d``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"v": [[float(i)] * (i % 4) for i in range(200)], "i": np.arange(200)}),
        d / "part.parquet",
        row_group_size=50,
    )
    pq.write_table(pa.table({"v": np.arange(0)}), d / "empty.parquet")


def write_zarr(path: pathlib.Path, driver: str, array: np.ndarray, chunk0: int = 7) -> dict:
    """Write ``array`` with TensorStore (``driver``: ``zarr`` or ``zarr3``) into ``path``.

    Args:
        path: the array's folder (replaced).
        driver: the TensorStore driver.
        array: the values.
        chunk0: the chunks' length along the first axis.

    Returns:
        The TensorStore spec that opens it.
    """
    import tensorstore as ts

    spec = {"driver": driver, "kvstore": {"driver": "file", "path": str(path)}}
    st = ts.open(
        spec,
        create=True,
        delete_existing=True,
        dtype=ts.dtype(array.dtype.name),
        shape=array.shape,
        chunk_layout=ts.ChunkLayout(chunk_shape=[chunk0, *array.shape[1:]]),
    ).result()
    st.write(array).result()
    return spec


# --------------------------------------------------------------------------- modules and configs


def unique_name(stem: str) -> str:
    """A module name no other test uses (modules are global to a process): ``stem`` and 10 hex digits."""
    return f"{stem}_{uuid.uuid4().hex[:10]}"


def write_module(folder: pathlib.Path, body: str, stem: str) -> str:
    """Write ``body`` as a module of a :func:`unique_name` under ``stem`` into ``folder``.

    Returns:
        The module's name.
    """
    name = unique_name(stem)
    (folder / f"{name}.py").write_text(body)
    return name


@contextlib.contextmanager
def importable(folder: pathlib.Path, name: str) -> Iterator[Any]:
    """The module ``name`` of ``folder``, imported with ``folder`` on ``sys.path`` (taken off again after).

    Yields:
        The module.
    """
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        yield __import__(name)


@contextlib.contextmanager
def docs_folder(d: pathlib.Path, n: int, max_len: int, seed: int, helpers: str, prefix: str) -> Iterator[tuple]:
    """``d`` with ``docs.parquet`` (``n`` documents of 1..``max_len - 1`` tokens: list columns
    ``tokens`` and ``mask``), the shards of :func:`write_shards` and a module of ``helpers``
    (a unique name under ``prefix``), importable.

    Yields:
        ``(d, module)``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, n)
    pq.write_table(
        pa.table(
            {
                "tokens": [rng.integers(1, 1000, k).astype(np.int32).tolist() for k in lengths],
                "mask": [(np.arange(k) % 2).astype(np.int8).tolist() for k in lengths],
            }
        ),
        d / "docs.parquet",
        row_group_size=100,
    )
    write_shards(d)
    with importable(d, write_module(d, helpers, prefix)) as module:
        yield d, module


def parquet_folder(tmp_path: pathlib.Path) -> pathlib.Path:
    """A config folder ``cfg/`` with a 40-row Parquet file ``d.parquet`` (one column ``x``).

    Returns:
        The folder.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "cfg").mkdir()
    pq.write_table(pa.table({"x": np.arange(40)}), tmp_path / "cfg" / "d.parquet")
    return tmp_path / "cfg"


def parquet_config(folder: pathlib.Path, transforms: list[dict], name: str = "c.yaml", **extra: Any) -> pathlib.Path:
    """A YAML config in ``folder`` reading its ``d.parquet`` (:func:`parquet_folder`), batches of 4.

    Args:
        folder: the config's folder.
        transforms: its ``transforms``.
        name: the file's name.
        **extra: more top-level keys.

    Returns:
        The config file.
    """
    import yaml

    path = folder / name
    cfg = {"source": {"type": "parquet", "paths": "d.parquet"}, "transforms": transforms, "batch": 4, **extra}
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_config(folder: pathlib.Path, cfg: dict, stem: str = "config", suffix: str = "yaml") -> pathlib.Path:
    """Write ``cfg`` (made plain data through JSON) into ``folder`` as ``STEM-XXXXXX.SUFFIX``, a new name.

    Args:
        folder: the config's folder.
        cfg: the config.
        stem: the start of the file's name.
        suffix: ``yaml`` or ``json``.

    Returns:
        The file.
    """
    import yaml

    path = folder / f"{stem}-{uuid.uuid4().hex[:6]}.{suffix}"
    plain = json.loads(json.dumps(cfg))
    path.write_text(json.dumps(plain) if suffix == "json" else yaml.safe_dump(plain))
    return path


def load_without_scan(path: pathlib.Path, cfg: dict, cache: pathlib.Path, **load: Any) -> Any:
    """Write ``cfg`` as YAML into ``path`` and load it with no length index in ``cache``: assert
    that loading scanned nothing (no length index cached after it).

    Args:
        path: the config file.
        cfg: the config (its length index given as a file).
        cache: the cache folder (``QUERN_CACHE_DIR``).
        **load: ``load_config``'s options.

    Returns:
        The pipeline loaded.
    """
    import yaml

    import quern

    path.write_text(yaml.safe_dump(cfg))
    for old in cache.glob("lengths/*"):
        old.unlink()
    loaded = quern.load_config(path, **load)
    assert not list(cache.glob("lengths/*"))  # read from the file: no scan, nothing cached
    return loaded


def set_path(cfg: dict, path: str, value: Any) -> dict:
    """Set the key path ``path`` (``"batch.size"``, ``"transforms.0.kwargs"``) of ``cfg`` to ``value``.

    Args:
        cfg: a config dict, changed in place.
        path: dot-separated keys; a number indexes a list.
        value: the new value, or :data:`DELETE` to delete the key.

    Returns:
        ``cfg``.
    """
    *head, last = path.split(".")
    node = cfg
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return cfg


def case_ids(cases: Iterable[tuple], width: int = 40) -> list[str]:
    """Test ids ``path=value`` for ``(path, value, ...)`` cases, cut to ``width``, with no object
    address (``<object object at 0x...>`` differs between processes: pytest-xdist needs equal ids)."""
    return [re.sub(r" at 0x[0-9a-f]+", "", f"{p}={v!r}")[:width] for p, v, *_ in cases]


def doubled_prefixes(message: str) -> list[tuple[str, str]]:
    """Consecutive ``a: b`` parts of ``message`` where ``b`` repeats ``a`` (``source: source: ...``,
    ``source: source 'x' is empty``)."""
    parts = [p.strip() for line in message.splitlines() for p in line.split(": ")]
    return [(a, b) for a, b in itertools.pairwise(parts) if a and (b == a or b.startswith(a + " "))]


def config_refusal(cfg: Any, change: tuple[str, Any] | None = None, **load: Any) -> str:
    """The message of the ``ConfigError`` that ``quern.load_config(cfg, **load)`` raises, checked to
    say each prefix once (:func:`doubled_prefixes`) and to hold no pydantic ``Value error``.

    Args:
        cfg: a config (dict or file).
        change: ``(key path, value)`` set in ``cfg`` first (:func:`set_path`).
        **load: ``load_config``'s options (``allow=...``).

    Returns:
        The message.
    """
    import pytest

    import quern

    if change is not None:
        set_path(cfg, *change)
    with pytest.raises(quern.ConfigError) as info:
        quern.load_config(cfg, **load)
    message = str(info.value)
    assert "Value error" not in message and not doubled_prefixes(message), message
    return message


# --------------------------------------------------------------------------- commands


def run_quern(
    *args: Any, cwd: Any = None, env: dict[str, str] | None = None, timeout: float = 120, script: bool = False
) -> subprocess.CompletedProcess:
    """``python -m quern ARGS`` (or the installed ``quern`` script) as a subprocess; its status is not checked.

    ``python -m quern`` is forked from a server that has made its startup imports once
    (:mod:`cli_server`; ``QUERN_TESTS_CLI=subprocess``: a fresh interpreter each time); the console
    script is always a fresh process.

    Args:
        *args: the arguments (made strings).
        cwd: the folder it runs in.
        env: its whole environment (``None``: this process's).
        timeout: seconds.
        script: run the console script instead of ``python -m quern``.

    Returns:
        The finished process, its output as text.
    """
    if not script:
        return cli_server.run([str(a) for a in args], cwd=cwd, env=env, timeout=timeout)
    command = [SCRIPT]
    return subprocess.run(
        [*command, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def quern_cmd(
    *args: Any,
    check: bool = True,
    script: bool = False,
    cwd: Any = None,
    pythonpath: str | None = TESTS,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """:func:`run_quern` with ``PYTHONPATH`` set to ``pythonpath`` alone (``tests/`` by default, for
    ``test_config:shift``; none if ``None``) and ``env`` added to this process's environment.

    Args:
        *args: the arguments.
        check: assert that it exits 0.
        script: run the console script.
        cwd: the folder it runs in.
        pythonpath: the child's ``PYTHONPATH``.
        env: variables set for the child.

    Returns:
        The finished process.
    """
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        full["PYTHONPATH"] = pythonpath
    full.update(env or {})
    out = run_quern(*args, cwd=cwd, env=full, script=script)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def run_prepare(
    *args: Any, cwd: Any, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """``python -m quern prepare ARGS`` as a subprocess in ``cwd`` (where map modules are); not checked."""
    return run_quern("prepare", *args, cwd=cwd, env=env, timeout=timeout)


def prepare_cli(capsys: Any, *args: Any) -> tuple[int, str, str]:
    """``quern prepare ARGS`` in this process (``quern.pipeline.cli.main``).

    Args:
        capsys: the test's.
        *args: the arguments (made strings).

    Returns:
        ``(exit status, stdout, stderr)``.
    """
    from quern.pipeline.cli import main

    capsys.readouterr()
    rc = main(["prepare", *map(str, args)])
    got = capsys.readouterr()
    return rc, got.out, got.err


def sidecars(out: pathlib.Path) -> list[str]:
    """The shards ``quern prepare`` has committed so far into ``out`` (a sidecar each; a
    ``*.json.PID.tmp`` is a sidecar being written)."""
    done = out / STAGING / "done"
    if not done.is_dir():
        return []
    return sorted(n[: -len(".json")] for n in os.listdir(done) if n.endswith(".array_record.json"))


def on_a_terminal(command: Sequence[str], env: dict[str, str] | None = None, status: int = 0) -> str:
    """What ``command`` wrote on a pseudo-terminal (its stdout and stderr), after it exits ``status``.

    Args:
        command: the command line.
        env: its environment (``None``: this process's).
        status: the exit status it must have.

    Returns:
        Its output, decoded.
    """
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # the other end closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.wait(timeout=120) == status, text
    return text


# --------------------------------------------------------------------------- processes and ports


def alive(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that are still running (not gone, not zombies)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spy_scan_processes(monkeypatch: Any, process_min: int = 1000) -> list[int]:
    """Scans of ``process_min`` records or more run in processes; each such scan is recorded.

    Args:
        monkeypatch: the test's.
        process_min: the smallest scan run in processes.

    Returns:
        A list that gets the process count of each scan run in processes.
    """
    from quern.pipeline.definition import scan

    monkeypatch.setattr(scan, "PROCESS_MIN", process_min)
    spawned: list[int] = []
    real = scan._scan_in_processes

    def spy(*args: Any, **kwargs: Any) -> Any:
        spawned.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(scan, "_scan_in_processes", spy)
    return spawned


def sha256(data: bytes) -> str:
    """The SHA-256 of ``data``, in hex."""
    return hashlib.sha256(data).hexdigest()
