"""Tests of pipeline/cache.py, pipeline/cache_locks.py and pipeline/cache_verify.py.

The local-disk cache of remote files, and a prepared folder read through it by URL
(``file://`` here; the HTTP server tests are in test_remote_http.py)."""

import os
import threading

import numpy as np
import pytest
from helpers import sha256

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare


@pytest.fixture
def served(tmp_path):
    """A folder of files and their ``file://`` URLs."""
    root = tmp_path / "served"
    root.mkdir()
    files = {}
    rng = np.random.default_rng(0)
    for i in range(6):
        data = rng.integers(0, 256, 100_000 + 1000 * i, dtype=np.uint8).tobytes()
        (root / f"f{i}.bin").write_bytes(data)
        files[f"file://{root}/f{i}.bin"] = data
    return root, files


def test_a_file_is_fetched_once_verified_and_then_a_hit(served, tmp_path):
    _, files = served
    cache = ShardCache(tmp_path / "cache")
    url, data = next(iter(files.items()))
    path = cache.get(url, size=len(data), sha256=sha256(data))
    assert open(path, "rb").read() == data
    assert cache.get(url, sha256=sha256(data)) == path  # keyed by the digest
    assert cache.stats["misses"] == 1 and cache.stats["hits"] == 1 and cache.stats["bytes_fetched"] == len(data)


def test_two_threads_wanting_one_file_download_it_once(served, tmp_path):
    _, files = served
    cache = ShardCache(tmp_path / "cache")
    url, data = next(iter(files.items()))
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get(url, size=len(data)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and cache.stats["misses"] == 1 and cache.stats["bytes_fetched"] == len(data)


def test_a_wrong_checksum_is_fetched_again_once_then_an_error_naming_the_url(served, tmp_path):
    _, files = served
    cache = ShardCache(tmp_path / "cache")
    url, data = next(iter(files.items()))
    with pytest.raises(quern.SourceError, match="SHA-256, twice") as e:
        cache.get(url, size=len(data), sha256=sha256(b"other bytes"))
    assert url in str(e.value)
    assert cache.stats["bytes_fetched"] == 2 * len(data)
    assert not os.path.exists(cache.path(url, sha256(b"other bytes")))  # nothing unverified under the final name
    assert not os.path.exists(cache.path(url))
    assert not [n for n in os.listdir(cache.folder) if n.endswith(".part")]
    with pytest.raises(quern.SourceError, match="bytes, not"):
        cache.get(url, size=len(data) + 1)


def test_a_missing_file_is_an_error_naming_the_url(tmp_path):
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(quern.SourceError, match="not found") as e:
        cache.get(f"file://{tmp_path}/nope.bin")
    assert "nope.bin" in str(e.value)


def test_leftovers_of_a_killed_download_are_removed_when_the_cache_opens(served, tmp_path):
    _, files = served
    folder = tmp_path / "cache"
    folder.mkdir()
    dead = folder / "0123-x.bin.999999999.1.part"  # a pid that does not run
    dead.write_bytes(b"half a file")
    cache = ShardCache(folder)
    url, data = next(iter(files.items()))
    cache.get(url)
    assert not dead.exists()


def test_the_cap_evicts_least_recently_used_never_a_file_in_use(served, tmp_path):
    _, files = served
    urls = list(files)
    cap = 3 * max(len(d) for d in files.values()) + 10  # room for any three files, not four
    cache = ShardCache(tmp_path / "cache", capacity=cap)
    pin = cache.pin(urls[0])  # in use, and the oldest
    for u in urls[:5]:
        cache.get(u)
    present = [u for u in urls if os.path.exists(cache.path(u))]
    assert urls[0] in present  # in use: kept although least recently used
    assert present == [urls[0], urls[3], urls[4]] and cache.stats["evictions"] == 2
    assert cache.size() <= cap
    pin.close()
    cache.get(urls[5])
    assert not os.path.exists(cache.path(urls[0]))  # no longer in use: evicted first


def test_a_next_use_function_evicts_what_is_needed_furthest_ahead(served, tmp_path):
    _, files = served
    urls = list(files)
    order: dict[str, float] = {}  # cache entry -> the step it is next needed at (filled below)
    cap = 3 * max(len(d) for d in files.values()) + 10
    cache = ShardCache(tmp_path / "cache", capacity=cap, next_use=lambda name: order.get(name, float("inf")))
    for u in urls[:3]:
        cache.get(u)
    names = [os.path.basename(cache.path(u)) for u in urls]
    order.update({names[0]: 1, names[1]: 9, names[2]: 2})  # urls[1] is needed furthest ahead
    cache.get(urls[3])
    assert [os.path.exists(cache.path(u)) for u in urls[:4]] == [True, False, True, True]


def test_a_prepared_folder_read_by_url_equals_the_local_folder(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_bytes(b"document %d " % i * (50 + 7 * i))
    prepare(docs, tmp_path / "prep", shard_size="8KB", num_workers=0, progress=False)
    local = quern.sources.ArrayRecordSource(str(tmp_path / "prep"))
    cache = ShardCache(tmp_path / "cache")
    remote = quern.sources.ArrayRecordSource(f"file://{tmp_path}/prep", cache=cache)
    assert len(remote) == len(local) == 40 and len(remote.paths) > 2
    assert cache.stats["misses"] == 0  # nothing fetched to open it: counts come from the manifest
    ids = np.random.default_rng(1).permutation(40)
    assert list(remote.read_many(ids)) == [b"document %d " % i * (50 + 7 * i) for i in ids]
    assert cache.stats["misses"] == len(remote.paths)
    assert remote.identity()["files"] == local.identity()["files"]  # the manifest's checksums, both
    np.testing.assert_array_equal(remote.metadata["length"], local.metadata["length"])
    pipe = quern.Pipeline.from_source(remote, seed=0).shuffle().batch(4, drop_remainder=True)
    ref = quern.Pipeline.from_source(local, seed=0).shuffle().batch(4, drop_remainder=True)
    assert [list(pipe.batch_at(s)) for s in range(3)] == [list(ref.batch_at(s)) for s in range(3)]


def test_a_url_without_a_manifest_is_refused_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(quern.SourceError, match="manifest.json does not exist"):
        quern.sources.ArrayRecordSource(f"file://{tmp_path}/empty", cache=ShardCache(tmp_path / "cache"))


def test_a_plain_http_server_without_range_requests_or_etags_works(tmp_path):
    """Python's http.server sends whole files only (no Range, no ETag): size and SHA-256 verify."""
    import functools
    import http.server

    root = tmp_path / "www"
    root.mkdir()
    data = os.urandom(3 << 20)
    (root / "shard.bin").write_bytes(data)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/shard.bin"
        cache = ShardCache(tmp_path / "cache")
        assert open(cache.get(url, size=len(data), sha256=sha256(data)), "rb").read() == data
        with pytest.raises(quern.SourceError, match="not found"):
            ShardCache(tmp_path / "cache", retries=0).get(url.replace("shard", "nothing"))
    finally:
        server.shutdown()
        server.server_close()
