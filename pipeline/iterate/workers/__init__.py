"""Worker processes for ``pipe.iterator(num_workers=W)``: steps computed in other processes.

The parent's side: :class:`WorkerPool` (:mod:`.pool`), the processes it keeps
running (:mod:`.supervise`, :mod:`.handles`), task sizes (:mod:`.sizing`) and
Ctrl-C deferral (:mod:`.signals`). The processes' programs: :mod:`.forkserver` and
:mod:`.worker`; between them :mod:`.messages` over :mod:`.shm`. A batch is the
same whichever process computes it. The design: ``docs/design/workers.md``.
"""

from ...core.errors import WorkerError
from .pool import WorkerPool
from .signals import sigint_deferred
from .sizing import MAX_TASK_STEPS, SHARED_MEMORY_BUDGET, TASK_RECORDS

__all__ = ["WorkerPool", "WorkerError", "sigint_deferred", "TASK_RECORDS", "MAX_TASK_STEPS", "SHARED_MEMORY_BUDGET"]
