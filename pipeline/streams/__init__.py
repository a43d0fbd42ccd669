"""The kinds of stream a pipeline holds, one module each, behind one protocol (:class:`Stream`).

* :mod:`.source`: the records of one source (:class:`SourceStream`), or those a
  filter keeps (:class:`FilteredStream`);
* :mod:`.mixture`: named component pipelines mixed by a schedule of weights (:class:`MixtureStream`);
* :mod:`.packed`: records packed into rows of ``seq_len`` tokens (:class:`PackedStream`);
* :mod:`.bucketed`: steps from buckets of record lengths (:class:`BucketedStream`);
* :mod:`.live`: the entries of a log that grows, in log order (:class:`LiveStream`);
* :mod:`.edited`: a stream with edits that keep the past (:class:`EditedStream`, a wrapper
  on :mod:`.forwarding`'s base), and :mod:`.excluded`: a source stream skipping excluded
  records (:class:`ExcludedStream`).

A new kind of stream is one new module with a subclass of :class:`Stream` that implements
its core (:class:`SegmentStream` when its rows are records of its leaves), and the
capabilities of :mod:`.capabilities` it has.
"""

from .bucketed import BucketedStream
from .edited import EditedStream
from .excluded import ExcludedStream
from .forwarding import ForwardingStream
from .live import LiveStream
from .mixture import MixtureStream
from .packed import PackedStream
from .protocol import Stream
from .segments import SegmentStream
from .source import FilteredStream, SourceStream

__all__ = [
    "Stream",
    "ForwardingStream",
    "SegmentStream",
    "SourceStream",
    "FilteredStream",
    "MixtureStream",
    "PackedStream",
    "BucketedStream",
    "EditedStream",
    "ExcludedStream",
    "LiveStream",
]
