"""A prepared folder read by ``s3://`` URL from a local S3-compatible server (moto's server
mode, on 127.0.0.1), through the local-disk cache: the S3 protocol (s3fs, fsspec)."""

import os
import shutil
import sys

import numpy as np
import pytest
from servers import fsspec_env, process_on_port

import quern
from quern.pipeline.cache import ShardCache
from quern.prepare import prepare

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'quern[test]')")
pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'quern[s3]')")
SERVER = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
if not os.path.exists(SERVER):
    pytest.skip("moto_server is not installed (pip install 'moto[server]')", allow_module_level=True)


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on 127.0.0.1, and the environment that points boto3 and s3fs at it."""
    with process_on_port(lambda port: [SERVER, "-H", "127.0.0.1", "-p", str(port)], "moto_server") as port:
        url = f"http://127.0.0.1:{port}"
        env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        with fsspec_env(monkeypatch, FSSPEC_S3_ENDPOINT_URL=url, **env):  # s3fs's endpoint_url
            yield boto3.client("s3", endpoint_url=url)


def test_a_prepared_folder_on_s3_reads_like_the_local_one(s3, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    want = [b"s3 document %d " % i * (30 + 11 * i) for i in range(30)]
    for i, d in enumerate(want):
        (docs / f"{i:02d}.txt").write_bytes(d)
    prepare(docs, tmp_path / "prep", shard_size="8KB", workers=0, progress=False)
    s3.create_bucket(Bucket="data")
    for name in sorted(os.listdir(tmp_path / "prep")) + ["metadata/length.npy"]:
        path = tmp_path / "prep" / name
        if path.is_file():
            s3.upload_file(str(path), "data", f"prep/{name}")
    cache = ShardCache(tmp_path / "cache")
    src = quern.sources.ArrayRecordSource("s3://data/prep", cache=cache)
    local = quern.sources.ArrayRecordSource(str(tmp_path / "prep"))
    assert len(src) == 30 and len(src.paths) > 2 and src.identity()["files"] == local.identity()["files"]
    ids = np.random.default_rng(0).permutation(30)
    assert list(src.read_many(ids)) == [want[i] for i in ids]
    assert cache.stats["misses"] == len(src.paths)  # each shard fetched once, verified
    np.testing.assert_array_equal(src.metadata["length"], [len(d) for d in want])
    with pytest.raises(quern.SourceError, match="not found"):
        ShardCache(tmp_path / "cache2", retries=0).get("s3://data/prep/no-such-shard.array_record")
