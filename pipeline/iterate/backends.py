"""Which :class:`~quern.pipeline.iterate.feed.Feed` computes an iterator's steps: :func:`open_feed`.

Threads of this process (``num_workers=0``), worker processes
(``num_workers > 0``) or a :class:`~quern.RayService`'s actors (``service=``);
:func:`check_backend` refuses the combinations that mean nothing. A batch is the
same bytes whichever computes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ..order.index import check_int
from .auto import AUTO, AutoFeed, candidates, worker_pool
from .feed import Feed, FeedSettings, Stopped, worker_figures
from .service import RayService, ServiceFeed
from .threads import ThreadFeed

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["auto_or_int", "check_backend", "open_feed"]


def auto_or_int(value: object, name: str, minimum: int) -> int | Literal["auto"]:
    """``value`` checked: ``"auto"``, or an integer of at least ``minimum``.

    Example:
        >>> auto_or_int("auto", "num_workers", 0), auto_or_int(2, "num_workers", 0)
        ('auto', 2)
    """
    if isinstance(value, str):
        if value == AUTO:
            return AUTO
        raise ValueError(f"{name} must be an integer >= {minimum} or 'auto', got {value!r}")
    return check_int(value, name, minimum)


def check_backend(
    num_workers: int | Literal["auto"], num_threads: int | Literal["auto"], service: object
) -> RayService | None:
    """The iterator's backend options, checked together.

    Args:
        num_workers: worker processes (0: threads), checked already.
        num_threads: prefetch threads, checked already.
        service: ``None`` or a :class:`~quern.RayService`.

    Returns:
        The service, or ``None``.

    Raises:
        ValueError: ``num_threads`` other than 1 with workers, or a service with workers.
        TypeError: ``service`` is not a :class:`~quern.RayService`.
    """
    if service is not None and AUTO in (num_workers, num_threads):
        raise ValueError("num_workers='auto' and num_threads='auto' tune this process's feed: not with service=")
    if num_workers and num_workers != AUTO and num_threads != 1:
        raise ValueError(
            f"num_threads={num_threads} applies to num_workers=0 only; with num_workers={num_workers} "
            "each worker process computes its steps on one thread"
        )
    if service is not None and not isinstance(service, RayService):
        raise TypeError(f"service must be a quern.RayService or None, got {type(service).__name__}")
    if service is not None and num_workers:
        raise ValueError(
            f"service= and num_workers={num_workers} cannot be used together: the service's actors compute "
            "the steps (num_workers=0)"
        )
    return service


def open_feed(
    pipe: Pipeline,
    settings: FeedSettings,
    *,
    num_workers: int | Literal["auto"],
    num_threads: int | Literal["auto"],
    service: RayService | None,
    watch: bool,
) -> Feed:
    """The feed that computes ``pipe``'s steps from ``settings.start`` on, started.

    Args:
        pipe: the pipeline.
        settings: what every feed is told.
        num_workers: worker processes (0: threads in this process, or the service's actors;
            ``"auto"``: an :class:`~quern.pipeline.iterate.auto.AutoFeed` that measures and chooses).
        num_threads: prefetch threads (``num_workers=0`` or ``"auto"`` without a service; ``"auto"``:
            measured and chosen too).
        service: compute the steps on this service's actors (``None``: here).
        watch: threads run each chunk on a thread of their own, which ``step_timeout``
            watches (and a live stream's close abandons).

    Returns:
        A :class:`~quern.pipeline.iterate.threads.ThreadFeed`, a
        :class:`~quern.pipeline.iterate.workers.WorkerPool` or a
        :class:`~quern.pipeline.iterate.service.ServiceFeed`; with workers or a service
        and no step left (``start`` at the stream's end), a
        :class:`~quern.pipeline.iterate.feed.Stopped` feed: nothing is started.

    Raises:
        TypeError: the pipeline cannot be pickled (workers, service).
        ServiceError: the service is closed, holds another pipeline, or its actors disagree
            with this process.
    """
    over = settings.end is not None and settings.start >= settings.end
    if service is not None:
        if over:
            return Stopped({"workers": 0, "stages": {}, "stage_steps": 0}, local=False)
        return ServiceFeed(
            service,
            pipe,
            process_index=settings.process_index,
            process_count=settings.process_count,
            prefetch=settings.prefetch,
            read_ahead=settings.read_ahead,
            start=settings.start,
            end=settings.end,
            copy=settings.copy,
            timed=settings.timed,
            digests=settings.digests,
        )
    if AUTO in (num_workers, num_threads):
        tries = candidates(num_workers, num_threads)
        if over or settings.live:  # nothing to measure; a live stream's steps wait for their entries
            tries = tries[:1]
        return AutoFeed(pipe, settings, tries, watch=watch)
    assert not isinstance(num_workers, str) and not isinstance(num_threads, str)
    if num_workers:
        if over:
            return Stopped(worker_figures(num_workers, [0] * num_workers, 0), local=True)
        return worker_pool(pipe, num_workers, settings)
    return ThreadFeed(pipe, settings, num_threads=num_threads, watch=watch)
