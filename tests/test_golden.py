"""Golden values: the data order is a published format, pinned here as literals.

Every literal below was computed once with ``quern.pipeline.index`` at
``INDEX_FORMAT_VERSION == 1`` (numpy 2.4) and pasted in; nothing here is
recomputed from the code under test. A refactor, an optimisation or a
dependency upgrade that changes any of these values changes which records
(or which random numbers) a training run sees at a given step, and so breaks
resuming old checkpoints. If the order is changed on purpose: bump
``INDEX_FORMAT_VERSION`` and recompute every literal in this file.
(Modelled on grain's hard-coded expected outputs for its shuffle.)
"""

import numpy as np
import pytest

import quern
from quern.pipeline import index
from quern.transforms import random as qrandom

SEED_MAX = 2**64 - 1
SEEDS = (0, SEED_MAX)


def test_index_format_version_is_1():
    # If the order changes deliberately, bump the version and recompute every literal in this file.
    assert index.INDEX_FORMAT_VERSION == 1


def _js(n: int) -> list[int]:
    """Indices within an epoch that are pinned: the whole epoch for n <= 3, else a handful."""
    if n <= 3:
        return list(range(n))
    return sorted({0, 1, 2, 3, 7, n // 3, n // 2, n - 2, n - 1})


# (n, seed) -> [record ids of epoch 0, record ids of epoch 1] at j = _js(n), i.e. positions p = e*n + j.
# Computed once with quern.pipeline.index at INDEX_FORMAT_VERSION 1:
#   epoch_record_ids([e*n + j for j in _js(n)], n, seed, "global")
#   (== permute(_js(n), n, derive_key(seed, e)), checked at the time).
GLOBAL = {
    (1, 0): [[0], [0]],
    (1, SEED_MAX): [[0], [0]],
    (2, 0): [[0, 1], [1, 0]],
    (2, SEED_MAX): [[0, 1], [0, 1]],
    (3, 0): [[0, 1, 2], [1, 2, 0]],
    (3, SEED_MAX): [[2, 1, 0], [0, 1, 2]],
    (2**16 + 1, 0): [
        [40839, 44756, 242, 43343, 17062, 35996, 62496, 30271, 10504],
        [32446, 58593, 21141, 64367, 61874, 35801, 25602, 30309, 4724],
    ],
    (2**16 + 1, SEED_MAX): [
        [2506, 41434, 8890, 22924, 1254, 31589, 12654, 39413, 12018],
        [59788, 22309, 639, 54008, 22678, 55956, 58947, 52833, 34403],
    ],
    (10**6, 0): [
        [550598, 678372, 925404, 866469, 780756, 455010, 377697, 608324, 537601],
        [360566, 179908, 938881, 973983, 84337, 678929, 149504, 706403, 588445],
    ],
    (10**6, SEED_MAX): [
        [670909, 459247, 477669, 691848, 147277, 505089, 800551, 688894, 692275],
        [964506, 333668, 171107, 184563, 59646, 838970, 46671, 346773, 587466],
    ],
    (10**12, 0): [
        [
            858589514251,
            137089387638,
            793839454332,
            351098484782,
            356872687637,
            25848879836,
            213212173214,
            393040738038,
            598377104695,
        ],
        [
            796097724273,
            810841847980,
            296222319795,
            979353277149,
            785479205002,
            512490801558,
            969563948114,
            650845794634,
            57056180990,
        ],
    ],
    (10**12, SEED_MAX): [
        [
            185357822514,
            795313659326,
            836860868312,
            234315238124,
            551554639301,
            830805021195,
            55579371721,
            623779987007,
            577571228396,
        ],
        [
            14818299218,
            851483389490,
            31814981946,
            491819452459,
            115465188742,
            268612457864,
            555788739701,
            549236250921,
            844242646249,
        ],
    ],
}


@pytest.mark.parametrize("n, seed", list(GLOBAL))
def test_global_permutation_golden(n, seed):
    js = np.asarray(_js(n), dtype=np.int64)
    for epoch, expected in enumerate(GLOBAL[n, seed]):
        assert index.epoch_record_ids(epoch * n + js, n, seed, "global").tolist() == expected
        assert index.permute(js, n, index.derive_key(seed, epoch)).tolist() == expected
    # both epochs in one call (one key per element instead of a scalar key): same values
    both = index.epoch_record_ids(np.concatenate([js, n + js]), n, seed, "global")
    assert both.tolist() == GLOBAL[n, seed][0] + GLOBAL[n, seed][1]


def _block_args(n: int) -> tuple[int, int]:
    """(block, window) used for the block-shuffle goldens: small blocks for small n."""
    return (4, 3) if n < 2**16 else (1000, 8)


# Same layout as GLOBAL, for the block shuffle with (block, window) = _block_args(n).
# Computed once with quern.pipeline.index at INDEX_FORMAT_VERSION 1:
#   epoch_record_ids([e*n + j for j in _js(n)], n, seed, "block", block=block, window=window)
#   (== block_permute(_js(n), n, derive_key(seed, e), block, window), checked at the time).
BLOCK = {
    (1, 0): [[0], [0]],
    (1, SEED_MAX): [[0], [0]],
    (2, 0): [[1, 0], [0, 1]],
    (2, SEED_MAX): [[1, 0], [0, 1]],
    (3, 0): [[2, 0, 1], [2, 1, 0]],
    (3, SEED_MAX): [[1, 0, 2], [2, 1, 0]],
    (2**16 + 1, 0): [
        [47954, 51090, 47613, 51398, 15984, 28048, 43010, 65050, 12940],
        [51856, 51211, 14060, 3532, 14313, 17460, 15793, 40818, 65502],
    ],
    (2**16 + 1, SEED_MAX): [
        [13540, 42980, 42853, 46272, 15036, 57739, 11052, 61102, 61529],
        [45974, 16075, 22907, 62102, 39295, 42990, 50948, 13787, 65288],
    ],
    (10**6, 0): [
        [675954, 419090, 675613, 419398, 396984, 144816, 994631, 242503, 383411],
        [781856, 781211, 711060, 533532, 711313, 800270, 186210, 440463, 440086],
    ],
    (10**6, SEED_MAX): [
        [42540, 279980, 279853, 370272, 346036, 202435, 547261, 568364, 568523],
        [704974, 203075, 618907, 408102, 674295, 217135, 749089, 48825, 607846],
    ],
    (10**12, 0): [
        [
            229413677954,
            872941692090,
            229413677613,
            872941692398,
            742811167984,
            696996790804,
            682499892878,
            990309036426,
            990309036389,
        ],
        [
            243783203856,
            243783203211,
            666769455060,
            755358055532,
            666769455313,
            845749996230,
            951161910551,
            650755180284,
            497468113164,
        ],
    ],
    (10**12, SEED_MAX): [
        [
            964463525540,
            382861982980,
            382861982853,
            105723323272,
            630816012036,
            32491518054,
            707014462470,
            91532006692,
            292124106087,
        ],
        [
            831795999974,
            330461299075,
            17951395907,
            372679192102,
            523121857295,
            383049150303,
            810949149752,
            325185765475,
            722295922496,
        ],
    ],
}

# The whole block shuffle of n = 30 (7 full blocks of 4, a tail block of 2, windows of 3 blocks).
# Computed once with quern.pipeline.index at INDEX_FORMAT_VERSION 1:
#   epoch_record_ids(range(e*30, e*30 + 30), 30, seed, "block", block=4, window=3)
BLOCK_30 = {
    0: [
        [11, 14, 10, 6, 7, 12, 9, 4, 15, 13, 5, 8, 23, 16, 27, 22, 18, 24, 20, 19, 25, 17, 26, 21, 1, 29, 3, 2, 28, 0],
        [27, 5, 14, 25, 4, 15, 24, 13, 12, 7, 6, 26, 22, 18, 23, 11, 21, 9, 19, 16, 17, 8, 10, 20, 1, 2, 28, 3, 0, 29],
    ],
    SEED_MAX: [
        [24, 15, 14, 1, 12, 3, 26, 13, 27, 2, 0, 25, 21, 19, 20, 7, 18, 6, 17, 23, 5, 22, 16, 4, 11, 28, 29, 8, 9, 10],
        [11, 0, 1, 3, 2, 22, 10, 23, 20, 9, 8, 21, 26, 18, 17, 12, 15, 25, 13, 14, 19, 27, 24, 16, 5, 7, 4, 6, 29, 28],
    ],
}


@pytest.mark.parametrize("n, seed", list(BLOCK))
def test_block_shuffle_golden(n, seed):
    block, window = _block_args(n)
    js = np.asarray(_js(n), dtype=np.int64)
    for epoch, expected in enumerate(BLOCK[n, seed]):
        got = index.epoch_record_ids(epoch * n + js, n, seed, "block", block=block, window=window)
        assert got.tolist() == expected
        assert index.block_permute(js, n, index.derive_key(seed, epoch), block, window).tolist() == expected
    both = index.epoch_record_ids(np.concatenate([js, n + js]), n, seed, "block", block=block, window=window)
    assert both.tolist() == BLOCK[n, seed][0] + BLOCK[n, seed][1]


@pytest.mark.parametrize("seed", SEEDS)
def test_block_shuffle_whole_epoch_golden(seed):
    for epoch, expected in enumerate(BLOCK_30[seed]):
        positions = np.arange(epoch * 30, epoch * 30 + 30)
        assert index.epoch_record_ids(positions, 30, seed, "block", block=4, window=3).tolist() == expected


def test_hash64_golden():
    # Computed once with quern.pipeline.index at INDEX_FORMAT_VERSION 1: hash64(x) for x in xs.
    xs = [0, 1, 2**63, 2**64 - 1]
    expected = [16294208416658607535, 10451216379200822465, 5196802822362493915, 16490336266968443936]
    assert [int(index.hash64(x)) for x in xs] == expected
    got = index.hash64(np.asarray(xs, dtype=np.uint64))
    assert got.dtype == np.uint64 and got.tolist() == expected


# (seed, *parts) -> derive_key(seed, *parts). Computed once with quern.pipeline.index at
# INDEX_FORMAT_VERSION 1. Negative parts are taken modulo 2**64 (so -1 and 2**64 - 1 agree).
DERIVE_KEY = [
    ((0,), 16294208416658607535),
    ((0, 0), 11133151466687998564),
    ((0, 1), 17091085067872826679),
    ((1, 0), 11600769590773015774),
    ((SEED_MAX, 0), 17176013103536546400),
    ((12345, 0), 3247807031339919510),
    ((12345, 1), 15606459047411975066),
    ((5, -1), 7902673975304047449),
    ((5, 2**64 - 1), 7902673975304047449),
    ((7, 1, 0, 3), 7578946676005453002),
    ((7, -3, 2**63), 9393875465430731010),
]


@pytest.mark.parametrize("args, expected", DERIVE_KEY)
def test_derive_key_golden(args, expected):
    key = index.derive_key(*args)
    assert key.dtype == np.uint64 and int(key) == expected


def test_derive_key_array_parts_golden():
    # Computed once with quern.pipeline.index at INDEX_FORMAT_VERSION 1:
    #   derive_key(5, np.array([-1, 0, 3], dtype=np.int64)) (same for int32 and for uint64 [2**64-1, 0, 3])
    expected = [7902673975304047449, 16724494485129748269, 14680702086980696719]
    for part in (
        np.array([-1, 0, 3], dtype=np.int64),
        np.array([-1, 0, 3], dtype=np.int32),
        np.array([2**64 - 1, 0, 3], dtype=np.uint64),
    ):
        assert index.derive_key(5, part).tolist() == expected
    # broadcast of two array parts: derive_key(7, 1, np.array([0, 1]), np.arange(3).reshape(3, 1))
    got = index.derive_key(7, 1, np.array([0, 1]), np.arange(3).reshape(3, 1))
    assert got.tolist() == [
        [4240377419271243770, 7968446727327630790],
        [3151949043430096460, 11163304226323570895],
        [18118160707703832771, 12065533933308010655],
    ]


def _draw(record, rng):
    record = dict(record)
    record["ints"] = rng.integers(0, 2**32, size=2)
    record["u"] = rng.random()
    return record


# step -> the batch a random_map stage produces. Computed once at INDEX_FORMAT_VERSION 1 (numpy 2.4 Philox):
#   Pipeline.from_source({"x": np.arange(20)}, seed=7).shuffle().random_map(_draw).batch(4).batch_at(step)
# floats written with float.hex() (exact).
RANDOM_MAP = {
    0: {
        "x": [19, 10, 13, 0],
        "ints": [[2487267267, 2879630847], [3573962987, 550671967], [3071545381, 893483485], [253055233, 3508190777]],
        "u": ["0x1.2378fc8456e18p-2", "0x1.99a2df30f80a4p-1", "0x1.6c7fd057043b0p-3", "0x1.e4ea6403e072dp-1"],
    },
    3: {
        "x": [2, 3, 8, 16],
        "ints": [[529762968, 897278030], [167239689, 3302249511], [3762442314, 449806804], [2590809064, 1356751908]],
        "u": ["0x1.cfffeff3d3670p-1", "0x1.c3d119887438ap-2", "0x1.1a32a955c57ecp-3", "0x1.de0b6cb0fb570p-1"],
    },
}


@pytest.mark.parametrize("step", list(RANDOM_MAP))
def test_random_map_numbers_golden(step):
    pipe = quern.Pipeline.from_source({"x": np.arange(20)}, seed=7).shuffle().random_map(_draw).batch(4)
    batch = pipe.batch_at(step)
    expected = RANDOM_MAP[step]
    assert batch["x"].tolist() == expected["x"]
    assert batch["ints"].tolist() == expected["ints"]
    assert batch["u"].dtype == np.float64
    assert batch["u"].tolist() == [float.fromhex(h) for h in expected["u"]]


def _store_keys(batch, keys):
    batch = dict(batch)
    batch["keys"] = keys
    return batch


# step -> (x, keys a random_map_batch stage gets, uniform(keys, (2,)), integers(keys, 0, 1000, (3,))).
# Computed once at INDEX_FORMAT_VERSION 1:
#   Pipeline.from_source({"x": np.arange(20)}, seed=7).shuffle().batch(4).random_map_batch(_store_keys)
#   .batch_at(step); then quern.transforms.random.uniform / integers of its "keys". Step 5 is in epoch 1.
RANDOM_MAP_BATCH = {
    0: (
        [19, 10, 13, 0],
        [11944875455791028898, 8887521187358711800, 4042215761485876629, 132651358543841738],
        [
            ["0x1.18998fbb6f58dp-1", "0x1.5f99e4ca220ccp-2"],
            ["0x1.f1a97ee50617cp-3", "0x1.78c58ec158133p-1"],
            ["0x1.2e2ab96536346p-1", "0x1.4bb6326ecb507p-1"],
            ["0x1.157e7d0de954cp-3", "0x1.9869420c2ae3dp-1"],
        ],
        [[548, 343, 64], [242, 735, 558], [590, 647, 908], [135, 797, 798]],
    ),
    5: (
        [16, 17, 12, 10],
        [8040446317717462209, 9511474339751530243, 13770081823318207018, 15966357779235280839],
        [
            ["0x1.6a35055ed75d4p-2", "0x1.12e774751c5eap-1"],
            ["0x1.32c717ac015c5p-1", "0x1.85dc941e7b6c8p-2"],
            ["0x1.7179151be125cp-2", "0x1.f4d943ab71d60p-3"],
            ["0x1.492df06b82523p-1", "0x1.8656d192b5900p-7"],
        ],
        [[353, 536, 363], [599, 380, 968], [360, 244, 616], [642, 11, 217]],
    ),
}


@pytest.mark.parametrize("step", list(RANDOM_MAP_BATCH))
def test_random_map_batch_keys_golden(step):
    pipe = quern.Pipeline.from_source({"x": np.arange(20)}, seed=7).shuffle().batch(4).random_map_batch(_store_keys)
    batch = pipe.batch_at(step)
    x, keys, uniforms, ints = RANDOM_MAP_BATCH[step]
    assert batch["x"].tolist() == x
    assert batch["keys"].dtype == np.uint64 and batch["keys"].tolist() == keys
    keys = np.asarray(keys, dtype=np.uint64)
    assert qrandom.uniform(keys, (2,)).tolist() == [[float.fromhex(h) for h in row] for row in uniforms]
    assert qrandom.integers(keys, 0, 1000, (3,)).tolist() == ints


# step -> global batch "x" of Pipeline.from_source({"x": np.arange(100)}, seed=2026).shuffle().batch(8).
# Computed once at INDEX_FORMAT_VERSION 1 with batch_at(step). Step 12 covers positions 96..103: the
# first 4 rows are the end of epoch 0, the last 4 the start of epoch 1. Host 1 of 2 owns rows 4..7.
BATCHES = {
    0: [35, 41, 46, 15, 36, 96, 38, 77],
    1: [81, 12, 75, 79, 58, 31, 9, 98],
    12: [4, 69, 24, 17, 97, 10, 15, 98],
}


def _small_pipe():
    return quern.Pipeline.from_source({"x": np.arange(100)}, seed=2026).shuffle().batch(8)


@pytest.mark.parametrize("step", list(BATCHES))
def test_batch_at_golden(step):
    pipe = _small_pipe()
    batch = pipe.batch_at(step)
    assert list(batch) == ["x"] and batch["x"].dtype == np.int64
    assert batch["x"].tolist() == BATCHES[step]
    assert pipe.batch_at(step, process_index=0, process_count=2)["x"].tolist() == BATCHES[step][:4]
    assert pipe.batch_at(step, process_index=1, process_count=2)["x"].tolist() == BATCHES[step][4:]


def test_explain_golden():
    # Computed once at INDEX_FORMAT_VERSION 1: _small_pipe().explain(12) (and with process_index=1, process_count=2).
    pipe = _small_pipe()
    expected = [[("arrays", i)] for i in [4, 69, 24, 17, 97, 10, 15, 98]]
    assert pipe.explain(12) == expected
    assert pipe.explain(12, process_index=1, process_count=2) == expected[4:]
