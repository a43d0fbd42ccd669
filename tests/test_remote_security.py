"""What a hostile or careless server, a stale or tampered disk cache and a wrong manifest can do
(issue 21, points 1, 2, 7, 8, 9 and the manifest types of 11), over real HTTP (nginx and socket
servers on 127.0.0.1) and real prepared folders."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import threading

import numpy as np
import pytest
from helpers import sha256, write_array_record
from servers import needs_nginx, nginx

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare

_DOC = 3000  # bytes per document: random, so every shard of 4 has the same size in every preparation


def _docs(seed: int, n: int = 24) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, _DOC, dtype=np.uint8).tobytes() for _ in range(n)]


def _prepare(out, docs: list[bytes], work) -> dict:
    """Prepare ``docs`` into ``out`` (removed first): 4 documents per shard. The manifest."""
    shutil.rmtree(out, ignore_errors=True)
    src = work / f"docs-{hashlib.sha256(b''.join(docs)).hexdigest()[:8]}"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    for i, d in enumerate(docs):
        (src / f"{i:02d}.bin").write_bytes(d)
    prepare(src, out, shard_size="12KB", num_workers=0, progress=False)
    return json.loads((out / "manifest.json").read_text())


def _edit(folder, change) -> None:
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


@pytest.fixture
def served(tmp_path):
    """A prepared folder of 24 random documents (6 shards of 4) under ``www/prep``: ``(www, docs)``."""
    www = tmp_path / "www"
    www.mkdir()
    docs = _docs(0)
    _prepare(www / "prep", docs, tmp_path)
    return www, docs


def _cached_shards(cache: ShardCache) -> list[str]:
    return sorted(
        n
        for n in os.listdir(cache.folder)
        if n.endswith(".array_record") and os.path.isfile(os.path.join(cache.folder, n))
    )


# -- 1: names from a manifest never lead a write outside the cache -------------------------------------------


@needs_nginx
def test_a_served_manifest_whose_job_leaves_the_cache_writes_nothing_outside_it(served, tmp_path):
    www, _ = served
    payload = b"import os; os.system('touch /tmp/quern-pwned')\n"
    (www / "prep" / "metadata" / "planted.pth").write_bytes(payload)

    def hostile(m):
        m["job"] = "../../../outside"
        m["metadata"]["planted"] = {"file": "metadata/planted.pth", "dtype": "int64", "sha256": sha256(payload)}

    _edit(www / "prep", hostile)
    cache = ShardCache(tmp_path / "a" / "b" / "cache")
    target = tmp_path / "a" / "b" / "outside"  # where cache/metadata-../../../outside/ leads
    with nginx(www) as srv:
        with pytest.raises(quern.SourceError, match=r"manifest\.json.*'job' is '\.\./\.\./\.\./outside'"):
            src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache)
            src.metadata  # noqa: B018 -- what wrote the server's file there
    assert not target.exists()
    assert not [p for p in (tmp_path / "a").rglob("*") if "outside" in p.name or p.name.endswith(".pth")]


@needs_nginx
@pytest.mark.parametrize(
    "name", ["metadata/../../../x.pth", "/tmp/x.pth", "metadata/x\x00.pth", "metadata\\..\\x.pth", "x.pth"]
)
def test_a_served_metadata_file_name_not_of_the_prepared_form_is_refused_by_name(served, tmp_path, name):
    www, _ = served

    def hostile(m):
        m["metadata"]["planted"] = {"file": name, "dtype": "int64", "sha256": sha256(b"x")}

    _edit(www / "prep", hostile)
    with nginx(www) as srv:
        with pytest.raises(quern.SourceError, match="metadata field 'planted'.*not a file name inside the folder"):
            src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
            src.metadata  # noqa: B018
    assert not list(tmp_path.rglob("x.pth")) and not list((tmp_path / "cache").rglob("*.pth"))


@needs_nginx
def test_remote_metadata_is_read_from_the_content_keyed_cache_and_no_folder_is_made(served, tmp_path):
    www, docs = served
    cache = ShardCache(tmp_path / "cache")
    with nginx(www) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache)
        np.testing.assert_array_equal(src.metadata["length"], [len(d) for d in docs])
    assert not [n for n in os.listdir(cache.folder) if os.path.isdir(os.path.join(cache.folder, n))]


# -- 2: the cache never returns stale or swapped bytes -------------------------------------------------------


@needs_nginx
def test_a_folder_prepared_again_behind_the_same_url_with_same_sized_shards_is_fetched_again(served, tmp_path):
    www, docs = served
    before = json.loads((www / "prep" / "manifest.json").read_text())
    with nginx(www) as srv:
        url = f"{srv.url}/prep"
        first = quern.sources.ArrayRecordSource(url, cache=ShardCache(tmp_path / "cache"))
        assert list(first.read_many(np.arange(24))) == docs
        other = _docs(1)
        after = _prepare(www / "prep", other, tmp_path)
        assert [s["bytes"] for s in after["shards"]] == [s["bytes"] for s in before["shards"]]
        again = quern.sources.ArrayRecordSource(url, cache=ShardCache(tmp_path / "cache"))
        assert list(again.read_many(np.arange(24))) == other  # the new records, not the cached old ones
        assert again.identity() != first.identity()


@needs_nginx
@pytest.mark.parametrize("how", ["renamed", "copied over"])
def test_two_cached_shards_swapped_on_disk_are_never_read(served, tmp_path, how):
    www, docs = served
    cache = ShardCache(tmp_path / "cache")
    with nginx(www) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache)
        assert list(src.read_many(np.arange(24))) == docs
        a, b = (os.path.join(cache.folder, n) for n in _cached_shards(cache)[:2])
        if how == "renamed":
            os.rename(a, a + ".x")
            os.rename(b, a)
            os.rename(a + ".x", b)
        else:  # in place: same inode, same size, other bytes
            da, db = open(a, "rb").read(), open(b, "rb").read()
            open(a, "r+b").write(db)
            open(b, "r+b").write(da)
        misses = cache.stats["misses"]
        ids = np.random.default_rng(3).permutation(24)
        assert list(src.read_many(ids)) == [docs[i] for i in ids]
        again = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
        assert list(again.read_many(ids)) == [docs[i] for i in ids]
    assert cache.stats["misses"] == misses + 2  # both fetched again


@needs_nginx
def test_a_cached_shard_touched_but_unchanged_is_hashed_again_and_kept(served, tmp_path):
    www, docs = served
    cache = ShardCache(tmp_path / "cache")
    with nginx(www) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache)
        assert list(src.read_many(np.arange(24))) == docs
        first = os.path.join(cache.folder, _cached_shards(cache)[0])
        st = os.stat(first)
        os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        misses = cache.stats["misses"]
        assert list(src.read_many(np.arange(24))) == docs
    assert cache.stats["misses"] == misses  # its bytes were right: kept, not fetched


def test_a_forged_entry_that_keeps_its_stat_is_found_by_verify(tmp_path):
    """The documented limit of the hit check (a rewrite in place that restores the modification
    time), and its remedy: ``verify()`` hashes the entries and removes the wrong one."""
    data = os.urandom(200_000)
    (tmp_path / "f.bin").write_bytes(data)
    url = f"file://{tmp_path}/f.bin"
    cache = ShardCache(tmp_path / "cache")
    path = cache.get(url, size=len(data), sha256=sha256(data))
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"forged")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.verify() == [os.path.basename(path)] and not os.path.exists(path)
    assert open(cache.get(url, size=len(data), sha256=sha256(data)), "rb").read() == data
    assert cache.verify() == []


@needs_nginx
@pytest.mark.parametrize("kind", ["parquet", "array_record"])
def test_a_file_by_url_changed_on_the_server_with_the_same_size_is_fetched_again(tmp_path, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    www = tmp_path / "www"
    www.mkdir()
    path = www / f"t.{kind}"

    def write(values: np.ndarray) -> None:
        if kind == "parquet":
            table = pa.table({"x": values})
            pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False)
        else:
            write_array_record(path, [v.tobytes() for v in values], "group_size:1,uncompressed")

    def open_(url: str):
        cache = ShardCache(tmp_path / "cache")
        if kind == "parquet":
            return quern.sources.ParquetSource(url, cache=cache)
        return quern.sources.ArrayRecordSource([url], cache=cache)

    def values(src) -> list[int]:
        got = src.read_many(np.arange(len(src)))
        return [int(r["x"]) for r in got] if kind == "parquet" else [int(np.frombuffer(r, np.int64)[0]) for r in got]

    write(np.arange(40, dtype=np.int64))
    size = path.stat().st_size
    with nginx(www) as srv:
        url = f"{srv.url}/t.{kind}"
        assert values(open_(url)) == list(range(40))
        write(np.arange(40, dtype=np.int64) * 7 + 1)
        assert path.stat().st_size == size  # the same size: only the ETag / Last-Modified tell
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))  # nginx's ETag counts whole seconds
        assert values(open_(url)) == [7 * i + 1 for i in range(40)]


# -- 7: record counts and shards checked against the files ---------------------------------------------------


@needs_nginx
@pytest.mark.parametrize("off", [-2, -3, 1])
def test_a_served_manifest_with_a_wrong_shard_count_is_an_error_naming_the_shard(served, tmp_path, off):
    www, docs = served

    def wrong(m):
        m["shards"][1]["records"] += off
        m["records"]["count"] += off

    _edit(www / "prep", wrong)
    name = json.loads((www / "prep" / "manifest.json").read_text())["shards"][1]["file"]
    with nginx(www) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
        assert list(src.read_many(np.arange(4))) == docs[:4]  # shard 0 is right
        with pytest.raises(quern.SourceError, match=f"{name}.* holds 4 records; its manifest says {4 + off}"):
            src.read_many(np.asarray([src.starts[1]]))
        pipe = quern.Pipeline.from_source(src, seed=0).batch(len(src))
        with pytest.raises(quern.StepError, match=name):
            pipe.batch_at(0)


@needs_nginx
def test_an_absurd_record_count_is_refused_when_the_folder_opens(served, tmp_path):
    www, _ = served

    def absurd(m):
        m["records"]["count"] += 10**12 - m["shards"][0]["records"]
        m["shards"][0]["records"] = 10**12

    _edit(www / "prep", absurd)
    with nginx(www) as srv:
        with pytest.raises(quern.SourceError, match=r"shard-00000.*claims 1000000000000 records in \d+ bytes"):
            quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))


def test_a_local_shard_count_that_differs_from_its_footer_is_refused(tmp_path):
    _prepare(tmp_path / "prep", _docs(0), tmp_path)

    def wrong(m):
        m["shards"][2]["records"] -= 1
        m["records"]["count"] -= 1

    _edit(tmp_path / "prep", wrong)
    with pytest.raises(quern.SourceError, match="shard-00002.*holds 4 records; its manifest says 3"):
        quern.sources.ArrayRecordSource(str(tmp_path / "prep"))


@pytest.mark.parametrize("what", ["shard", "metadata"])
def test_a_local_shard_or_metadata_file_that_links_outside_the_folder_is_refused_by_name(tmp_path, what):
    m = _prepare(tmp_path / "prep", _docs(0), tmp_path)
    name = m["shards"][3]["file"] if what == "shard" else m["metadata"]["length"]["file"]
    inside = tmp_path / "prep" / name
    outside = tmp_path / "elsewhere.bin"
    shutil.copy(inside, outside)  # the same bytes: only where it is is wrong
    inside.unlink()
    inside.symlink_to(outside)
    with pytest.raises(quern.SourceError, match=f"{name}.*link that leads outside the folder"):
        src = quern.sources.ArrayRecordSource(str(tmp_path / "prep"))
        src.metadata  # noqa: B018


def test_a_link_inside_the_folder_is_still_read(tmp_path):
    m = _prepare(tmp_path / "prep", _docs(0), tmp_path)
    name = m["shards"][3]["file"]
    inside = tmp_path / "prep" / name
    os.rename(inside, tmp_path / "prep" / "moved.bin")
    inside.symlink_to("moved.bin")
    assert list(quern.sources.ArrayRecordSource(str(tmp_path / "prep")).read_many(np.arange(24))) == _docs(0)


# -- 11 (manifests): wrong types are a SourceError naming the manifest and the key ---------------------------


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda m: m.update(shards={"file": "x"}), "'shards'"),
        (lambda m: m.update(shards="shard-00000-of-00006.array_record"), "'shards'"),
        (lambda m: m["shards"].__setitem__(0, "shard-00000-of-00006.array_record"), "'shards\\[0\\]'"),
        (lambda m: m.update(metadata=[1, 2]), "'metadata'"),
        (lambda m: m["metadata"].__setitem__("length", "metadata/length.npy"), "'metadata\\['length'\\]'"),
        (lambda m: m.update(records=24), "'records'"),
        (lambda m: m["records"].update(count="24"), "'records.count'"),
        (lambda m: m.update(job=None), "'job'"),
        (lambda m: m["shards"][0].update(sha256="../../x"), "sha256 of shard"),
        (lambda m: m["metadata"]["length"].update(sha256=5), "sha256 of metadata field 'length'"),
        (lambda m: m["records"].update(count=m["records"]["count"] + 1), "'records.count' says"),
    ],
    ids=[
        "shards-dict",
        "shards-str",
        "shard-str",
        "metadata-list",
        "metadata-spec-str",
        "records-int",
        "count-str",
        "job-none",
        "shard-sha-path",
        "metadata-sha-int",
        "count-sum",
    ],
)
def test_a_manifest_with_a_value_of_the_wrong_type_is_a_source_error_naming_the_key(tmp_path, change, key):
    _prepare(tmp_path / "prep", _docs(0, 8), tmp_path)
    _edit(tmp_path / "prep", change)
    with pytest.raises(quern.SourceError, match=r"manifest\.json.*" + key):
        quern.sources.ArrayRecordSource(str(tmp_path / "prep"))


# -- 8: eviction never removes a folder ----------------------------------------------------------------------


@needs_nginx
def test_a_capped_cache_with_metadata_runs_its_steps(served, tmp_path):
    www, docs = served
    m = json.loads((www / "prep" / "manifest.json").read_text())
    shard = m["shards"][0]["bytes"]
    cache = ShardCache(tmp_path / "cache", capacity=2 * shard)
    local = quern.sources.ArrayRecordSource(str(www / "prep"))

    def pipe(src):
        return (
            quern.Pipeline.from_source(src, seed=1).shuffle().map(quern.transforms.decode("uint8")).pack(4096).batch(1)
        )

    with nginx(www) as srv:
        remote = pipe(quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache))  # reads the metadata
        for step in range(4):
            got, want = remote.batch_at(step), pipe(local).batch_at(step)
            assert got["tokens"].tolist() == want["tokens"].tolist()
    assert cache.stats["evictions"] > 0 and cache.size() <= 3 * shard


def test_a_folder_in_the_cache_folder_is_never_evicted_nor_counted(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    urls = []
    for i in range(4):
        (served / f"f{i}.bin").write_bytes(bytes([i]) * 100_000)
        urls.append(f"file://{served}/f{i}.bin")
    old = tmp_path / "cache" / ("metadata-" + "ab" * 16) / "metadata"  # what an older quern left there
    old.mkdir(parents=True)
    (old / "length.npy").write_bytes(b"x" * 100)
    os.utime(old.parent, (1, 1))  # the oldest thing there
    cache = ShardCache(tmp_path / "cache", capacity=250_000)
    for u in urls:
        assert open(cache.get(u), "rb").read() == open(u[len("file://") :], "rb").read()
    assert old.is_dir() and (old / "length.npy").exists()
    assert cache.stats["evictions"] == 2 and cache.size() == 200_000


# -- 9: timeouts, and the cause in the error -----------------------------------------------------------------


@contextlib.contextmanager
def _stalling_server(mode: str):
    """A server on 127.0.0.1 that never completes an answer: ``silent`` accepts and never answers;
    ``partial`` answers a HEAD, and a GET with its headers and 1000 of 100000 bytes, then stalls;
    ``backlog`` never accepts (its backlog is full: a connection is never made). Yields the port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0 if mode == "backlog" else 16)
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                request = conn.recv(65536)
                if not request:
                    return
                if mode == "partial":
                    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100000\r\nETag: "e1"\r\n\r\n')
                    if not request.startswith(b"HEAD"):
                        conn.sendall(b"a" * 1000)
                        stop.wait()  # stalls mid-body

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    if mode == "backlog":
        for _ in range(4):  # fill the backlog: further connections wait for a SYN-ACK that never comes
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
            held.append(c)
    else:
        threading.Thread(target=accept, daemon=True).start()
    try:
        yield port
    finally:
        stop.set()
        server.close()
        for c in held:
            c.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "sha256", "cause"),
    [
        ("silent", None, r"no byte for 1 s \(read_timeout\)"),
        ("silent", "0" * 64, r"no byte for 1 s \(read_timeout\)"),
        ("partial", None, r"no byte for 1 s \(read_timeout\)"),
        ("partial", "0" * 64, r"no byte for 1 s \(read_timeout\)"),
        ("backlog", None, r"no connection within 1 s \(connect_timeout\)"),
    ],
    ids=["silent", "silent-sha256", "partial", "partial-sha256", "backlog"],
)
def test_a_server_that_stalls_is_a_clear_error_after_the_timeouts(tmp_path, mode, sha256, cause):
    cache = ShardCache(tmp_path / "cache", retries=1, backoff=0.1, connect_timeout=1, read_timeout=1)
    with _stalling_server(mode) as port:
        url = f"http://127.0.0.1:{port}/shard.bin"
        with pytest.raises(quern.SourceError, match="cannot be fetched after 2 tries: ") as e:
            cache.get(url, size=100000 if sha256 else None, sha256=sha256)
    text = str(e.value)
    assert url in text and len(text.split("tries: ", 1)[1]) > 10, text  # the cause, not an empty string
    assert re.search(cause, text), text
    assert not [n for n in os.listdir(cache.folder) if not n.endswith((".lock", ".use"))]


@pytest.mark.timeout(120)
def test_a_manifest_server_that_never_answers_is_a_clear_error_naming_the_manifest(tmp_path):
    cache = ShardCache(tmp_path / "cache", connect_timeout=1, read_timeout=1)
    with _stalling_server("silent") as port:
        with pytest.raises(quern.SourceError, match=r"manifest\.json: cannot be read: .*no byte for 1 s"):
            quern.sources.ArrayRecordSource(f"http://127.0.0.1:{port}/prep", cache=cache)


def test_timeouts_must_be_positive_numbers(tmp_path):
    for bad in (0, -1, None, "30", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            ShardCache(tmp_path / "cache", read_timeout=bad)
    cache = ShardCache(tmp_path / "cache", connect_timeout=5, read_timeout=7)
    import pickle

    again = pickle.loads(pickle.dumps(cache))
    assert (again.connect_timeout, again.read_timeout) == (5.0, 7.0)
