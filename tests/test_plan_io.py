"""Tests of pipeline/definition/io_plan.py and pipeline/remote/cache_model.py.

``quern plan`` / ``quern.plan_io``: the plan is the truth. A run of the real
iterator over a prepared folder served by nginx, through the real disk cache,
counts exactly the hits, misses, file reads and bytes the plan says, and the
server's log shows exactly the planned fetches (a global shuffle, a block
shuffle, a mixture). Belady's rule is checked by driving a real ``ShardCache``
with the plan's trace and next uses. The cache replay is checked against a
brute-force cache on random traces, and the vectorised trace against one made
step by step and host by host from ``records_of_steps``.
"""

import collections
import dataclasses
import json

import numpy as np
import pytest
import yaml
from helpers import quern_cmd
from servers import needs_nginx, nginx

import quern
from quern.pipeline.definition.io_plan import chunk_starts
from quern.pipeline.remote import cache_model
from quern.pipeline.remote.cache import ShardCache
from quern.pipeline.remote.lookahead import records_of_steps
from quern.prepare import prepare


def _folder(root, name, n, size, seed):
    """A prepared folder ``root/name`` of ``n`` documents of about ``size`` bytes, 4 per shard."""
    docs = root / f"{name}-docs"
    docs.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(n):
        (docs / f"{i:03d}.bin").write_bytes(rng.bytes(size))
    prepare(docs, root / "www" / name, shard_size=f"{4 * size}B", num_workers=0, progress=False)
    manifest = json.loads((root / "www" / name / "manifest.json").read_text())
    assert len(manifest["shards"]) >= n // 5  # several shards
    return manifest


def _pipes(kind, url):
    """The pipeline of ``kind`` over the folders at ``url``, and the cache its sources share."""

    def build(cache):
        a = quern.sources.ArrayRecordSource(f"{url}/a", cache=cache)
        if kind == "global":
            return quern.Pipeline.from_source(a, seed=3, num_epochs=2).shuffle("global").batch(4)
        if kind == "block":
            return quern.Pipeline.from_source(a, seed=3, num_epochs=2).shuffle("block", block_size=4, window=2).batch(4)
        b = quern.sources.ArrayRecordSource(f"{url}/b", cache=cache)
        pa = quern.Pipeline.from_source(a, seed=1, num_epochs=2).shuffle("global")  # finite: the iterator
        pb = quern.Pipeline.from_source(b, seed=2, num_epochs=2).shuffle("block", block_size=4)  # reads no further
        return quern.mix({"a": pa, "b": pb}, weights=[0.7, 0.3], seed=4).batch(4)

    return build


@needs_nginx
@pytest.mark.parametrize("kind", ["global", "block", "mixture"])
def test_the_plan_equals_a_run_through_a_real_http_server_and_disk_cache(tmp_path, kind):
    ma = _folder(tmp_path, "a", 48, 3000, 1)
    mb = _folder(tmp_path, "b", 32, 2000, 2)
    shard = max(s["bytes"] for s in ma["shards"] + mb["shards"])
    capacity = 3 * shard + shard // 2  # evicts: 3 shards fit, of 12 + 8
    hosts, host, read_ahead = 2, 1, 3
    with nginx(tmp_path / "www") as srv:
        build = _pipes(kind, srv.url)
        steps = build(ShardCache(tmp_path / "unused")).num_steps  # every step: the iterator reads no further
        plan = quern.plan_io(
            build(ShardCache(tmp_path / "unused")),
            hosts=hosts,
            steps=(0, steps),
            cache_bytes=capacity,
            policy="lru",
            read_ahead=read_ahead,
        )
        assert srv.requests() == [] or all(r.path.endswith("manifest.json") for r in srv.requests())  # nothing read
        cache = ShardCache(tmp_path / "cache", capacity=capacity)
        pipe = build(cache)
        with pipe.iterator(process_index=host, process_count=hosts, read_ahead=read_ahead, lookahead=0) as it:
            for _ in range(steps):
                next(it)
        gets = [r for r in srv.requests() if r.method == "GET" and r.path.endswith(".array_record")]
    fig = {k: int(v[host]) for k, v in plan.per_host.items() if k in ("hits", "misses", "bytes_fetched", "file_reads")}
    measured = {k: cache.stats[k] for k in ("hits", "misses", "bytes_fetched")}
    assert measured["misses"] > plan.per_host["files_per_epoch"][host] or kind == "mixture"  # files were fetched again
    assert {k: fig[k] for k in measured} == measured
    assert fig["file_reads"] == measured["hits"] + measured["misses"]  # each read of a file opens it
    assert fig["misses"] == len(gets) and fig["bytes_fetched"] == sum(r.sent for r in gets)  # the server's own log
    assert cache.stats["evictions"] > 0


@needs_nginx
def test_beladys_rule_replayed_equals_the_real_cache_driven_with_the_plans_reads(tmp_path):
    """The real ``ShardCache``, told each file's next read (as the lookahead tells it), fed the
    plan's reads of one host in order: its counts are the plan's, and they beat LRU's."""
    _folder(tmp_path, "a", 48, 3000, 1)
    with nginx(tmp_path / "www") as srv:
        pipe = _pipes("global", srv.url)(ShardCache(tmp_path / "unused"))
        src = pipe.sources[0]
        shard = max(s["bytes"] for s in src.manifest["shards"])
        capacity = 3 * shard + shard // 2
        plan = quern.plan_io(pipe, hosts=2, cache_bytes=capacity, policy="belady", read_ahead=2)
        lru = quern.plan_io(pipe, hosts=2, cache_bytes=capacity, policy="lru", read_ahead=2)
        bounds, files = plan.trace
        host = 0
        reads = files[bounds[host] : bounds[host + 1]].tolist()
        entry = {src._cache_path(f).rsplit("/", 1)[1]: f for f in set(reads)}
        now = {"at": 0}

        def next_use(name):
            f = entry[name]
            later = [a for a in range(now["at"], len(reads)) if reads[a] == f]
            return float(later[0]) if later else float("inf")

        cache = ShardCache(tmp_path / "cache", capacity=capacity, next_use=next_use)
        for a, f in enumerate(reads):
            now["at"] = a + 1  # the read under way is done with its file: what counts is the next one
            s = src.manifest["shards"][f]
            cache.get(src.urls[f], size=s["bytes"], sha256=s["sha256"])
    got = {k: cache.stats[k] for k in ("hits", "misses", "bytes_fetched", "evictions")}
    assert got == {k: int(plan.per_host[k][host]) for k in ("hits", "misses", "bytes_fetched")} | {
        "evictions": got["evictions"]
    }
    assert got["evictions"] > 0 and plan.per_host["misses"][host] < lru.per_host["misses"][host]


def _trace_step_by_step(pipe, hosts, steps, read_ahead):
    """The files each host reads, in order, made host by host and chunk by chunk with
    ``records_of_steps`` (one call per chunk, as the iterator's threads read)."""
    names = [p for src in dict.fromkeys(pipe.sources) for p in src.paths]
    out = []
    first = chunk_starts(steps.start, steps.stop, read_ahead).tolist() + [steps.stop]
    for h in range(hosts):
        trace = []
        for lo, hi in zip(first[:-1], first[1:]):
            for src, ids, _ in records_of_steps(pipe, range(lo, hi), h, hosts):
                f = np.searchsorted(src.starts, ids, side="right") - 1
                trace += [names.index(src.paths[i]) for i in sorted(set(f.tolist()))]
        out.append(trace)
    return out


@pytest.mark.parametrize("kind", ["global", "block", "mixture", "balanced"])
@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_the_vectorised_trace_equals_one_made_host_by_host(tmp_path, kind, hosts):
    ma = _folder(tmp_path, "a", 48, 300, 1)
    assert ma
    _folder(tmp_path, "b", 32, 200, 2)
    pipe = _pipes("mixture" if kind == "mixture" else "global" if kind == "balanced" else kind, str(tmp_path / "www"))(
        None
    )
    if kind == "balanced":  # hosts' rows dealt by length: the plan asks the pipeline host by host
        pipe = pipe.balance_hosts(lengths=np.arange(len(pipe.sources[0]))[::-1] % 7)
    n = min(20, pipe.num_steps)
    plan = quern.plan_io(pipe, hosts=hosts, steps=(0, n), read_ahead=4, lookahead=8)
    bounds, files = plan.trace
    want = _trace_step_by_step(pipe, hosts, range(0, n), 4)
    assert [files[bounds[h] : bounds[h + 1]].tolist() for h in range(hosts)] == want
    rows = [sum(len(pipe.positions(s, h, hosts)) for s in range(n)) for h in range(hosts)]
    if kind != "mixture":
        assert plan.per_host["records"].tolist() == rows
    assert plan.per_host["file_reads"].tolist() == [len(t) for t in want]


def _brute_force(reads, sizes, capacity, policy):
    """A cache of ``capacity`` bytes, written out plainly: ``(hits, misses, bytes fetched, evictions)``."""
    held, hits, misses, fetched, evicted = {}, 0, 0, 0, 0
    for a, x in enumerate(reads):
        if x in held:
            hits += 1
        else:
            misses += 1
            fetched += sizes[x]
            total = sum(sizes[y] for y in held) + sizes[x]
            while total > capacity and held:
                if policy == "lru":
                    y = min(held, key=lambda y: held[y])
                else:
                    ahead = {y: next((b for b in range(a, len(reads)) if reads[b] == y), 10**9) for y in held}
                    y = min(held, key=lambda y: (-ahead[y], held[y]))
                total -= sizes[y]
                del held[y]
                evicted += 1
        held[x] = a
    return hits, misses, fetched, evicted


@pytest.mark.parametrize("compile", [False, True])
def test_the_cache_replay_equals_a_brute_force_cache_on_random_traces(compile):
    rng = np.random.default_rng(0)
    for _ in range(150):
        sizes = rng.integers(1, 20, rng.integers(2, 12))
        counts = rng.integers(0, 50, rng.integers(1, 4))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        files = rng.integers(0, len(sizes), bounds[-1])
        capacity = int(rng.integers(sizes.max(), sizes.sum() + 5))
        for policy in ("lru", "belady"):
            fig = cache_model.simulate(files, sizes, bounds, capacity, policy, compile=compile)
            for h in range(len(counts)):
                want = _brute_force(files[bounds[h] : bounds[h + 1]].tolist(), sizes, capacity, policy)
                assert (fig.hits[h], fig.misses[h], fig.bytes_fetched[h], fig.evictions[h]) == want


def test_the_no_refetch_cache_is_the_smallest_with_each_file_fetched_once_per_epoch():
    rng = np.random.default_rng(1)
    tight = 0
    for _ in range(200):
        sizes = rng.integers(1, 20, rng.integers(2, 10))
        n = int(rng.integers(2, 40))
        files = rng.integers(0, len(sizes), n)
        epoch = np.sort(rng.integers(0, 2, n))
        bound = int(cache_model.no_refetch_bytes(files, sizes, np.array([0, n]), epoch)[0])
        once = len({(int(e), int(f)) for e, f in zip(epoch, files)})
        for e in (0, 1):  # each epoch on its own: no file fetched twice with the bound, some with a byte less
            part = files[epoch == e]
            if not len(part):
                continue
            fig = cache_model.simulate(part, sizes, np.array([0, len(part)]), max(bound, int(sizes.max())), "belady")
            assert fig.misses[0] == len(set(part.tolist()))
        assert once <= n
        whole = cache_model.no_refetch_bytes(files, sizes, np.array([0, n]), np.zeros(n, int))[0]
        if whole - 1 >= sizes[files].max():
            fig = cache_model.simulate(files, sizes, np.array([0, n]), int(whole) - 1, "belady")
            tight += fig.misses[0] > len(set(files.tolist()))
            assert fig.misses[0] > len(set(files.tolist()))
    assert tight > 20


def test_bad_input_is_a_clear_error_or_a_stated_limit(tmp_path):
    _folder(tmp_path, "a", 48, 300, 1)
    pipe = _pipes("global", str(tmp_path / "www"))(None)
    with pytest.raises(ValueError, match="--hosts 3: the global batch size 4 is not divisible"):
        quern.plan_io(pipe, hosts=3)
    with pytest.raises(ValueError, match=r"steps 20\.\.49: the pipeline has 24 steps"):
        quern.plan_io(pipe, hosts=2, steps=(20, 50))
    with pytest.raises(ValueError, match="smaller than one shard: the largest file is"):
        quern.plan_io(pipe, hosts=2, cache_bytes=100)
    with pytest.raises(ValueError, match="policy must be one of belady, lru"):
        quern.plan_io(pipe, hosts=2, cache_bytes=10**9, policy="fifo")
    generic = quern.Pipeline.from_source(list(range(40)), seed=0).shuffle().batch(4)
    plan = quern.plan_io(generic, hosts=2)
    assert set(plan.per_host) == {"records"} and plan.per_host["records"].tolist() == [20, 20]
    assert "has no files: planned in records only" in plan.text()
    endless = quern.Pipeline.from_source(list(range(40)), seed=0).batch(4)
    assert len(quern.plan_io(endless).steps) == 10  # an endless pipeline with epochs: its first epoch


def test_quern_plan_prints_the_percentiles_and_names_a_host_far_from_the_median(tmp_path):
    _folder(tmp_path, "a", 48, 300, 1)
    config = {
        "source": {"type": "array_record", "paths": str(tmp_path / "www" / "a")},
        "seed": 3,
        "num_epochs": 2,
        "shuffle": {"mode": "block", "block": 16},
        "batch": {"size": 16},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(config))
    out = quern_cmd("plan", tmp_path / "p.yaml", "--hosts", "4", "--cache", "1MB", "--policy", "lru").stdout
    assert "plan: 4 host(s), steps 0..5 (6 steps)" in out
    rows = {line[:26].strip(): line[26:].split() for line in out.splitlines()[2:] if line[:26].strip()}
    assert {"records", "files per step", "cache misses", "bytes fetched"} <= set(rows)
    assert rows["records"][:3] == ["24", "24", "24"]
    data = json.loads(quern_cmd("plan", tmp_path / "p.yaml", "--hosts", "4", "--json").stdout)
    assert data["hosts"] == 4 and data["figures"]["records"]["max"] == 24
    bad = quern_cmd("plan", tmp_path / "p.yaml", "--hosts", "5", check=False)
    assert bad.returncode == 2 and "--hosts 5" in bad.stderr


def test_a_plan_names_a_host_that_reads_far_more_than_the_median():
    pipe = quern.Pipeline.from_source(np.arange(64), seed=0).batch(8)
    plan = quern.plan_io(pipe, hosts=4)
    assert plan.outlier("records") is None  # every host reads 16
    skewed = dataclasses.replace(plan, per_host={"records": np.array([16, 16, 16, 40])})
    assert skewed.outlier("records") == (3, "records", 2.5)
    assert "host 3 is far from the median: records read 2.50x the median" in skewed.text()


def test_chunks_follow_the_iterators_threads():
    assert chunk_starts(0, 3, 16).tolist() == [0, 1]
    assert chunk_starts(5, 40, 8).tolist() == [5, 6, 8, 12, 20, 28, 36]
    assert collections.Counter(np.diff(chunk_starts(0, 100, 1)).tolist()) == {1: 99}


def _recorded_reads(pipe, host, hosts, read_ahead):
    """The files each bulk read of a real iterator touches (host ``host`` of ``hosts``), in order."""
    names = [p for src in dict.fromkeys(pipe.sources) for p in src.paths]
    seen = []
    for src in dict.fromkeys(pipe.sources):
        original = src.read_many

        def read_many(ids, src=src, original=original):
            f = np.searchsorted(src.starts, np.asarray(ids), side="right") - 1
            seen.extend(names.index(src.paths[i]) for i in sorted(set(f.tolist())))
            return original(ids)

        src.read_many = read_many
    with pipe.iterator(process_index=host, process_count=hosts, read_ahead=read_ahead, lookahead=0) as it:
        for _ in it:
            pass
    return seen


@pytest.mark.parametrize("hosts", [1, 4])
def test_a_real_iterators_reads_equal_the_plans_trace_even_in_a_padded_last_batch(tmp_path, hosts):
    """48 records in batches of 20 (the last one padded): hosts without a row in it still read row 0."""
    _folder(tmp_path, "a", 48, 300, 1)
    src = quern.sources.ArrayRecordSource(str(tmp_path / "www" / "a"))
    pipe = quern.Pipeline.from_source(src, seed=2, num_epochs=1).shuffle().batch(20, drop_remainder=False)
    plan = quern.plan_io(pipe, hosts=hosts, read_ahead=1)
    bounds, files = plan.trace
    for h in range(hosts):
        assert files[bounds[h] : bounds[h + 1]].tolist() == _recorded_reads(pipe, h, hosts, 1), h
    assert plan.per_host["records"].sum() == 48  # the probe rows are read, not counted as records


def test_planning_in_many_blocks_equals_planning_in_one(tmp_path, monkeypatch):
    from quern.pipeline.definition import io_plan

    _folder(tmp_path, "a", 48, 300, 1)
    _folder(tmp_path, "b", 32, 200, 2)
    pipe = _pipes("mixture", str(tmp_path / "www"))(None)
    whole = quern.plan_io(pipe, hosts=2, cache_bytes=10**7, read_ahead=3)
    monkeypatch.setattr(io_plan, "BLOCK_ROWS", 9)  # a block of 2 steps: chunks of 3 steps stay whole
    parts = quern.plan_io(pipe, hosts=2, cache_bytes=10**7, read_ahead=3)
    assert [x.tolist() for x in parts.trace] == [x.tolist() for x in whole.trace]
    assert {k: v.tolist() for k, v in parts.per_host.items()} == {k: v.tolist() for k, v in whole.per_host.items()}
    assert parts.egress_per_epoch.tolist() == whole.egress_per_epoch.tolist()


def test_what_cannot_be_planned_is_refused_by_name(tmp_path):
    _folder(tmp_path, "a", 48, 300, 1)
    pipe = _pipes("global", str(tmp_path / "www"))(None)
    with pytest.raises(ValueError, match="read_ahead must be"):
        quern.plan_io(pipe, hosts=2, read_ahead=0)
    decoded = quern.Pipeline.from_source(pipe.sources[0], seed=0).map(quern.transforms.decode(np.uint8))
    bucketed = decoded.bucket([3000, 4000], [4, 2], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="does not say which records its rows read: it cannot be planned"):
        quern.plan_io(bucketed, steps=(0, 4))
    late = quern.plan_io(pipe, hosts=2, steps=(20, 24))
    assert late.first_epoch == 1 and len(late.egress_per_epoch) == 1 and "epoch 1: " in late.text()
