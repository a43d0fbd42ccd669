"""A prepared folder read by ``gs://`` URL from a local GCS emulator (gcp-storage-emulator, on
127.0.0.1), through the local-disk cache: the GCS protocol (gcsfs, fsspec)."""

import os
import shutil
import sys

import pytest
from remote_folder import check_reads_like_local, prepared_folder
from servers import fsspec_env, process_on_port

# gcsfs reads this when imported: its default "extended" file system speaks gRPC, which the emulator does not
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


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
    folder, want = prepared_folder(tmp_path, b"gcs")
    gcs.mkdir("data")
    for d, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), folder)
            gcs.pipe(f"data/prep/{rel}", open(os.path.join(d, n), "rb").read())
    check_reads_like_local("gs://data/prep", folder, want, tmp_path)
