"""Tests of pipeline/bench.py.

``quern bench CONFIG``: the stage times, the loop's data wait and bubble rate, the
level where the data waits (the triage tree) with a suggestion, and ``--plot``."""

import re

import numpy as np
import pytest
import yaml
from helpers import quern_cmd, write_parquets, write_shards
from servers import needs_nginx, nginx
from test_config import _good

import quern
from quern.pipeline.cli import bench
from quern.pipeline.cli.triage import DEVICE, HOST_MEMORY, LOCAL_DISK, NETWORK
from quern.pipeline.remote.cache import ShardCache
from quern.prepare import prepare

SLOW = "import time\n\ndef slow(record):\n    time.sleep(0.0005)\n    return record\n"


def _bench(path, *args, check=True):
    return quern_cmd("bench", path, *args, check=check, env={"QUERN_ALLOW": "test_config"})


@pytest.fixture
def configs(tmp_path):
    """``(slow, fast)``: the shards' config with a per-record transform that sleeps 0.5 ms
    (8 records a step: about 4 ms), and without it."""
    write_shards(tmp_path)
    (tmp_path / "slowmod.py").write_text(SLOW)
    fast = _good(tmp_path)
    slow = _good(tmp_path)
    slow["transforms"].append({"fn": "slowmod:slow"})
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(slow))
    (tmp_path / "fast.yaml").write_text(yaml.safe_dump(fast))
    return tmp_path / "slow.yaml", tmp_path / "fast.yaml"


def _line(out, prefix):
    (line,) = [x for x in out.splitlines() if x.startswith(prefix)]
    return line


def test_a_slow_record_transform_is_named_with_its_level_and_a_suggestion(configs):
    out = _bench(configs[0], "--steps", 20).stdout
    assert _line(out, "bound by: ") == "bound by: map[2] slow"
    loop = _line(out, "loop: ")
    assert "20 steps, 0 workers, a training step of 0.0 ms" in loop and "health alarm" in loop
    assert float(re.search(r"bubble rate ([\d.]+)%", loop).group(1)) > 80
    assert _line(out, "where the data waits: ").startswith(f"where the data waits: {HOST_MEMORY}: ")
    assert "stage 'map[2] slow'" in out
    assert "vectorise this transform" in _line(out, "suggestion: ")


def test_no_training_step_says_the_loop_waits_by_design_and_one_step_says_too_few(configs):
    out = _bench(configs[1], "--steps", 10).stdout
    assert "note: no training step (--step-ms 0): the loop waits by design" in out
    out = _bench(configs[1], "--steps", 2).stdout
    assert _line(out, "where the data waits: ") == "where the data waits: unknown: too few steps to measure the loop"
    assert "note:" not in out


def test_a_slow_training_step_leaves_the_data_on_time(configs):
    out = _bench(configs[1], "--steps", 15, "--step-ms", 30).stdout
    assert "health healthy" in _line(out, "loop: ") and "note:" not in out
    assert _line(out, "where the data waits: ").startswith(f"where the data waits: {DEVICE}: ")
    assert "training step bounds the loop" in _line(out, "suggestion: ")


def test_workers_are_named_in_the_loop_and_their_stages_are_used(configs):
    out = _bench(configs[0], "--steps", 12, "--workers", 2).stdout
    assert "12 steps, 2 workers" in _line(out, "loop: ")
    assert "stage 'map[2] slow'" in _line(out, "where the data waits: ")
    assert "num_workers" not in _line(out, "suggestion: ")  # both cores already run one


def test_plot_draws_the_loop_and_the_stages(configs, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = tmp_path / "bench.png"
    out = _bench(configs[0], "--steps", 10, "--plot", png).stdout
    assert f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 10  # drawn, not blank


def test_bad_step_time_exits_2(configs):
    out = _bench(configs[1], "--step-ms", -1, check=False)
    assert out.returncode == 2 and "--step-ms" in out.stderr


def test_the_sources_facts_follow_the_definition(tmp_path):
    write_parquets(tmp_path)
    src = quern.sources.ParquetSource(str(tmp_path / "part.parquet"), columns=["i"])
    assert bench.source_facts(quern.Pipeline.from_source(src).batch(10))[0].shuffle is None
    pipe = quern.Pipeline.from_source(src, seed=1).shuffle().batch(10)
    (facts,) = bench.source_facts(pipe)
    assert facts.kind == "ParquetSource" and facts.block_size == 50 and facts.shuffle == "global"
    assert not facts.remote
    blocked = quern.Pipeline.from_source(src, seed=1).shuffle("block").batch(10)
    assert bench.source_facts(blocked)[0].shuffle == "block"
    run = bench.loop(pipe, 0, count=6, num_workers=0, step_s=0.0)
    d = bench.diagnose(pipe, run, fallback=None)
    assert d.level in (DEVICE, HOST_MEMORY, LOCAL_DISK)  # a tiny file: whichever stage is largest


@needs_nginx
def test_a_remote_source_fetched_during_the_loop_is_the_network(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_bytes(b"x" * 3000)
    root = tmp_path / "www"
    root.mkdir()
    prepare(docs, root / "prep", shard_size="16KB", num_workers=0, progress=False)
    with nginx(root, limit_rate="100k") as srv:
        src = quern.sources.ArrayRecordSource(f"{srv.url}/prep", cache=ShardCache(tmp_path / "cache"))
        pipe = quern.Pipeline.from_source(src, seed=1).batch(4)
        run = bench.loop(pipe, 0, count=8, num_workers=0, step_s=0.0)
        d = bench.diagnose(pipe, run)
    assert bench.source_facts(pipe)[0].remote
    assert d.level == NETWORK and d.stage == "read", d
    assert "cache" in d.suggestion and "quern prepare" in d.suggestion


# --------------------------------------------------------------------------- the device advice


def test_device_advice_follows_the_seeds_rule():
    from quern.pipeline.cli.triage import device_advice

    slow = {"random_map[1] crop": 2.5e-3, "map[0] decode": 4e-4, "read": 5e-3, "map_batch[0] norm": 1.5e-3}
    got = device_advice(slow, 64, [])
    assert [line.split(" to ")[0] for line in got] == ["move random_map[1] crop", "move map_batch[0] norm"]
    assert "(random_map_device): 2.50 ms a row on the host, batches of 64 rows" in got[0]
    assert "(map_device)" in got[1]  # the read is not a transform, the decode is under 1 ms
    assert device_advice(slow, 16, []) == []  # small batches: nothing moves to the devices
    back = device_advice(slow, 16, ["random_map_device[2] crop"])
    assert back == [
        "move random_map_device[2] crop back to the host: batches of 16 rows, too few for the devices to pay "
        "(the rule: over 1 ms a row and 32 rows)"
    ]
    assert device_advice(slow, 64, ["random_map_device[2] crop"])[0].startswith("move random_map[1] crop")


def test_quern_bench_suggests_moving_a_slow_stage_to_the_devices(tmp_path):
    write_shards(tmp_path)
    (tmp_path / "slowmod.py").write_text(
        "import time\n\ndef slow(record):\n    time.sleep(0.0015)\n    return record\n"
    )
    cfg = _good(tmp_path)
    cfg["transforms"].append({"fn": "slowmod:slow"})
    cfg["batch"] = {"size": 32}
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(cfg))
    out = _bench(tmp_path / "slow.yaml", "--steps", 3).stdout
    advice = _line(out, "device: ")
    assert (
        advice.startswith("device: move map[2] slow to the devices (map_device): ") and "batches of 32 rows" in advice
    )
    assert float(re.search(r"\(map_device\): ([\d.]+) ms a row", advice).group(1)) > 1.0
