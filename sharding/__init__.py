"""Host slices of global batches (JAX global arrays and device prefetch build on this).

Host ``h`` of ``H`` owns rows ``[h*B/H, (h+1)*B/H)`` of every global batch.
"""

from ..pipeline.index import host_rows

__all__ = ["host_rows"]
