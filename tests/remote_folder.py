"""A small prepared folder for the object-store tests (S3, GCS), and the checks that its copy
read by URL through the disk cache reads like the local one."""

import numpy as np
import pytest

import quern
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare


def prepared_folder(tmp_path, label: bytes):
    """``(folder, documents)``: 30 documents prepared into several 8 KB shards under ``tmp_path/prep``."""
    docs = tmp_path / "docs"
    docs.mkdir()
    want = [label + b" document %d " % i * (30 + 11 * i) for i in range(30)]
    for i, d in enumerate(want):
        (docs / f"{i:02d}.txt").write_bytes(d)
    prepare(docs, tmp_path / "prep", shard_size="8KB", num_workers=0, progress=False)
    return tmp_path / "prep", want


def check_reads_like_local(url: str, folder, want, tmp_path) -> None:
    """The folder at ``url`` has the local ``folder``'s identity, records and metadata, each shard
    fetched once; a missing shard is a ``SourceError`` saying "not found"."""
    cache = ShardCache(tmp_path / "cache")
    src = quern.sources.ArrayRecordSource(url, cache=cache)
    local = quern.sources.ArrayRecordSource(str(folder))
    assert len(src) == 30 and len(src.paths) > 2 and src.identity()["files"] == local.identity()["files"]
    ids = np.random.default_rng(0).permutation(30)
    assert list(src.read_many(ids)) == [want[i] for i in ids]
    assert cache.stats["misses"] == len(src.paths)  # each shard fetched once, verified
    np.testing.assert_array_equal(src.metadata["length"], [len(d) for d in want])
    with pytest.raises(quern.SourceError, match="not found"):
        ShardCache(tmp_path / "cache2", retries=0).get(f"{url}/no-such-shard.array_record")
