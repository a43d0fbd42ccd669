"""A prepared folder in a config: the source, a filter on its metadata, packing from its length index."""

import json

import numpy as np
import pytest

import quern
from quern.pipeline.streams import config_form as dump
from quern.prepare import prepare


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(5)
    lines = tmp_path / "docs.jsonl"
    with open(lines, "w") as f:
        for i in range(400):
            f.write(json.dumps({"tokens": rng.integers(1, 1000, int(rng.integers(1, 60))).tolist(), "q": i % 7}) + "\n")
    (tmp_path / "tok.py").write_text(
        "import numpy as np\n\ndef encode(obj):\n    return {'record': np.asarray(obj['tokens'], np.int32), 'q': obj['q']}\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        prepare(lines, tmp_path / "prep", map="tok:encode", fields=["q"], num_workers=0, progress=False)
    finally:
        sys.path.remove(str(tmp_path))
    return tmp_path / "prep"


def test_a_config_filters_by_metadata_and_packs_from_the_index_of_a_prepared_folder(folder, monkeypatch):
    cfg = {
        "source": {"type": "array_record", "paths": str(folder)},
        "seed": 3,
        "transforms": [
            {"name": "metadata_range", "kind": "filter", "kwargs": {"field": "q", "max": 2}},
            {"name": "decode", "kwargs": {"dtype": "int32"}},
        ],
        "pack": {"seq_len": 64},
        "batch": {"size": 4},
    }
    import quern.pipeline.definition.scan as scan

    def no_scan(*a, **k):
        raise AssertionError("the length index was scanned: the metadata should have been used")

    monkeypatch.setattr(scan, "lengths", no_scan)
    pipe = quern.load_config(cfg)
    src = quern.sources.ArrayRecordSource(folder)
    q, lengths = src.metadata["q"], src.metadata["length"]
    want_ids = np.flatnonzero(q <= 2)  # computed here from the index: the records the filter keeps
    pc = pipe.pieces(np.arange(20))  # the rows of steps 0-4 (4 rows each): their documents
    assert pc.ids.size and set(pc.ids.tolist()) <= set(want_ids.tolist())
    batch = pipe.batch_at(0)
    for r in range(4):  # each row's tokens are its documents' tokens, read back here
        sel = pc.row == r
        want = np.concatenate(
            [
                np.frombuffer(src[int(i)], np.int32)[s : s + n]
                for i, s, n in zip(pc.ids[sel], pc.start[sel], pc.length[sel])
            ]
        )
        assert batch["tokens"][r, : len(want)].tolist() == want.tolist()
        assert (pc.length[sel] <= lengths[pc.ids[sel]]).all()
    back = quern.load_config(dump.to_config(pipe))  # the config form keeps the metadata filter
    assert back.fingerprint() == pipe.fingerprint()
