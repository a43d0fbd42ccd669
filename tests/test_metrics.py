"""quern.metrics: the iterators of the process scraped over HTTP on 127.0.0.1 (prometheus_client's
server, its text parser), and by a real Prometheus where one is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import numpy as np
import pytest
from helpers import free_port
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from servers import needs_nginx, needs_prometheus, nginx, prometheus

import quern
import quern.metrics
from quern.pipeline.core.timing import LIVE

PID = str(os.getpid())


def slow(batch):
    time.sleep(0.01)  # the loop below takes none: it waits for data
    return batch


def _pipe(n=1000, **kw):
    return quern.Pipeline.from_source({"x": np.arange(n, dtype=np.int64)}, seed=1, **kw).batch(10)


class Scrape:
    """One scrape of ``/metrics``: ``families`` (name -> family, counters by their family name
    without ``_total``) and ``samples`` (sample name -> [(labels, value)])."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            self.text = r.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for f in self.families.values():
            for s in f.samples:
                self.samples.setdefault(s.name, []).append((s.labels, s.value))

    def of(self, it, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        """The samples of ``name`` of iterator ``it`` (with these extra labels)."""
        serial = str(quern.metrics.collector().serial(it))
        return [
            (lab, v)
            for lab, v in self.samples.get(name, [])
            if lab["iterator"] == serial and lab["process"] == PID and all(lab.get(k) == w for k, w in labels.items())
        ]

    def value(self, it, name: str, **labels: str) -> float:
        got = self.of(it, name, **labels)
        assert len(got) == 1, (name, labels, got)
        return got[0][1]

    def iterators(self) -> set[str]:
        return {lab["iterator"] for lab, _ in self.samples.get("quern_steps_total", [])}


@pytest.fixture
def scrape():
    """A server of a fresh registry on a free port of 127.0.0.1; calling the fixture scrapes it."""
    registry = CollectorRegistry()
    server, thread = quern.metrics.start_http_server(0, "127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    yield lambda: Scrape(url)
    server.shutdown()
    server.server_close()
    thread.join(5)


def _family_names(scrape: Scrape) -> set[str]:
    """The names as scraped (a counter's with its ``_total``)."""
    return {f.name + "_total" if f.type == "counter" else f.name for f in scrape.families.values()}


def test_an_iterator_is_reported_with_its_labels_steps_wait_stages_and_health(scrape):
    with _pipe().map_batch(slow).iterator(process_index=1, process_count=2) as it:
        for _ in range(6):
            next(it)
        stats = it.stats()
        got = scrape()
    assert _family_names(got) == set(quern.metrics.METRICS)  # the documented names, all of them described
    assert all(name.startswith("quern_") for name in got.families)
    assert all(name.startswith("quern_") for name in quern.metrics.METRICS)
    assert len(set(quern.metrics.METRICS)) == len(quern.metrics.METRICS)
    assert set(got.samples) <= set(quern.metrics.METRICS)
    for lab, _ in got.of(it, "quern_steps_total"):
        assert lab == {"host": "1", "process": PID, "iterator": lab["iterator"]}  # host = process_index
    assert got.value(it, "quern_steps_total") == 6
    wait_name = "quern_data_wait_seconds_total"
    assert "wait" in wait_name and got.families["quern_data_wait_seconds"].type == "counter"
    assert got.value(it, wait_name) == pytest.approx(stats["data_wait"]["total"]) and stats["data_wait"]["total"] > 0
    assert got.value(it, "quern_data_wait_mean_seconds") > 0
    assert got.value(it, "quern_data_wait_max_seconds") >= got.value(it, "quern_data_wait_mean_seconds")
    assert got.value(it, "quern_first_batch_seconds") == pytest.approx(stats["first_batch_s"])
    assert got.value(it, "quern_step_period_mean_seconds") > 0
    assert 0 < got.value(it, "quern_bubble_ratio") <= 1
    stages = {lab["stage"]: v for lab, v in got.of(it, "quern_stage_seconds_total")}
    assert {"read", "collate", "map_batch[0] slow"} <= set(stages) and stages["map_batch[0] slow"] > 0.05
    assert got.value(it, "quern_stage_steps_total") == stats["stage_steps"] >= 6
    health = {lab["state"]: v for lab, v in got.of(it, "quern_health")}
    assert set(health) == {"healthy", "warning", "alarm", "unknown"} and sum(health.values()) == 1
    assert health[stats["health"]] == 1
    prefetch = {lab["state"]: v for lab, v in got.of(it, "quern_host_prefetch_batches")}
    assert set(prefetch) == {"ready", "in_flight"}
    assert got.value(it, "quern_host_prefetch_depth_batches") >= 1
    assert got.value(it, "quern_workers") == 0
    assert not got.of(it, "quern_worker_restarts_total") and not got.of(it, "quern_device_prefetch_batches")
    assert not got.of(it, "quern_disk_cache_hits_total")  # an in-memory source: no disk cache


def test_two_iterators_have_two_label_sets_and_a_closed_one_leaves_the_next_scrape(scrape):
    threads = _pipe().map_batch(slow).iterator()
    workers = _pipe().map_batch(slow).iterator(num_workers=2)
    try:
        for _ in range(3):
            next(threads)
        for _ in range(4):
            next(workers)
        got = scrape()
        a, b = (str(quern.metrics.collector().serial(x)) for x in (threads, workers))
        assert a != b and {a, b} <= got.iterators()
        assert got.value(threads, "quern_steps_total") == 3 and got.value(workers, "quern_steps_total") == 4
        assert got.value(workers, "quern_data_wait_seconds_total") > 0
        assert got.value(workers, "quern_workers") == 2 and got.value(workers, "quern_worker_restarts_total") == 0
        delivered = {lab["worker"]: v for lab, v in got.of(workers, "quern_worker_delivered_steps_total")}
        assert set(delivered) == {"0", "1"}
        # a worker sends a task's stage seconds with its last step: the first tasks (one step each) are in
        assert 2 <= got.value(workers, "quern_stage_steps_total") <= sum(delivered.values())
        assert {"read", "collate", "send", "handover"} <= {
            lab["stage"] for lab, _ in got.of(workers, "quern_stage_seconds_total")
        }
        threads.close()
        later = scrape()
        assert a not in later.iterators() and b in later.iterators()
        assert not later.of(threads, "quern_health")  # none of its series is left
        next(workers)
        assert later.value(workers, "quern_steps_total") == 4 and scrape().value(workers, "quern_steps_total") == 5
    finally:
        threads.close()
        workers.close()
    assert b not in scrape().iterators()


def test_a_global_iterator_reports_its_device_prefetch_and_device_put_and_not_its_host_iterator(scrape):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with quern.sharding.global_iterator(_pipe(), mesh, device_prefetch=2) as it:
        for _ in range(3):
            next(it)
        got = scrape()
        assert it._host not in set(LIVE)
        assert got.iterators() == {str(quern.metrics.collector().serial(x)) for x in LIVE}  # the host one is not there
        assert got.value(it, "quern_steps_total") == 3
        assert got.value(it, "quern_device_prefetch_batches") == 2
        assert got.value(it, "quern_device_prefetch_depth_batches") == 2
        stages = {lab["stage"]: v for lab, v in got.of(it, "quern_stage_seconds_total")}
        assert {"read", "collate", "device_put"} <= set(stages) and stages["device_put"] > 0
        assert got.of(it, "quern_host_prefetch_batches")  # the host iterator's figures, under the global one
    assert str(quern.metrics.collector().serial(it)) not in scrape().iterators()


def test_the_default_registry_serves_on_two_ports_and_registers_once():
    ports = [free_port(), free_port()]
    servers = [quern.metrics.start_http_server(port, "127.0.0.1") for port in ports]  # twice: no duplicate error
    assert quern.metrics.register() is quern.metrics.collector()  # again: nothing
    try:
        with _pipe().iterator() as it:
            next(it)
            serial = str(quern.metrics.collector().serial(it))
            for port in ports:
                got = Scrape(f"http://127.0.0.1:{port}/metrics")
                assert got.value(it, "quern_steps_total") == 1 and serial in got.iterators()
                assert any(name.startswith("process_") or name.startswith("python_") for name in got.families)
            assert b"quern_steps_total{" in quern.metrics.generate_latest()
    finally:
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join(5)


def test_every_name_is_documented_in_the_module_docstring_table():
    rows = [line.split("``")[1] for line in quern.metrics.__doc__.splitlines() if line.startswith("``quern_")]
    assert rows == list(quern.metrics.METRICS)  # one row per name, in the same order


class _Broken:
    """An object in LIVE whose stats() fails, as a misbehaving iterator would."""

    process_index = 0

    def stats(self):
        raise ValueError("broken stats")


def test_an_iterator_whose_stats_fail_is_left_out_and_the_scrape_still_answers(scrape, caplog):
    broken = _Broken()
    LIVE.add(broken)
    try:
        with _pipe().iterator() as it:
            next(it)
            before = quern.metrics.collector().errors
            got = scrape()
            scrape()
            assert got.value(it, "quern_steps_total") == 1
            assert str(quern.metrics.collector().serial(broken)) not in got.iterators()
            assert quern.metrics.collector().errors == before + 2
            warned = [r for r in caplog.records if r.name == "quern.pipeline.iterate.prometheus"]
            assert len(warned) == 1 and "broken stats" in str(warned[0].exc_info[1])  # logged once
    finally:
        LIVE.discard(broken)


def test_scrapes_during_training_always_see_the_iterator(scrape):
    """The HTTP thread reads stats() while the training thread is in next(): no read fails."""
    before = quern.metrics.collector().errors
    steps: list[float] = []
    stop = threading.Event()

    def scraper(it):
        while not stop.is_set():
            steps.append(scrape().value(it, "quern_steps_total"))

    with _pipe(100_000).iterator(prefetch=4) as it:
        t = threading.Thread(target=scraper, args=(it,))
        t.start()
        try:
            for _ in range(3000):
                next(it)
        finally:
            stop.set()
            t.join(10)
    assert len(steps) > 10 and steps == sorted(steps)
    assert quern.metrics.collector().errors == before


def test_import_quern_leaves_metrics_out_and_a_missing_client_says_what_to_install():
    code = (
        "import sys, quern; assert 'quern.metrics' not in sys.modules and 'prometheus_client' not in sys.modules\n"
        "sys.modules['prometheus_client'] = None\n"
        "try:\n    import quern.metrics\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'quern[metrics]'" in out.stdout


@needs_nginx
def test_a_global_iterator_of_a_source_read_by_url_reports_every_metric(scrape, tmp_path):
    """Workers, a global iterator and a disk cache: every documented name has a sample."""
    from quern.pipeline.remote.cache import ShardCache
    from quern.prepare import prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_bytes(b"%02d" % i * 500)
    root = tmp_path / "www"
    root.mkdir()
    prepare(docs, root / "prep", shard_size="4KB", num_workers=0, progress=False)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with nginx(root) as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache", capacity=1 << 20))
        pipe = (
            quern.Pipeline.from_source(src, seed=2)
            .map(lambda r: np.frombuffer(r[:4], np.uint8).astype(np.int32))
            .batch(4)
        )
        with quern.sharding.global_iterator(pipe, mesh, num_workers=2, device_prefetch=1) as it:
            for _ in range(5):
                next(it)
            deadline = time.monotonic() + 10
            while True:  # the lookahead fetches ahead in this process on its own thread
                got = scrape()
                if got.of(it, "quern_disk_cache_misses_total") and got.value(it, "quern_disk_cache_misses_total") > 0:
                    break
                assert time.monotonic() < deadline, json.dumps(it.stats().get("disk_cache"))
                time.sleep(0.1)
    assert set(got.samples) == set(quern.metrics.METRICS)
    assert got.value(it, "quern_disk_cache_capacity_bytes") == 1 << 20
    assert got.value(it, "quern_disk_cache_fetched_bytes_total") > 0
    assert got.value(it, "quern_workers") == 2


@needs_prometheus
def test_a_real_prometheus_scrapes_the_iterators():
    port = free_port()
    server, thread = quern.metrics.start_http_server(port, "127.0.0.1")
    try:
        with _pipe().map_batch(slow).iterator(process_index=1, process_count=2) as it:
            for _ in range(7):
                next(it)
            serial = str(quern.metrics.collector().serial(it))
            with prometheus([f"127.0.0.1:{port}"], scrape_interval="1s") as prom:
                (steps,) = prom.wait_for(f'quern_steps_total{{iterator="{serial}",process="{PID}"}}')
                assert float(steps["value"][1]) == 7
                labels = steps["metric"]
                assert labels["host"] == "1" and labels["job"] == "quern" and labels["instance"] == f"127.0.0.1:{port}"
                (wait,) = prom.query(f'quern_data_wait_seconds_total{{iterator="{serial}",process="{PID}"}}')
                assert float(wait["value"][1]) > 0
                (current,) = prom.query(f'quern_health{{iterator="{serial}",process="{PID}"}} == 1')
                assert current["metric"]["state"] in {"healthy", "warning", "alarm"}
                (stage,) = prom.query(f'quern_stage_seconds_total{{iterator="{serial}",stage="read"}}')
                assert float(stage["value"][1]) > 0
                names = {r["metric"]["__name__"] for r in prom.query('{__name__=~"quern_.+"}')}
                assert names <= set(quern.metrics.METRICS) and "quern_bubble_ratio" in names
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
