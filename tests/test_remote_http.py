"""Tests of pipeline/cache.py and pipeline/fetch.py.

A prepared folder read over HTTP from a real nginx on 127.0.0.1, through the local-disk cache."""

import collections
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import write_array_record
from servers import needs_nginx, nginx

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare

pytestmark = needs_nginx


@pytest.fixture
def folder(tmp_path):
    """A prepared folder of 60 documents in several shards; ``(served root, documents)``."""
    docs = tmp_path / "docs"
    docs.mkdir()
    want = [b"document %d " % i * (40 + 13 * i) for i in range(60)]
    for i, d in enumerate(want):
        (docs / f"{i:02d}.txt").write_bytes(d)
    root = tmp_path / "www"
    root.mkdir()
    prepare(docs, root / "prep", shard_size="16KB", num_workers=0, progress=False)
    return root, want


def _shard_gets(srv) -> list[str]:
    return [r.path for r in srv.requests() if r.method == "GET" and r.path.endswith(".array_record")]


def test_records_over_http_equal_the_files_and_each_shard_is_fetched_once(folder, tmp_path):
    root, want = folder
    with nginx(root) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
        shards = len(src.paths)
        assert shards > 2 and len(src) == 60
        for _ in range(2):  # two shuffled passes
            ids = np.random.default_rng(len(_shard_gets(srv))).permutation(60)
            assert list(src.read_many(ids)) == [want[i] for i in ids]
        again = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
        assert list(again.read_many(np.arange(60))) == want  # another source, the same cache folder: hits
        gets = _shard_gets(srv)
    assert sorted(gets) == sorted(f"/prep/{s['file']}" for s in src.manifest["shards"])  # once each


def test_two_processes_on_a_slow_link_download_each_shard_once(folder, tmp_path):
    root, want = folder
    script = tmp_path / "reader.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, numpy as np, quern
            from quern.pipeline.remote.cache import ShardCache
            src = quern.sources.ArrayRecordSource(sys.argv[1], cache=ShardCache(sys.argv[2]))
            print(sum(len(r) for r in src.read_many(np.arange(len(src)))))
            """
        )
    )
    with nginx(root, limit_rate="200k") as srv:
        cmd = [sys.executable, str(script), f"{srv.url}/prep", str(tmp_path / "cache")]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        gets = _shard_gets(srv)
    assert [p.returncode for p in procs] == [0, 0]
    assert [int(o) for o in outs] == [sum(len(d) for d in want)] * 2
    assert len(gets) == len(set(gets))  # one download per shard for both processes


def test_a_server_that_stops_is_retried_then_an_error_naming_the_url_and_later_reads_work(folder, tmp_path):
    root, want = folder
    with nginx(root) as srv:
        src = quern.sources.ArrayRecordSource(
            f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache", retries=2, backoff=0.05)
        )
        first = list(src.read_many(np.arange(5)))  # shard 0 cached
        srv.stop()
        with pytest.raises(quern.SourceError, match="cannot be fetched after 3 tries") as e:
            src.read_many(np.asarray([59]))
        assert src.paths[-1] in str(e.value)
        pipe = quern.Pipeline.from_source(src, seed=0).batch(60)  # one step reads every shard
        with pytest.raises(quern.StepError, match="step 0") as e:
            pipe.batch_at(0)
        assert "cannot be fetched after 3 tries" in str(e.value) and "/prep/shard-" in str(e.value)
        assert list(src.read_many(np.arange(5))) == first == want[:5]  # the cached shard still reads
        srv.start()
        assert list(src.read_many(np.asarray([59]))) == [want[59]]


def test_a_missing_shard_is_an_error_naming_its_url(folder, tmp_path):
    root, _ = folder
    manifest = json.loads((root / "prep" / "manifest.json").read_text())
    os.remove(root / "prep" / manifest["shards"][1]["file"])
    with nginx(root) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache", retries=1))
        start = int(src.starts[1])
        with pytest.raises(quern.SourceError, match="not found") as e:
            src.read_many(np.asarray([start]))
        assert manifest["shards"][1]["file"] in str(e.value)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_bytes_on_the_server_are_fetched_again_once_then_an_error(folder, tmp_path, damage):
    root, want = folder
    manifest = json.loads((root / "prep" / "manifest.json").read_text())
    shard = root / "prep" / manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 3] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    with nginx(root) as srv:
        cache = ShardCache(tmp_path / "cache", retries=1)
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache)
        with pytest.raises(quern.SourceError, match="twice") as e:
            src.read_many(np.asarray([0]))
        assert manifest["shards"][0]["file"] in str(e.value)
        assert len(_shard_gets(srv)) == 2  # fetched again once
    assert not os.path.exists(cache.path(src.paths[0], manifest["shards"][0]["sha256"]))  # nothing damaged kept


def test_the_cache_folder_deleted_while_reading_is_made_again(folder, tmp_path):
    root, want = folder
    import shutil

    with nginx(root) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
        assert list(src.read_many(np.arange(3))) == want[:3]
        shutil.rmtree(tmp_path / "cache")
        assert list(src.read_many(np.asarray([59, 0]))) == [want[59], want[0]]


def test_a_dataset_four_times_the_cache_streams_through_it_each_shard_fetched_once_per_epoch(tmp_path):
    """Block shuffle over whole shards, a cache of a quarter of the data: the lookahead fetches the
    next shards in the order the steps read them and the cache evicts the one needed furthest
    ahead, so each shard is fetched once per epoch; the batches equal the local folder's."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(64):
        (docs / f"{i:02d}.txt").write_bytes(bytes([65 + i % 26]) * 3000 + b"%02d" % i)
    root = tmp_path / "www"
    root.mkdir()
    prepare(docs, root / "prep", shard_size="12KB", num_workers=0, progress=False)  # 4 documents per shard
    manifest = json.loads((root / "prep" / "manifest.json").read_text())
    assert [s["records"] for s in manifest["shards"]] == [4] * 16
    total = sum(s["bytes"] for s in manifest["shards"])

    def pipe(src):
        # two epochs and no more: nothing is fetched ahead for a third, whatever the machine's speed
        return quern.Pipeline.from_source(src, seed=5, num_epochs=2).shuffle("block", block_size=4, window=1).batch(1)

    local = pipe(quern.sources.ArrayRecordSource(str(root / "prep")))
    with nginx(root, limit_rate="2m") as srv:
        cache = ShardCache(tmp_path / "cache", capacity=total // 4)
        remote = pipe(quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache))
        most = 0
        with remote.iterator(prefetch=1, read_ahead=4) as it:  # steps computed at most 5 ahead: 2 shards
            for step in range(128):  # two epochs
                assert list(next(it)) == list(local.batch_at(step)), step
                most = max(most, cache.size())
        stats = it.stats()  # once closed: no fetch ahead is still in flight, so the counts match the server's
        gets = _shard_gets(srv)
    shard = manifest["shards"][0]["bytes"]
    assert most <= total // 4 + shard  # the cap held, but for a file in use when another came (never evicted)
    per_shard = collections.Counter(gets)
    assert set(per_shard) == {f"/prep/{s['file']}" for s in manifest["shards"]}
    assert max(per_shard.values()) <= 2  # at most once per epoch (a shard read at an epoch's end and the
    assert cache.stats["evictions"] >= 12  # next one's start is kept: Belady's rule)
    disk = stats["disk_cache"]  # the iterator reports the cache level
    assert disk["capacity"] == total // 4 and disk["bytes_held"] <= total // 4 + shard
    assert disk["misses"] == len(gets) and disk["bytes_fetched"] == sum(manifest["shards"][0]["bytes"] for _ in gets)
    assert set(stats["host_prefetch"]) == {"ready", "in_flight", "depth", "window"}


def test_parquet_and_arrayrecord_files_by_url_are_fetched_whole_and_read_like_local_ones(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from quern.pipeline.streams import config_form as dump

    root = tmp_path / "www"
    root.mkdir()
    rows = [np.arange(i % 9 + 1, dtype=np.int32) * i for i in range(50)]
    for k in range(2):
        pq.write_table(pa.table({"tokens": rows[k * 25 : (k + 1) * 25]}), root / f"t-{k}.parquet", row_group_size=10)
        write_array_record(root / f"t-{k}.array_record", [r.tobytes() for r in rows[k * 25 : (k + 1) * 25]])
    with nginx(root) as srv:
        cache = ShardCache(tmp_path / "cache")
        pq_remote = quern.sources.ParquetSource([f"{srv.url}/t-{k}.parquet" for k in range(2)], cache=cache)
        ar_remote = quern.sources.ArrayRecordSource([f"{srv.url}/t-{k}.array_record" for k in range(2)], cache=cache)
        pq_local = quern.sources.ParquetSource([str(root / f"t-{k}.parquet") for k in range(2)])
        ar_local = quern.sources.ArrayRecordSource([str(root / f"t-{k}.array_record") for k in range(2)])
        ids = np.random.default_rng(2).permutation(50)
        assert [r["tokens"].tolist() for r in pq_remote.read_many(ids)] == [rows[i].tolist() for i in ids]
        assert list(ar_remote.read_many(ids)) == [rows[i].tobytes() for i in ids]
        assert pq_remote.identity() == pq_local.identity() and ar_remote.identity() == ar_local.identity()
        assert dump.source_config(ar_remote, "source")["paths"] == [f"{srv.url}/t-{k}.array_record" for k in range(2)]
        assert cache.stats["misses"] == 4
        # a second open of the same URLs is a cache hit, which sets the cached files' access (and so change)
        # time: the sources opened first still read (their files did not change)
        again = [
            quern.sources.ParquetSource([f"{srv.url}/t-{k}.parquet" for k in range(2)], cache=cache),
            quern.sources.ArrayRecordSource([f"{srv.url}/t-{k}.array_record" for k in range(2)], cache=cache),
        ]
        assert [r["tokens"].tolist() for r in pq_remote.read_many(ids)] == [rows[i].tolist() for i in ids]
        assert list(ar_remote.read_many(ids)) == [rows[i].tobytes() for i in ids]
        assert [r["tokens"].tolist() for r in again[0].read_many(ids)] == [rows[i].tolist() for i in ids]


@pytest.mark.parametrize("lookahead", [64, 0])
def test_worker_processes_read_through_the_shared_cache(folder, tmp_path, lookahead):
    """2 workers and the parent share one cache folder: each shard is downloaded once; the workers' reads are
    counted in the parent's ``stats()`` (hits and misses: the parent itself reads nothing), also once closed."""
    root, want = folder
    with nginx(root) as srv:
        cache = ShardCache(tmp_path / "cache")
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=cache)
        pipe = quern.Pipeline.from_source(src, seed=4).shuffle().batch(6)
        ref = quern.Pipeline.from_source(quern.sources.ArrayRecordSource(str(root / "prep")), seed=4).shuffle().batch(6)
        with pipe.iterator(num_workers=2, lookahead=lookahead) as it:
            got = [list(next(it)) for _ in range(10)]
            live = it.stats()["disk_cache"]
        closed = it.stats()["disk_cache"]
        assert got == [list(ref.batch_at(s)) for s in range(10)]
        gets = _shard_gets(srv)
    assert len(gets) == len(set(gets)) == len(src.paths)  # one download per shard for the parent and 2 workers
    total = sum(s["bytes"] for s in src.manifest["shards"])
    assert cache.stats["hits"] == 0  # this process read no record (its fetches ahead count as misses): the workers did
    own = cache.stats["hits"] + cache.stats["misses"]  # this process's: its fetches ahead (final: it is closed)
    assert closed["hits"] + closed["misses"] - own >= 2, (closed, cache.stats)  # the workers' reads, 1+ each
    for disk in (live, closed):
        assert 0 < disk["bytes_fetched"] <= total and disk["misses"] <= len(gets), disk
    if not lookahead:  # nothing fetched ahead: every download is a worker's miss
        assert 0 < live["misses"] <= closed["misses"], (live, closed)
    assert closed["hits"] + closed["misses"] >= live["hits"] + live["misses"]


def test_a_download_cut_by_the_server_continues_with_a_range_request(tmp_path):
    import threading

    root = tmp_path / "www"
    root.mkdir()
    data = os.urandom(6 << 20)
    (root / "shard.bin").write_bytes(data)
    with nginx(root, limit_rate="1m") as srv:  # about 4 s for the file (nginx sends its first 2 MiB at once)
        cache = ShardCache(tmp_path / "cache", retries=6, backoff=0.2)
        url = f"{srv.url}/shard.bin"
        got = []
        t = threading.Thread(target=lambda: got.append(cache.get(url, size=len(data))))
        t.start()
        time.sleep(1.0)
        srv.stop()  # the connection breaks with part of the file fetched
        time.sleep(0.3)
        srv.start()
        t.join(timeout=60)
        requests = [r for r in srv.requests(at_least=2, timeout=2) if r.method == "GET"]
    assert got and open(got[0], "rb").read() == data
    ranged = [r for r in requests if r.range]
    assert ranged and ranged[0].range.startswith("bytes=") and not ranged[0].range.startswith("bytes=0-")
    assert cache.stats["retries"] >= 1 and cache.stats["bytes_fetched"] < 2 * len(data)
