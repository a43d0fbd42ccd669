"""Host slices of global batches, JAX global arrays with device prefetch, checkpoints.

Host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)`` of every global batch (or a
token-balanced set of ``B/H`` rows, see ``Pipeline.balance_hosts``).
``global_iterator`` assembles the hosts' rows into global ``jax.Array`` batches and
runs the pipeline's device stages on them (``global_batch_at`` for any one step);
``quern.sharding.checkpoint`` saves the iterator state with orbax.
"""

from ..pipeline.order.index import host_rows
from .global_arrays import GlobalIterator, global_batch_at, global_iterator, host_slice, process_rows

__all__ = ["host_rows", "host_slice", "global_iterator", "global_batch_at", "GlobalIterator", "process_rows"]
