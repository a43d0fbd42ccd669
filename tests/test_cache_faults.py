"""The disk cache under faults: a full disk, and a download killed with SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from servers import needs_nginx, nginx

import quern
from quern.pipeline.remote.cache import ShardCache


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_corrupt(small_disk, tmp_path):
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(os.urandom(3 << 20))
    small.write_bytes(os.urandom(100_000))
    cache = ShardCache(small_disk / "cache")
    with pytest.raises(quern.SourceError, match="is full") as e:
        cache.get(f"file://{big}")
    assert "big.bin" in str(e.value)
    left = os.listdir(small_disk / "cache")
    assert not [n for n in left if n.endswith(".part")] and not os.path.exists(cache.path(f"file://{big}"))
    assert open(cache.get(f"file://{small}"), "rb").read() == small.read_bytes()  # the room is there again


@needs_nginx
def test_a_download_killed_mid_way_leaves_only_a_part_file_removed_by_the_next_cache(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    data = os.urandom(3 << 20)
    (root / "shard.bin").write_bytes(data)
    folder = tmp_path / "cache"
    script = tmp_path / "fetch.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from quern.pipeline.remote.cache import ShardCache
            ShardCache(sys.argv[1]).get(sys.argv[2])
            """
        )
    )
    with nginx(root, limit_rate="1m") as srv:  # about 2 s for 3 MiB
        url = f"{srv.url}/shard.bin"
        proc = subprocess.Popen([sys.executable, str(script), str(folder), url])
        deadline = time.monotonic() + 30
        while not (folder.exists() and [n for n in os.listdir(folder) if n.endswith(".part")]):
            assert time.monotonic() < deadline and proc.poll() is None, "the download did not start"
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        cache = ShardCache(folder)
        assert not os.path.exists(cache.path(url))  # never a partial file under the final name
        parts = [n for n in os.listdir(folder) if n.endswith(".part")]
        assert len(parts) == 1 and os.path.getsize(folder / parts[0]) < len(data)
        assert open(cache.get(url, size=len(data)), "rb").read() == data
    assert not [n for n in os.listdir(folder) if n.endswith(".part")]
