"""The triage tree of ``quern bench``: from the loop's health and the stage seconds to
the level where the data waits and one concrete suggestion."""

import pytest

from quern.pipeline.cli.triage import DEVICE, HOST_MEMORY, LOCAL_DISK, NETWORK, SourceFacts, bounding_stage, triage

LOCAL_AR = SourceFacts("docs", "ArrayRecordSource", remote=False, block_size=1, shuffle="global")
REMOTE_AR = SourceFacts("docs", "ArrayRecordSource", remote=True, block_size=1, shuffle="global")
PARQUET = SourceFacts("table", "ParquetSource", remote=False, block_size=1000, shuffle="global")


def _triage(stages, health, bubble_rate, sources, workers, cpus, cache_misses=0):
    """:func:`triage` with the figures in a short, fixed order."""
    return triage(
        stages,
        health=health,
        bubble_rate=bubble_rate,
        sources=sources,
        num_workers=workers,
        cpus=cpus,
        cache_misses=cache_misses,
    )


def test_bounding_stage_is_the_largest_share():
    assert bounding_stage({"read": 1.0, "map[0] f": 3.0}) == ("map[0] f", 0.75)
    assert bounding_stage({}) == ("", 0.0)


def test_a_healthy_loop_is_compute_bound_whatever_the_stages():
    d = _triage({"read": 9.0, "collate": 1.0}, "healthy", 0.02, [LOCAL_AR], workers=0, cpus=2)
    assert d.level == DEVICE and d.stage == "" and "training step" in d.suggestion


def test_a_slow_per_record_transform_asks_to_vectorise_or_add_workers():
    d = _triage({"read": 1.0, "map[0] decode": 8.0, "collate": 1.0}, "alarm", 0.9, [LOCAL_AR], workers=0, cpus=2)
    assert d.level == HOST_MEMORY and d.stage == "map[0] decode" and d.share == pytest.approx(0.8)
    assert "vectorise" in d.suggestion and "num_workers=2" in d.suggestion
    d = _triage({"web: map[0] decode": 8.0, "read": 1.0}, "warning", 0.4, [LOCAL_AR], workers=2, cpus=2)
    assert "vectorise" in d.suggestion and "num_workers" not in d.suggestion


def test_a_remote_read_with_cache_misses_is_the_network():
    d = _triage({"read": 8.0, "collate": 1.0}, "alarm", 0.9, [REMOTE_AR], workers=0, cpus=2, cache_misses=3)
    assert d.level == NETWORK and "cache" in d.suggestion and "3 file" in d.reason


def test_a_remote_read_served_from_the_cache_is_the_local_disk():
    d = _triage({"read": 8.0}, "alarm", 0.9, [REMOTE_AR], workers=0, cpus=2, cache_misses=0)
    assert d.level == LOCAL_DISK


def test_a_globally_shuffled_row_group_format_asks_for_a_block_shuffle():
    d = _triage({"read": 8.0, "collate": 1.0}, "alarm", 0.9, [PARQUET], workers=0, cpus=2)
    assert d.level == LOCAL_DISK and "shuffle('block')" in d.suggestion and "1000" in d.reason
    blocked = PARQUET._replace(shuffle="block")
    d = _triage({"read": 8.0}, "alarm", 0.9, [blocked], workers=0, cpus=2)
    assert d.level == LOCAL_DISK and "quern prepare" in d.suggestion


def test_a_mixture_read_names_its_component():
    web = SourceFacts("web", "ParquetSource", remote=False, block_size=500, shuffle="global")
    code = SourceFacts("code", "ArrayRecordSource", remote=True, block_size=1, shuffle="global")
    d = _triage({"read: code": 5.0, "read: web": 1.0}, "alarm", 0.9, [web, code], workers=0, cpus=2, cache_misses=1)
    assert d.level == NETWORK and d.stage == "read: code"
    d = _triage({"read: code": 1.0, "read: web": 5.0}, "alarm", 0.9, [web, code], workers=0, cpus=2, cache_misses=1)
    assert d.level == LOCAL_DISK and "'web'" in d.reason


@pytest.mark.parametrize(
    "stage, words",
    [
        ("device_put", "device_prefetch"),
        ("handover", "larger arrays"),
        ("send", "larger arrays"),
        ("collate", "fixed-shape"),
    ],
)
def test_host_memory_stages_get_their_own_advice(stage, words):
    d = _triage({stage: 5.0, "read": 1.0}, "alarm", 0.9, [LOCAL_AR], workers=2, cpus=2)
    assert d.level == HOST_MEMORY and d.stage == stage and words in d.suggestion
