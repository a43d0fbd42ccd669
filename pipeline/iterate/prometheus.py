"""Prometheus metrics of this process's iterators (``pip install 'quern[metrics]'``).

Once :func:`start_http_server` has run, every iterator of the process (each
``pipe.iterator()`` and each :func:`quern.sharding.global_iterator`, made before
or after) is reported on ``http://HOST:PORT/metrics`` until it is closed::

    import quern, quern.metrics

    quern.metrics.start_http_server(9400)  # http://127.0.0.1:9400/metrics, this host only
    for batch in pipe.iterator(num_workers=8):
        train_step(batch)

Every series has the labels ``host``, ``process`` and ``iterator``. How a scrape
reads the iterators, what the labels and the figures mean, which series appear
and useful queries: ``docs/design/metrics.md``. The series:

================================================  =======  =========  ===============  ==========================================
name                                              type     unit       extra label      value
================================================  =======  =========  ===============  ==========================================
``quern_steps_total``                             counter                              batches returned by ``next()``
``quern_first_batch_seconds``                     gauge    seconds                     wait for the first batch (absent before it)
``quern_data_wait_seconds_total``                 counter  seconds                     data wait, summed from the second batch on
``quern_data_wait_last_seconds``                  gauge    seconds                     data wait of the last step
``quern_data_wait_mean_seconds``                  gauge    seconds                     mean data wait over the window
``quern_data_wait_max_seconds``                   gauge    seconds                     largest data wait over the window
``quern_step_period_last_seconds``                gauge    seconds                     step period of the last step
``quern_step_period_mean_seconds``                gauge    seconds                     mean step period over the window
``quern_bubble_ratio``                            gauge    ratio                       data wait / step period over the window
``quern_health``                                  gauge               ``state``        1 for the current state, 0 for the others
``quern_stage_seconds_total``                     counter  seconds    ``stage``        seconds per stage, threads or workers summed
``quern_stage_steps_total``                       counter                              steps computed (ahead included)
``quern_host_prefetch_batches``                   gauge    batches    ``state``        ``ready`` / ``in_flight`` batches on the host
``quern_host_prefetch_depth_batches``             gauge    batches                     the most steps kept ahead now
``quern_host_prefetch_window_batches``            gauge    batches                     adaptive prefetch window (0: fixed)
``quern_device_prefetch_batches``                 gauge    batches                     global batches handed to jax, not yet taken
``quern_device_prefetch_depth_batches``           gauge    batches                     the most kept (``device_prefetch``)
``quern_workers``                                 gauge                                worker processes (0: threads)
``quern_worker_restarts_total``                   counter                              worker processes restarted
``quern_worker_delivered_steps_total``            counter             ``worker``       steps each worker delivered
``quern_disk_cache_hits_total``                   counter                              shard reads found in the disk cache
``quern_disk_cache_misses_total``                 counter                              shard reads fetched first
``quern_disk_cache_fetched_bytes_total``          counter  bytes                       bytes fetched into the disk cache
``quern_disk_cache_evictions_total``              counter                              files evicted from the disk cache
``quern_disk_cache_retries_total``                counter                              fetches retried
``quern_disk_cache_bytes``                        gauge    bytes                       bytes the cache folders hold now
``quern_disk_cache_capacity_bytes``               gauge    bytes                       their capacity (absent when unbounded)
``quern_disk_cache_fetching_files``               gauge    files                       files being fetched ahead now
================================================  =======  =========  ===============  ==========================================
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client import generate_latest as _generate_latest
    from prometheus_client import start_http_server as _start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "quern.metrics needs prometheus-client (the extra quern[metrics]): pip install 'quern[metrics]'"
    ) from e

from ..core.timing import LIVE

__all__ = [
    "HEALTH_STATES",
    "LABELS",
    "METRICS",
    "QuernCollector",
    "collector",
    "generate_latest",
    "register",
    "start_http_server",
]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # where start_http_server listens unless told otherwise
LABELS = ("host", "process", "iterator")  # on every series
HEALTH_STATES = ("healthy", "warning", "alarm", "unknown")

# name as scraped, type, unit, extra labels, help
_SPECS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("quern_steps_total", "counter", "", (), "Batches returned by the iterator's next()."),
    ("quern_first_batch_seconds", "gauge", "seconds", (), "Seconds the caller waited for the first batch (start-up)."),
    (
        "quern_data_wait_seconds_total",
        "counter",
        "seconds",
        (),
        "Seconds the caller was blocked in next() waiting for data, from the second batch on.",
    ),
    ("quern_data_wait_last_seconds", "gauge", "seconds", (), "Data wait of the last step."),
    ("quern_data_wait_mean_seconds", "gauge", "seconds", (), "Mean data wait over the last 100 steps."),
    ("quern_data_wait_max_seconds", "gauge", "seconds", (), "Largest data wait over the last 100 steps."),
    (
        "quern_step_period_last_seconds",
        "gauge",
        "seconds",
        (),
        "Seconds between the returns of the last two next() calls.",
    ),
    ("quern_step_period_mean_seconds", "gauge", "seconds", (), "Mean step period over the last 100 steps."),
    ("quern_bubble_ratio", "gauge", "ratio", (), "Data wait / step period over the last 100 steps."),
    (
        "quern_health",
        "gauge",
        "",
        ("state",),
        "1 for the current state (healthy: data wait under 50% of the step time, alarm: above 80%, "
        "warning: between, unknown: before the second step), 0 for the others.",
    ),
    (
        "quern_stage_seconds_total",
        "counter",
        "seconds",
        ("stage",),
        "Seconds spent per pipeline stage, summed over threads or workers, for quern_stage_steps_total steps.",
    ),
    ("quern_stage_steps_total", "counter", "", (), "Steps computed so far (steps computed ahead included)."),
    (
        "quern_host_prefetch_batches",
        "gauge",
        "batches",
        ("state",),
        "Host batches computed and not yet returned (ready) and being computed (in_flight).",
    ),
    ("quern_host_prefetch_depth_batches", "gauge", "batches", (), "The most steps the host keeps ahead now."),
    (
        "quern_host_prefetch_window_batches",
        "gauge",
        "batches",
        (),
        "The adaptive host prefetch window (0 with a fixed prefetch).",
    ),
    (
        "quern_device_prefetch_batches",
        "gauge",
        "batches",
        (),
        "Global batches handed to jax (transfers started) and not yet returned.",
    ),
    (
        "quern_device_prefetch_depth_batches",
        "gauge",
        "batches",
        (),
        "The most global batches kept ahead on the devices.",
    ),
    ("quern_workers", "gauge", "", (), "Worker processes of the iterator (0: prefetch threads)."),
    ("quern_worker_restarts_total", "counter", "", (), "Worker processes restarted after dying."),
    ("quern_worker_delivered_steps_total", "counter", "", ("worker",), "Steps each worker process delivered."),
    (
        "quern_disk_cache_hits_total",
        "counter",
        "",
        (),
        "Shard reads found in the local disk cache (this process and its workers).",
    ),
    (
        "quern_disk_cache_misses_total",
        "counter",
        "",
        (),
        "Shard reads that fetched the file first (this process and its workers).",
    ),
    ("quern_disk_cache_fetched_bytes_total", "counter", "bytes", (), "Bytes fetched into the disk cache."),
    ("quern_disk_cache_evictions_total", "counter", "", (), "Files evicted from the disk cache."),
    ("quern_disk_cache_retries_total", "counter", "", (), "Fetches retried after a failure."),
    ("quern_disk_cache_bytes", "gauge", "bytes", (), "Bytes the disk cache folders hold now."),
    ("quern_disk_cache_capacity_bytes", "gauge", "bytes", (), "Capacity of the disk caches (absent when unbounded)."),
    ("quern_disk_cache_fetching_files", "gauge", "files", (), "Files being fetched ahead now."),
)

METRICS: tuple[str, ...] = tuple(spec[0] for spec in _SPECS)  # the names as scraped
_EXTRA = {spec[0]: spec[3] for spec in _SPECS}

_DISK = (  # stats()["disk_cache"] key -> metric
    ("hits", "quern_disk_cache_hits_total"),
    ("misses", "quern_disk_cache_misses_total"),
    ("bytes_fetched", "quern_disk_cache_fetched_bytes_total"),
    ("evictions", "quern_disk_cache_evictions_total"),
    ("retries", "quern_disk_cache_retries_total"),
    ("bytes_held", "quern_disk_cache_bytes"),
    ("capacity", "quern_disk_cache_capacity_bytes"),
    ("fetching", "quern_disk_cache_fetching_files"),
)

Sample = tuple[str, tuple[str, ...], float]  # metric name, extra label values, value


def _families() -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
    out: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for name, kind, unit, extra, doc in _SPECS:
        labels = [*LABELS, *extra]
        if kind == "counter":
            out[name] = CounterMetricFamily(name, doc, labels=labels, unit=unit)
        else:
            out[name] = GaugeMetricFamily(name, doc, labels=labels, unit=unit)
    return out


def samples(stats: dict[str, Any]) -> list[Sample]:
    """The samples of one iterator's ``stats()``, without the common labels.

    Args:
        stats: what the iterator's ``stats()`` returned.

    Returns:
        ``(metric name, extra label values, value)`` per sample; a figure that
        ``stats`` lacks (or holds as ``None``) gives none.

    Raises:
        KeyError: ``stats`` has no ``steps``.
    """
    out: list[Sample] = []

    def put(name: str, value: Any, *extra: str) -> None:
        if value is not None:
            out.append((name, extra, float(value)))

    put("quern_steps_total", stats["steps"])
    put("quern_first_batch_seconds", stats.get("first_batch_s"))
    wait, period = stats.get("data_wait", {}), stats.get("step_period", {})
    put("quern_data_wait_seconds_total", wait.get("total"))
    put("quern_data_wait_last_seconds", wait.get("last"))
    put("quern_data_wait_mean_seconds", wait.get("mean"))
    put("quern_data_wait_max_seconds", wait.get("max"))
    put("quern_step_period_last_seconds", period.get("last"))
    put("quern_step_period_mean_seconds", period.get("mean"))
    put("quern_bubble_ratio", stats.get("bubble_rate"))
    state = stats.get("health", "unknown")
    for s in HEALTH_STATES:
        put("quern_health", float(s == state), s)
    for stage, seconds in sorted(stats.get("stages", {}).items()):
        put("quern_stage_seconds_total", seconds, str(stage))
    put("quern_stage_steps_total", stats.get("stage_steps"))
    host = stats.get("host_prefetch")
    if host is not None:
        put("quern_host_prefetch_batches", host.get("ready"), "ready")
        put("quern_host_prefetch_batches", host.get("in_flight"), "in_flight")
        put("quern_host_prefetch_depth_batches", host.get("depth"))
        put("quern_host_prefetch_window_batches", host.get("window"))
    device = stats.get("device_prefetch")
    if device is not None:
        put("quern_device_prefetch_batches", device.get("ready"))
        put("quern_device_prefetch_depth_batches", device.get("depth"))
    workers = stats.get("workers", 0)
    put("quern_workers", workers)
    if workers:
        put("quern_worker_restarts_total", stats.get("worker_restarts", 0))
        for w, n in enumerate(stats.get("delivered_by_worker", ())):
            put("quern_worker_delivered_steps_total", n, str(w))
    disk = stats.get("disk_cache")
    if disk is not None:
        for key, name in _DISK:
            put(name, disk.get(key))
    return out


def _stats(it: Any) -> dict[str, Any]:
    """``it.stats()``, read again when a training thread changed a container while it was read.

    Such a change raises a ``RuntimeError`` such as "deque mutated during iteration".
    """
    for attempt in range(3):
        try:
            return it.stats()
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _live() -> list[Any]:
    """The iterators of :data:`~quern.pipeline.core.timing.LIVE` now.

    The set is read again when another thread adds one while it is being read.
    """
    for attempt in range(5):
        try:
            return list(LIVE)
        except RuntimeError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


class QuernCollector(Collector):
    """A ``prometheus_client`` collector of every live iterator of the process.

    At each :meth:`collect` it reads their ``stats()``. One instance,
    :func:`collector`, is enough for a process.

    Attributes:
        errors: the iterators left out of a scrape because reading them failed, counted.
    """

    def __init__(self) -> None:
        self._serials: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._warned: weakref.WeakSet[Any] = weakref.WeakSet()
        self.errors = 0

    def serial(self, it: Any) -> int:
        """The ``iterator`` label of ``it``: given when first seen, kept for its life.

        Args:
            it: an iterator of :data:`~quern.pipeline.core.timing.LIVE`.

        Returns:
            ``0`` for the first iterator this collector sees, then ``1``, ...
        """
        with self._lock:
            n = self._serials.get(it)
            if n is None:
                n = self._serials[it] = next(self._next)
            return n

    def describe(self) -> Iterator[Metric]:
        """The metric families, without samples, for the registry's name checks.

        Yields:
            One family per name of :data:`METRICS`.
        """
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        """The metric families with one set of samples per live iterator.

        An iterator whose ``stats()`` fails is left out (counted in ``errors``,
        logged once); the scrape still answers.

        Yields:
            One family per name of :data:`METRICS`.
        """
        families = _families()
        pid = str(os.getpid())
        for it in _live():
            try:
                common = (str(int(getattr(it, "process_index", 0))), pid, str(self.serial(it)))
                got = samples(_stats(it))
            except Exception:
                with self._lock:
                    self.errors += 1
                    first = it not in self._warned
                    self._warned.add(it)
                if first:
                    log.warning(
                        "quern.metrics: reading %r failed; it is left out of the scrapes it fails", it, exc_info=True
                    )
                continue
            for name, extra, value in got:
                families[name].add_metric([*common, *extra], value)
        yield from families.values()


_COLLECTOR = QuernCollector()
_registered: list[CollectorRegistry] = []  # the registries holding _COLLECTOR
_register_lock = threading.Lock()


def collector() -> QuernCollector:
    """The process's collector.

    Returns:
        The one :class:`QuernCollector` that :func:`register` registers.
    """
    return _COLLECTOR


def register(registry: CollectorRegistry | None = None) -> QuernCollector:
    """Register the collector in ``registry``, once: registering it again there does nothing.

    Args:
        registry: the registry (default: ``prometheus_client.REGISTRY``).

    Returns:
        The collector.
    """
    registry = REGISTRY if registry is None else registry
    with _register_lock:
        if not any(r is registry for r in _registered):
            registry.register(_COLLECTOR)
            _registered.append(registry)
    return _COLLECTOR


def start_http_server(
    port: int, addr: str = LOOPBACK, *, registry: CollectorRegistry | None = None
) -> tuple[Any, threading.Thread]:
    """Serve the metrics of every iterator of this process on ``http://addr:port/metrics``.

    This is ``prometheus_client.start_http_server`` on a daemon thread, with the
    collector registered in ``registry`` if it is not yet. Calling it again
    (another port, say) starts another server of the same metrics.

    Args:
        port: the TCP port; 0 takes a free one (``server.server_port``).
        addr: the address to listen on. The default, ``127.0.0.1``, serves this
            host only; give an interface's address for a Prometheus elsewhere, or
            ``"0.0.0.0"`` (``"::"``) for every interface, where the network is
            trusted (the endpoint has no authentication).
        registry: the registry to serve (default: ``prometheus_client.REGISTRY``).

    Returns:
        ``(server, thread)``; ``server.shutdown()`` stops it.
    """
    registry = REGISTRY if registry is None else registry
    register(registry)
    server, thread = _start_http_server(port, addr, registry=registry)
    return server, thread


def generate_latest(registry: CollectorRegistry | None = None) -> bytes:
    """The metrics in Prometheus' text format, as served.

    Args:
        registry: the registry whose metrics to write (default:
            ``prometheus_client.REGISTRY``); the collector is registered in it first.

    Returns:
        The text, as bytes.
    """
    registry = REGISTRY if registry is None else registry
    register(registry)
    return _generate_latest(registry)
