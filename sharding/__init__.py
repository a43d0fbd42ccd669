"""Host slices of global batches (JAX global arrays and device prefetch build on this).

Host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)`` of every global batch.
"""

from ..pipeline.index import host_rows
from .global_arrays import GlobalIterator, global_iterator, process_rows

__all__ = ["host_rows", "global_iterator", "GlobalIterator", "process_rows"]
