"""quern where people already train: PyTorch (:mod:`quern.interop.torch`) and grain (:mod:`quern.interop.grain`).

The adapters live here, not at the package root, because the repository root is the
package ``quern``: a root ``torch.py`` or ``grain.py`` would shadow the real libraries
for anyone running Python in the checkout. Neither library is imported until its
adapter is (``pip install 'quern[torch]'``; grain is a dependency of the benchmarks and
tests, ``pip install grain``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_pipeline"]


def check_pipeline(pipe: Any, who: str, process_index: int, process_count: int) -> None:
    """Refuse what an adapter cannot give: no ``batch()``, device stages, host slices the batches do not split into.

    Device stages (``map_device``) run on JAX's global arrays (:mod:`quern.sharding`); the adapters yield
    host batches, which would silently lack them.

    Raises:
        ValueError: naming ``who`` and what is wrong.
    """
    from ..pipeline.core.ops import DEVICE_KINDS
    from ..pipeline.execute import check_hosts
    from ..pipeline.order.index import host_rows

    if pipe.batch_size is None:
        raise ValueError(f"{who} needs a pipeline with batch(): a step is a batch")
    device = [op.label(k) for k, op in enumerate(pipe.batch_ops) if op.kind in DEVICE_KINDS]
    if device:
        raise ValueError(
            f"{who} yields host batches, and the pipeline has device stages ({', '.join(device)}) that run only on "
            "JAX's global arrays (quern.sharding.global_iterator): leave them out, or do that work in the training step"
        )
    host_rows(pipe.batch_size, process_index, process_count)
    check_hosts(pipe, process_count)
