"""A prepared folder read by ``s3://`` URL from a local S3-compatible server (moto's server
mode, on 127.0.0.1), through the local-disk cache: the S3 protocol (s3fs, fsspec)."""

import os
import shutil
import sys

import pytest
from remote_folder import check_reads_like_local, prepared_folder
from servers import fsspec_env, process_on_port

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
    folder, want = prepared_folder(tmp_path, b"s3")
    s3.create_bucket(Bucket="data")
    for name in sorted(os.listdir(folder)) + ["metadata/length.npy"]:
        path = folder / name
        if path.is_file():
            s3.upload_file(str(path), "data", f"prep/{name}")
    check_reads_like_local("s3://data/prep", folder, want, tmp_path)
