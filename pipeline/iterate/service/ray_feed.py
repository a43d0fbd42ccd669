"""One iterator's side of the service: the units of its window asked for, hedged, recomputed and put in order.

A *unit* is ``count`` consecutive steps of one host slice, starting at
``start + k * count``. :class:`ServiceFeed` keeps ``prefetch`` units per actor in
flight from the step the iterator asks for on, each sent to the actor with the
fewest units in flight. Whatever comes back is the same bytes, so:

- an actor that dies (its process killed, its node stopped) is replaced and its
  units are sent to another (counted as recomputations);
- a unit not back after ``hedge_after`` times the median time of the recent
  units (at least ``hedge_min_s`` seconds) is also sent to another actor, and
  the first answer is used (counted as hedges);
- a step that raised in an actor is a :class:`~quern.StepError` with the
  actor's message (step, host slice, stage, records) and traceback; asking for
  the step again computes it again.

:class:`ServiceFeed` is the iterator's :class:`~quern.pipeline.iterate.feed.Feed`
with a service.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ... import execute
from ...core.errors import ServiceError, StepTimeoutError
from ...core.timing import HANDOVER, add, ema
from ...integrity.ledger import LedgerWriter
from ...order.index import host_rows
from ..feed import Batch, Feed, FeedStats
from .actor import UnitResult
from .ray_service import RayService, _ray

if TYPE_CHECKING:
    from ...definition.dataset import Pipeline

__all__ = ["ServiceFeed", "UNIT_RECORDS", "MAX_UNIT_STEPS", "POLL", "HEAD_EVERY"]

UNIT_RECORDS = 4096  # default unit: about this many records...
MAX_UNIT_STEPS = 16  # ...but at most this many steps
POLL = 0.5  # seconds between looks at the cluster, the hedging deadline and stop() while waiting
RECENT = 16  # units whose times set the hedging deadline
HEAD_EVERY = 2.0  # seconds between looks at the cluster's head while batches keep coming


class _Try(NamedTuple):
    ref: Any  # the ObjectRef of the UnitResult
    slot: int  # the actor's slot
    actor: Any  # its handle, when sent
    sent: float  # time.monotonic() when sent


class _Unit:
    """A unit's attempts in flight, then its result."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self.tries: list[_Try] = []
        self.result: UnitResult | None = None
        self.taken = 0  # steps of it the iterator has taken
        self.hedged = False


class ServiceFeed(Feed):
    """The batches of one host slice, computed by a :class:`RayService`'s actors, in step order.

    The :class:`~quern.pipeline.iterate.feed.Feed` of ``pipe.iterator(service=...)``.

    Args:
        service: the service (its actors are started for ``pipe`` if they are not yet).
        pipe: the pipeline.
        process_index: this host.
        process_count: the hosts.
        prefetch: units each actor has in flight.
        read_ahead: steps per unit (``None``: about :data:`UNIT_RECORDS` records, at most
            :data:`MAX_UNIT_STEPS` steps).
        start: the first step the iterator asks for (units are aligned to it).
        end: the step where the stream ends (``None``: endless).
        copy: copy each batch into writable arrays (Ray's are read-only views of its object store).
        timed: actors send each unit's stage timings.
        digests: actors compute each batch's ledger fields (:attr:`last_digests`).

    Raises:
        ServiceError: the service is closed or holds another pipeline, or an actor disagrees with the trainer.
        TypeError: the pipeline cannot be pickled.
    """

    def __init__(
        self,
        service: RayService,
        pipe: Pipeline,
        *,
        process_index: int,
        process_count: int,
        prefetch: int,
        read_ahead: int | None,
        start: int,
        end: int | None,
        copy: bool = False,
        timed: bool = True,
        digests: bool = False,
    ) -> None:
        service.attach(pipe)
        self.service, self.pipe = service, pipe
        self.process_index, self.process_count = process_index, process_count
        self.prefetch, self.start, self.end = prefetch, start, end
        self.copy, self.timed, self.digests = copy, timed, digests
        if read_ahead is None:
            lo, hi = host_rows(pipe.batch_size or 0, process_index, process_count)
            read_ahead = execute.steps_per_read(hi - lo, UNIT_RECORDS, MAX_UNIT_STEPS)
        self.read_ahead = read_ahead
        self.num_workers = service.num_actors  # the figures of stats() are per actor
        self._units: dict[int, _Unit] = {}  # first step -> unit
        self._busy: collections.Counter[int] = collections.Counter()  # slot -> units in flight
        self._arrived: dict[int, float] = {}  # id of an attempt's ref -> when it was seen done
        self._orphans: list[_Try] = []  # attempts whose unit no longer needs them (a hedge's loser): still busy
        self._times: collections.deque[float] = collections.deque(maxlen=RECENT)  # recent units' seconds
        self._unit_seconds: list[float] = []  # every unit's seconds, for stats()
        self._last_look = self._last_hello = self._last_head = time.monotonic()
        self.delivered = [0] * service.num_actors  # steps each actor slot delivered
        self.recomputations = 0  # units sent again after their actor died
        self.hedges = 0  # units also sent to a second actor
        self.last_digests = ""
        self.timings: dict[str, float] = {}
        self.timed_steps = 0
        self._load: float | None = None
        self.ahead = 0
        self._closed = False
        service.wait_ready()

    # ------------------------------------------------------------------ units

    def _first_of(self, step: int) -> int:
        return self.start + (step - self.start) // self.read_ahead * self.read_ahead

    def _send(self, unit: _Unit, avoid: Collection[int] = ()) -> bool:
        """Send ``unit`` to the live actor with the fewest units in flight (not one of ``avoid``)."""
        slots = [s for s in range(self.service.num_actors) if s not in avoid and self.service.actor(s)[1] is not None]
        if not slots:
            return False
        slot = min(slots, key=lambda s: (self._busy[s], s))
        actor, _ = self.service.actor(slot)
        steps = list(range(unit.first, unit.first + unit.count))
        ref = actor.compute.remote(steps, self.process_index, self.process_count, self.digests, self.timed)
        unit.tries.append(_Try(ref, slot, actor, time.monotonic()))
        self._busy[slot] += 1
        return True

    def _top_up(self, step: int) -> None:
        """Keep ``prefetch`` units per actor (and the adaptive window) in flight from ``step`` on."""
        if self.service.starting and time.monotonic() - self._last_hello >= 0.2:  # replacements: live yet?
            self._last_hello = time.monotonic()
            self.service.poll_hellos()
        if self._orphans:  # an actor is busy until its abandoned attempts end: a straggler gets fewer units
            ready, _ = _ray().wait([t.ref for t in self._orphans], num_returns=len(self._orphans), timeout=0)
            done = {id(r) for r in ready}
            for t in [t for t in self._orphans if id(t.ref) in done]:
                self._orphans.remove(t)
                self._busy[t.slot] -= 1
                self._arrived.pop(id(t.ref), None)
        want = max(self.prefetch * self.service.num_actors, -(-self.ahead // self.read_ahead))
        first = self._first_of(step)
        for k in range(want):
            f = first + k * self.read_ahead
            if self.end is not None and f >= self.end:
                break
            if f not in self._units:
                count = self.read_ahead if self.end is None else min(self.read_ahead, self.end - f)
                unit = _Unit(f, count)
                self._units[f] = unit
                self._send(unit)
            elif not self._units[f].tries and self._units[f].result is None:
                self._send(self._units[f])

    def _drop_try(self, unit: _Unit, t: _Try) -> None:
        unit.tries.remove(t)
        self._busy[t.slot] -= 1
        self._arrived.pop(id(t.ref), None)

    def _deadline(self) -> float | None:
        """Seconds after which a unit is hedged (``None``: not yet known, or hedging is off)."""
        k = self.service.hedge_after
        if k is None or len(self._times) < 2 or self.service.num_actors < 2:
            return None
        return max(k * statistics.median(self._times), self.service.hedge_min_s)

    def _settle(self, unit: _Unit, t: _Try) -> None:
        """Take the answer of attempt ``t``: the unit's result, or the actor found dead (sent again)."""
        ray = _ray()
        try:
            result: UnitResult = ray.get(t.ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
            self._drop_try(unit, t)
            self.service.replace(t.slot, t.actor)
            if not unit.tries and unit.result is None:
                self.recomputations += 1
                self._send(unit, avoid={t.slot}) or self._send(unit)
            return
        except ray.exceptions.RayTaskError as e:  # the actor's compute() itself failed (not a step: those come back)
            cause = getattr(e, "cause", None) or e
            raise ServiceError(
                f"actor {t.slot} on {self.service.cluster} failed on steps "
                f"{unit.first}..{unit.first + unit.count - 1} (host {self.process_index} of {self.process_count}): "
                f"{type(cause).__name__}: {cause}"
            ) from e
        self._drop_try(unit, t)
        if unit.result is not None:
            return  # a hedge that came second
        unit.result = result
        seconds = self._arrived.pop(id(t.ref), time.monotonic()) - t.sent
        self._times.append(seconds)
        self._unit_seconds.append(seconds)
        self.delivered[t.slot] += sum(b is not None for b in result.batches)
        if result.timings:
            add(self.timings, result.timings)
            self.timed_steps += unit.count
        self._load = ema(self._load, result.seconds / unit.count / self.service.num_actors)

    def _note_arrivals(self) -> None:
        """Note when the attempts in flight came back (once per unit: their times set the hedging deadline)."""
        refs = [
            t.ref for u in self._units.values() if u.result is None for t in u.tries if id(t.ref) not in self._arrived
        ]
        if refs:
            ready, _ = _ray().wait(refs, num_returns=len(refs), timeout=0)
            now = time.monotonic()
            for r in ready:
                self._arrived[id(r)] = now

    def _wait(self, unit: _Unit, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for an attempt of ``unit``; take what came."""
        ray = _ray()
        if not unit.tries:
            if not self._send(unit):  # no live actor: wait for the replacements
                self.service.wait_ready()
                return
        ready, _ = ray.wait([t.ref for t in unit.tries], num_returns=1, timeout=timeout)
        for ref in ready:
            for t in list(unit.tries):
                if t.ref is ref:
                    self._settle(unit, t)
        if not ready and time.monotonic() - self._last_look >= 2.0:
            self._last_look = time.monotonic()
            self.service.check_alive()  # raises when the cluster is gone
            self.service.poll_hellos()

    def _check_head(self) -> None:
        """Every :data:`HEAD_EVERY` seconds, whatever comes back, see that the cluster's head answers.

        Actors on nodes that outlive the head keep answering, but Ray ends this process
        about a minute after the head is gone: :meth:`RayService.check_alive` raises first.
        """
        now = time.monotonic()
        if now - self._last_head >= HEAD_EVERY:
            self._last_head = now
            self.service.check_alive()

    # ------------------------------------------------------------------ the iterator's side

    def get(self, step: int, *, stop: Callable[[], bool] | None = None, timeout: float | None = None) -> Batch:
        """The batch of ``step``, waiting for it; steps must be asked for in order.

        Args:
            step: the step.
            stop: called while waiting: when it returns true, give up.
            timeout: seconds to wait at most (``None``: no deadline).

        Returns:
            The batch (read-only arrays in Ray's object store; writable copies with ``copy=True``).

        Raises:
            StepError: the step raised in its actor (asking again computes it again).
            StepTimeoutError: ``timeout`` passed.
            ServiceError: the service was closed, or its cluster is gone.
            RuntimeError: ``stop()`` became true while waiting.
        """
        if self._closed:
            raise ServiceError("this iterator's service feed is closed")
        self.service._check_open()
        began = time.monotonic()
        first = self._first_of(step)
        self._check_head()
        if step == first:
            self._note_arrivals()
        while True:
            self._top_up(step)
            unit = self._units[first]
            if unit.result is not None:
                t0 = time.perf_counter()
                batch = self._take(unit, step)
                if self.timed:
                    self.timings[HANDOVER] = self.timings.get(HANDOVER, 0.0) + time.perf_counter() - t0
                return batch
            if stop is not None and stop():
                raise RuntimeError("iterator closed while next() was waiting for its batch")
            self.service._check_open()
            wait = POLL
            deadline = self._deadline()
            if deadline is not None and not unit.hedged and unit.tries:
                late = time.monotonic() - unit.tries[0].sent - deadline
                if late >= 0:
                    unit.hedged = True
                    if self._send(unit, avoid={t.slot for t in unit.tries}):
                        self.hedges += 1
                else:
                    wait = min(wait, -late)
            if timeout is not None:
                left = began + timeout - time.monotonic()
                if left <= 0:
                    on = ", ".join(f"actor {t.slot}" for t in unit.tries) or "no actor"
                    raise StepTimeoutError(
                        f"step {step} (host {self.process_index} of {self.process_count}) did not come in "
                        f"step_timeout={timeout:g} s from the service on {self.service.cluster} ({on} computing it); "
                        "asking again waits for it again"
                    )
                wait = min(wait, left)
            self._wait(unit, max(wait, 0.001))

    def _take(self, unit: _Unit, step: int) -> Batch:
        result = unit.result
        assert result is not None
        i = step - unit.first
        report = result.errors[i]
        if report is not None:
            unit.result = None  # asking again computes the unit again
            unit.hedged = False
            raise report.error(f"service actor (pid {result.pid}) on {self.service.cluster},")
        batch = result.batches[i]
        result.batches[i] = None  # the iterator holds it now
        self.last_digests = result.fields[i]
        unit.taken = max(unit.taken, i + 1)
        if unit.taken >= unit.count:
            del self._units[unit.first]
            self._orphans += unit.tries  # a hedge still running: its actor stays busy until it ends
            unit.tries = []
        if self.copy:
            from ...core.tree import map_leaves

            batch = map_leaves(lambda x: np.array(x) if isinstance(x, np.ndarray) else x, batch)
        return batch

    def in_flight(self) -> tuple[int, int]:
        """(steps come back and not taken, steps asked for and not back)."""
        ready = sum(u.count - u.taken for u in self._units.values() if u.result is not None)
        flying = sum(u.count for u in self._units.values() if u.result is None)
        return ready, flying

    def in_flight_limit(self) -> int:
        """Steps per actor in flight at most."""
        return max(self.prefetch * self.read_ahead, -(-self.ahead // self.service.num_actors))

    @property
    def load(self) -> float | None:
        """The actors' seconds per batch over their number (a moving average; ``None``: none yet)."""
        return self._load

    @property
    def local(self) -> bool:
        """Whether the steps read here, which they do not (the actors read on their own nodes)."""
        return False

    @property
    def pids(self) -> list[int]:
        """An empty list, the actors not being this machine's processes."""
        return []

    @property
    def cache_counts(self) -> Mapping[str, int]:
        """An empty mapping, the actors' disk caches being theirs."""
        return {}

    def add_to_ledger(self, ledger: LedgerWriter, step: int, batch: Batch) -> None:
        """Give ``ledger`` the fields the actor computed for the batch :meth:`get` returned last.

        Args:
            ledger: the iterator's ledger.
            step: the step.
            batch: its batch (not hashed again).
        """
        ledger.add(step, self.last_digests)

    def stats(self) -> FeedStats:
        """The feed's figures: ``workers`` (0), ``service`` (:meth:`service_stats`), ``stages``, ``stage_steps``, ``host_prefetch``."""
        if self._closed:
            ready = flying = depth = 0
        else:
            ready, flying = self.in_flight()
            depth = self.num_workers * self.in_flight_limit()
        return {
            "workers": 0,
            "service": self.service_stats(),
            "stages": dict(self.timings),
            "stage_steps": self.timed_steps,
            "host_prefetch": {"ready": ready, "in_flight": flying, "depth": depth},
        }

    def service_stats(self) -> dict[str, object]:
        """The service's figures for ``it.stats()["service"]``."""
        times = sorted(self._unit_seconds)
        ready, flying = self.in_flight()
        return {
            "address": self.service.address,
            "actors": len(self.service.actors),
            "num_actors": self.service.num_actors,
            "units_in_flight": sum(1 for u in self._units.values() if u.result is None),
            "steps_ready": ready,
            "steps_in_flight": flying,
            "steps_per_unit": self.read_ahead,
            "recomputations": self.recomputations,
            "hedges": self.hedges,
            "actors_replaced": self.service.replaced,
            "delivered_by_actor": list(self.delivered),
            "units": len(times),
            "recent_unit_s": list(self._unit_seconds[-RECENT:]),
            "unit_s": {
                "median": statistics.median(times) if times else None,
                "p90": times[int(0.9 * (len(times) - 1))] if times else None,
                "max": times[-1] if times else None,
            },
        }

    @property
    def restarts(self) -> int:
        """Actors replaced after dying (the service's, shared by its iterators)."""
        return self.service.replaced

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every actor has loaded the pipeline."""
        self.service.wait_ready(timeout if timeout is not None else 1e9)
        return True

    def wake(self) -> None:
        """A waiting :meth:`get` looks at ``stop`` within :data:`POLL` seconds anyway."""

    def close(self) -> None:
        """Drop the units in flight (their actors finish them; nothing is cancelled). Idempotent."""
        self._closed = True
        self._units.clear()
        self._busy.clear()
        self._orphans.clear()
        self._arrived.clear()

    def forget(self) -> None:
        """In a forked process: drop this copy."""
        self.close()
