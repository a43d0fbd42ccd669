"""The preprocessing service: ``pipe.iterator(service=quern.RayService(...))`` computes the steps on Ray actors.

:mod:`.ray_service` keeps the actors (:mod:`.actor`) on a Ray cluster;
:mod:`.feed` is one iterator's side: the units of its window asked for, hedged,
recomputed after a death and put in order. A batch is the same bytes whichever
actor computed it. The design: ``docs/design/service.md``.
"""

from ...core.errors import ServiceError
from .ray_feed import ServiceFeed
from .ray_service import RayService

__all__ = ["RayService", "ServiceError", "ServiceFeed"]
