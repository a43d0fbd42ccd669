"""The preprocessing service on Ray: actors that compute any (step, host slice) unit of a pipeline.

:class:`RayService` connects to a Ray cluster (or starts a local one) and keeps
``num_actors`` actors (:class:`~quern.pipeline.iterate.service.actor.UnitActor`), each
of which loads the pipeline once. An iterator made with
``pipe.iterator(service=svc)`` asks them for the units of its lookahead
window (:mod:`quern.pipeline.iterate.service.ray_feed`); Ray schedules the actors, quern
only orders what comes back. A batch does not depend on which actor computed
it, so a dead actor is replaced and its units are computed again, and a slow
one is hedged.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from ...core.errors import ServiceError
from .actor import Expect, Hello, UnitActor, expect_of

__all__ = ["RayService", "START_TIMEOUT", "GONE_AFTER"]

START_TIMEOUT = 120.0
"""Seconds an actor may take to start and load the pipeline before the service gives up on it."""
GONE_AFTER = 10.0
"""The default of ``RayService(gone_after=)``: seconds the cluster's head may refuse connections before the
service says the cluster is gone."""


def _check_fit(cluster: str, cpus: float, num_actors: int | None, num_cpus_per_actor: float, fix: str) -> int:
    """The actors to run on a cluster of ``cpus`` CPUs: ``num_actors``, or as many as fit (at least 1).

    Raises:
        ServiceError: they need more CPUs than the cluster has (the message names ``cluster`` and
            says ``fix``).
    """
    wanted = num_actors if num_actors is not None else max(int(cpus // num_cpus_per_actor), 1)
    if wanted * num_cpus_per_actor > cpus:
        asked = f"num_actors={wanted}" if num_actors is not None else "num_actors=None (one at least)"
        fewer = "fewer actors" if num_actors is not None and num_actors > 1 else "fewer CPUs per actor"
        raise ServiceError(
            f"{cluster} has {cpus:g} CPU{'' if cpus == 1 else 's'}: {asked} x num_cpus_per_actor="
            f"{num_cpus_per_actor:g} needs {wanted * num_cpus_per_actor:g} (ask for {fewer}, or {fix})"
        )
    return wanted


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ServiceError("RayService needs Ray: pip install 'quern[ray]'") from e
    return ray


class RayService:
    """Ray actors that compute the steps of a pipeline for any host slice, for ``pipe.iterator(service=svc)``.

    The actors start when the first iterator uses the service, each loading the
    pipeline once and checking that its quern version, index-format version and
    the pipeline's fingerprint match this process's. Iterators of several hosts
    (``process_index`` 0..H-1) may share one service; they must use the same
    pipeline. A batch is bit-identical to ``pipe.batch_at`` whatever actor, node
    or attempt computed it.

    Args:
        address: the Ray cluster (``HOST:PORT`` of its head, or ``"auto"``); ``None``
            starts a local cluster (as ``quern prepare --ray`` does) that :meth:`close`
            stops. Ignored when Ray is already initialised in this process.
        num_actors: actors to keep running; ``None``: the cluster's CPUs over
            ``num_cpus_per_actor``.
        num_cpus_per_actor: CPUs Ray reserves for each actor.
        num_cpus: the CPUs of a local cluster (``address=None``; default: this machine's).
        object_store_memory: bytes of a local cluster's object store (default 512 MiB).
        hedge_after: a unit not back after this many times the recent units' median
            time is also asked of another actor (``None``: never hedge).
        hedge_min_s: ...but never before this many seconds.
        gone_after: seconds the cluster's head may refuse connections before the service says the
            cluster is gone (:data:`GONE_AFTER`, 10, by default), from 1 to 45: Ray itself ends a
            driver whose head has been gone for about 60 s, and the service looks at the head only
            every 2 s (then 2 s at most for a connection), so it must give up well before.

    Raises:
        ServiceError: Ray is not installed, the cluster cannot be reached (its address
            is named), or it has fewer CPUs than the actors need.
        ValueError: an argument is out of range.

    Attributes:
        address: the ``address`` given, or ``"the local cluster at HOST:PORT"`` for a local one.
        cluster: the cluster as messages name it: ``the Ray cluster at ADDRESS`` or ``the local
            cluster at HOST:PORT`` (``the new local cluster`` until it has started).

    Example:
        >>> svc = quern.RayService(num_actors=2)  # doctest: +SKIP
        >>> with pipe.iterator(service=svc) as it:  # doctest: +SKIP
        ...     batch = next(it)
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_actors: int | None = None,
        num_cpus_per_actor: float = 1,
        num_cpus: int | None = None,
        object_store_memory: int | None = None,
        hedge_after: float | None = 3.0,
        hedge_min_s: float = 1.0,
        gone_after: float = GONE_AFTER,
    ) -> None:
        if num_actors is not None and (
            isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1
        ):
            raise ValueError(f"num_actors must be an integer >= 1 or None, got {num_actors!r}")
        if not isinstance(num_cpus_per_actor, int | float) or num_cpus_per_actor <= 0:
            raise ValueError(f"num_cpus_per_actor must be a number > 0, got {num_cpus_per_actor!r}")
        if hedge_after is not None and (not isinstance(hedge_after, int | float) or hedge_after < 1):
            raise ValueError(f"hedge_after must be a number >= 1 or None, got {hedge_after!r}")
        if not isinstance(hedge_min_s, int | float) or hedge_min_s < 0:
            raise ValueError(f"hedge_min_s must be a number >= 0, got {hedge_min_s!r}")
        if isinstance(gone_after, bool) or not isinstance(gone_after, int | float) or not 1 <= gone_after <= 45:
            raise ValueError(f"gone_after must be a number of seconds from 1 to 45, got {gone_after!r}")
        ray = _ray()
        self.hedge_after, self.hedge_min_s = hedge_after, float(hedge_min_s)
        self.gone_after = float(gone_after)
        self.num_cpus_per_actor = num_cpus_per_actor
        self._lock = threading.RLock()
        self._closed = False
        self._started = False  # this service initialised Ray (close() shuts it down)
        self.address = address or "a new local cluster"
        self.cluster = f"the Ray cluster at {address}" if address else "the new local cluster"
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if address is None:
                local_cpus = num_cpus or os.cpu_count() or 1  # too few for the actors: refused before it starts
                _check_fit(self.cluster, local_cpus, num_actors, num_cpus_per_actor, "a larger num_cpus")
                kw.update(
                    address="local",
                    _node_ip_address="127.0.0.1",  # the node's address (Ray may still name the machine's own)
                    num_cpus=local_cpus,
                    object_store_memory=object_store_memory or 512 << 20,
                )
            else:
                kw.update(address=address)
                _check_reachable(address)
            try:
                ray.init(**kw)
            except Exception as e:
                raise ServiceError(f"cannot connect to {self.cluster}: {type(e).__name__}: {e}") from e
            self._started = True
        try:
            self.gcs_address = str(ray.get_runtime_context().gcs_address)
            if address is None:
                self.address = self.cluster = f"the local cluster at {self.gcs_address}"
            cpus = float(ray.cluster_resources().get("CPU", 0))
            self.num_actors = _check_fit(self.cluster, cpus, num_actors, num_cpus_per_actor, "add nodes")
        except BaseException:
            self._shutdown()
            raise
        self._actor_class = ray.remote(num_cpus=num_cpus_per_actor, max_restarts=0, max_task_retries=0)(UnitActor)
        self._actors: list[Any] = []  # handles, by slot
        self._hello: list[Hello | None] = []  # each slot's answer, once it came
        self._pending: dict[int, Any] = {}  # slot -> ObjectRef of its hello() not yet seen
        self._blob_ref: Any = None
        self._expect: Expect | None = None
        self._pipe_key: str | None = None  # what pipeline the actors hold
        self.replaced = 0  # actors replaced after dying

    # ------------------------------------------------------------------ actors

    def attach(self, pipe: Any) -> None:
        """Start the actors for ``pipe`` (once); another iterator of the same pipeline shares them.

        Args:
            pipe: the pipeline (picklable with cloudpickle).

        Raises:
            ServiceError: the service is closed, or holds another pipeline.
            TypeError: the pipeline cannot be pickled (the message names the error).
        """
        import cloudpickle

        ray = _ray()
        with self._lock:
            self._check_open()
            expect = expect_of(pipe)
            key = expect.fingerprint or f"object {id(pipe)}"
            if self._pipe_key is not None:
                if key != self._pipe_key:
                    raise ServiceError(
                        f"this service's actors hold another pipeline (fingerprint {self._pipe_key}, this one "
                        f"{key}): make a RayService per pipeline"
                    )
                return
            try:
                blob = cloudpickle.dumps(pipe)
            except Exception as e:
                raise TypeError(
                    f"the pipeline cannot be sent to the service's actors: {_unpicklable(pipe)} cannot be pickled "
                    f"({type(e).__name__}: {e}); make it picklable (a module-level function, or a class with "
                    "__getstate__)"
                ) from e
            self._blob_ref = ray.put(blob)
            self._expect, self._pipe_key = expect, key
            for slot in range(self.num_actors):
                self._actors.append(None)
                self._hello.append(None)
                self._start(slot)

    def _start(self, slot: int) -> None:
        actor = self._actor_class.remote(self._blob_ref, self._expect)
        self._actors[slot] = actor
        self._hello[slot] = None
        self._pending[slot] = actor.hello.remote()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until every actor has loaded the pipeline and agreed with the trainer.

        Args:
            timeout: seconds to wait at most.

        Raises:
            ServiceError: an actor disagrees (versions, fingerprint) or cannot load the
                pipeline, cannot be placed on the cluster in ``timeout`` seconds, or the
                cluster is gone.
        """
        ray = _ray()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._check_open()
                pending = dict(self._pending)
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceError(
                    f"{len(pending)} of {self.num_actors} actors did not start in {timeout:g} s on "
                    f"{self.cluster} (not enough free CPUs? each needs {self.num_cpus_per_actor:g})"
                )
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=min(left, 2.0))
            if not ready:
                self.check_alive()
            for ref in ready:
                slot = next(s for s, r in pending.items() if r is ref)
                self.hello_of(slot, ref)

    @property
    def starting(self) -> int:
        """Actors asked for whose hello has not come yet."""
        return len(self._pending)

    def poll_hellos(self) -> None:
        """Take the hellos that have come, without waiting (actors started again become live).

        Raises:
            ServiceError: an actor disagrees with the trainer.
        """
        ray = _ray()
        with self._lock:
            pending = dict(self._pending)
        if pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
            for slot, ref in pending.items():
                if any(r is ref for r in ready):
                    self.hello_of(slot, ref)

    def hello_of(self, slot: int, ref: Any) -> None:
        """Take actor ``slot``'s answer ``ref`` (its hello); a dead actor is started again.

        Raises:
            ServiceError: the actor disagrees with the trainer.
        """
        ray = _ray()
        try:
            hello: Hello = ray.get(ref)
        except ray.exceptions.RayActorError:
            with self._lock:
                if self._pending.get(slot) is ref:
                    self.replace(slot)
            return
        with self._lock:
            if self._pending.get(slot) is not ref:
                return
            del self._pending[slot]
            self._hello[slot] = hello
        if hello.problem is not None:
            raise ServiceError(f"actor {slot} (pid {hello.pid}) on {self.cluster}: {hello.problem}")

    def replace(self, slot: int, actor: Any = None) -> None:
        """Kill actor ``slot`` (if it is still ``actor``) and start another in its place.

        Args:
            slot: the actor's slot.
            actor: the handle found dead (``None``: whatever the slot holds).
        """
        ray = _ray()
        with self._lock:
            if self._closed or (actor is not None and self._actors[slot] is not actor):
                return  # already replaced
            old = self._actors[slot]
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass
            self.replaced += 1
            self._start(slot)

    @property
    def actors(self) -> list[Any]:
        """The handles of the live actors (those that have loaded the pipeline), by slot."""
        with self._lock:
            return [a for a, h in zip(self._actors, self._hello) if h is not None]

    def actor(self, slot: int) -> tuple[Any, Hello | None]:
        """The handle in ``slot`` and its hello (``None`` until it has loaded the pipeline)."""
        with self._lock:
            return self._actors[slot], self._hello[slot]

    # ------------------------------------------------------------------ the cluster

    def check_alive(self) -> None:
        """Raise unless the cluster's head answers on its address.

        Raises:
            ServiceError: the service is closed, or the head has refused connections for
                ``gone_after`` seconds (the address is named). Ray is shut down in this
                process first, so that Ray does not end it later.
        """
        self._check_open()
        host, _, port = self.gcs_address.rpartition(":")
        deadline = time.monotonic() + self.gone_after
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=2.0):
                    return
            except OSError as e:
                if time.monotonic() >= deadline:
                    self._shutdown(force=True)
                    raise ServiceError(
                        f"{self.cluster} is gone: its head {self.gcs_address} has refused "
                        f"connections for {self.gone_after:g} s ({e}); this process is disconnected from Ray"
                    ) from None
            time.sleep(0.5)

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceError("the RayService is closed (it was closed while an iterator used it?)")

    def close(self) -> None:
        """Kill the actors (and stop the local cluster this service started). Idempotent.

        An iterator still using the service raises :class:`~quern.ServiceError` at its next step.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            actors, self._actors = self._actors, []
            self._pending.clear()
        try:
            ray = _ray()
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
        finally:
            self._shutdown()

    def _shutdown(self, force: bool = False) -> None:
        """Shut Ray down in this process if this service initialised it (``force``: in any case)."""
        self._closed = True
        if self._started or force:
            self._started = False
            try:
                _ray().shutdown()
            except Exception:
                pass

    def __enter__(self) -> RayService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.actors)} of {self.num_actors} actors live"
        return f"RayService({self.address}, {state})"


def _check_reachable(address: str) -> None:
    """Raise unless ``HOST:PORT`` accepts connections (Ray itself would retry for a minute or more).

    Raises:
        ServiceError: the address is malformed or refuses connections.
    """
    if address == "auto" or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ServiceError(f"the Ray address {address!r} is not HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=5.0):
            return
    except OSError as e:
        raise ServiceError(f"cannot reach the Ray cluster at {address}: {e}") from None


def _unpicklable(pipe: Any) -> str:
    """Which part of ``pipe`` cannot be pickled: the first stage that fails (``map[1] name``), or its stream."""
    import cloudpickle

    ops = [(op.label(k), op) for k, op in enumerate(getattr(pipe, "record_ops", ()))]
    ops += [(op.label(k), op) for k, op in enumerate(getattr(pipe, "batch_ops", ()))]
    for label, op in ops:
        try:
            cloudpickle.dumps(op)
        except Exception:
            return f"stage {label}"
    return "its source or stream"
