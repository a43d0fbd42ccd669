"""A prepared folder read by ``gs://`` URL from a local GCS emulator (gcp-storage-emulator, on
127.0.0.1), through the local-disk cache: the GCS protocol (gcsfs, fsspec)."""

import os
import shutil
import sys

import numpy as np
import pytest
from servers import fsspec_env, process_on_port

# gcsfs reads this when imported: its default "extended" file system speaks gRPC, which the emulator does not
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import quern  # noqa: E402
from quern.pipeline.cache import ShardCache  # noqa: E402
from quern.prepare import prepare  # noqa: E402

gcsfs = pytest.importorskip("gcsfs", reason="gcsfs is not installed (pip install 'quern[gs]')")
SERVER = shutil.which("gcp-storage-emulator") or os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
if not os.path.exists(SERVER):
    pytest.skip("gcp-storage-emulator is not installed (pip install 'quern[test]')", allow_module_level=True)


@pytest.fixture
def gcs(monkeypatch, tmp_path):
    """A GCS emulator on 127.0.0.1, and the environment that points gcsfs at it (anonymous)."""

    def argv(port: int) -> list[str]:
        return [SERVER, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"]

    with process_on_port(argv, "gcp-storage-emulator", cwd=str(tmp_path)) as port:
        # gcsfs's token and project from fsspec's config from the environment
        with fsspec_env(
            monkeypatch,
            STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}",
            FSSPEC_GS_TOKEN="anon",
            FSSPEC_GS_PROJECT="test",
        ):
            gcsfs.GCSFileSystem.clear_instance_cache()
            try:
                yield gcsfs.GCSFileSystem(token="anon", project="test")
            finally:
                gcsfs.GCSFileSystem.clear_instance_cache()


def test_a_prepared_folder_on_gcs_reads_like_the_local_one(gcs, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    want = [b"gcs document %d " % i * (30 + 11 * i) for i in range(30)]
    for i, d in enumerate(want):
        (docs / f"{i:02d}.txt").write_bytes(d)
    prepare(docs, tmp_path / "prep", shard_size="8KB", workers=0, progress=False)
    gcs.mkdir("data")
    for d, _, names in os.walk(tmp_path / "prep"):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), tmp_path / "prep")
            gcs.pipe(f"data/prep/{rel}", open(os.path.join(d, n), "rb").read())
    cache = ShardCache(tmp_path / "cache")
    src = quern.sources.ArrayRecordSource("gs://data/prep", cache=cache)
    local = quern.sources.ArrayRecordSource(str(tmp_path / "prep"))
    assert len(src) == 30 and len(src.paths) > 2 and src.identity()["files"] == local.identity()["files"]
    ids = np.random.default_rng(0).permutation(30)
    assert list(src.read_many(ids)) == [want[i] for i in ids]
    assert cache.stats["misses"] == len(src.paths)  # each shard fetched once, verified
    np.testing.assert_array_equal(src.metadata["length"], [len(d) for d in want])
    with pytest.raises(quern.SourceError, match="not found"):
        ShardCache(tmp_path / "cache2", retries=0).get("gs://data/prep/no-such-shard.array_record")
