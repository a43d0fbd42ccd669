"""Tests of pipeline/streams/bucketed.py.

Pipeline.bucket: a wrong length index, a host count a bucket does not split over, a full
cache folder and empty records (issue 21, points 5 and 11).

Record ``i`` holds ``LEN[i]`` copies of ``i``, so every row names its record and its
true length. ``bucket(lengths=...)`` checks a given index on 5 sampled records (the
first, the last and 3 spread between: 0, 24, 49, 74 and 99 of 100), so an index wrong on
record 51 only is accepted when the pipeline is built; the records are measured again
when a step reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern

pytestmark = pytest.mark.timeout(120)

N = 100
LEN = (np.arange(N) * 37) % 8 + 1  # 1..8 tokens
LEN[51] = 7
BOUNDS = [4, 8]


class Docs:
    def __init__(self, lengths=LEN):
        self.lengths = np.asarray(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"tokens": np.full(int(self.lengths[i]), i, dtype=np.int32)}

    def identity(self):
        return {"type": "BucketCheckDocs", "lengths": self.lengths.tolist()}


def _base(lengths=LEN):
    return quern.Pipeline.from_source(Docs(lengths), seed=3).shuffle()


def _steps_with(pipe, rid, steps=300):
    return [s for s in range(steps) if any(i == rid for row in pipe.explain(s) for _, i in row)]


# --------------------------------------------------------------------------- point 5: a wrong index


@pytest.mark.parametrize(
    "real,says",
    [(7, 2), (12, 6), (2, 7)],
    ids=["cut-to-the-first-bound", "cut-to-the-last-bound", "shorter-than-it-says"],
)
def test_a_record_the_index_gets_wrong_is_a_step_error_naming_it(tmp_path, real, says):
    lengths = LEN.copy()
    lengths[51] = real
    index = lengths.copy()
    index[51] = says  # right on the 5 sampled records, wrong on record 51
    pipe = _base(lengths).bucket(BOUNDS, [4, 2], key="tokens", lengths=index, cache_dir=tmp_path)
    bad = _steps_with(pipe, 51)
    assert bad, "record 51 is in some step"
    s = bad[0]
    with pytest.raises(quern.StepError) as e:
        pipe.batch_at(s)
    msg = str(e.value)
    for words in (f"step {s},", "record 51 of source 'Docs'", f"it has {real} tokens", f"length index says {says}"):
        assert words in msg, (words, msg)
    for t in range(s):  # the steps before it are computed, with every record whole
        b = pipe.batch_at(t)
        for r, i in enumerate(b["tokens"][:, 0].tolist()):
            assert b["length"][r] == min(int(lengths[i]), b["tokens"].shape[1])
    with pipe.iterator() as it:  # the iterator stops at that step, with the same error
        for _ in range(s):
            next(it)
        with pytest.raises(quern.StepError, match=f"record 51 of source 'Docs': it has {real} tokens"):
            next(it)


def test_a_wrong_index_is_caught_in_worker_processes_too(tmp_path):
    index = LEN.copy()
    index[51] = 2
    pipe = _base().bucket(BOUNDS, [4, 2], key="tokens", lengths=index, cache_dir=tmp_path)
    s = _steps_with(pipe, 51)[0]
    with pipe.iterator(start_step=s, num_workers=1) as it:
        with pytest.raises(quern.StepError, match="record 51 of source 'Docs': it has 7 tokens"):
            next(it)


def test_a_right_index_gives_the_same_batches_and_longer_records_are_still_cut_to_the_last_bound(tmp_path):
    lengths = LEN.copy()
    lengths[51] = 12  # longer than the last bound: the documented truncation
    scanned = _base(lengths).bucket(BOUNDS, [4, 2], key="tokens", cache_dir=tmp_path)
    given = _base(lengths).bucket(BOUNDS, [4, 2], key="tokens", lengths=lengths, cache_dir=tmp_path)
    assert scanned.fingerprint() == given.fingerprint()
    s = _steps_with(scanned, 51)[0]
    for t in range(s + 1):
        assert_batches_equal(given.batch_at(t), scanned.batch_at(t), f"step {t}")
    b = scanned.batch_at(s)
    r = b["tokens"][:, 0].tolist().index(51)
    assert b["tokens"].shape[1] == 8 and b["length"][r] == 8 and (b["tokens"][r] == 51).all()


# --------------------------------------------------------------------------- point 11: bucket batch sizes and hosts


@pytest.mark.parametrize("sizes", [[3, 2], [3, 4]], ids=["largest-odd", "largest-even"])
def test_a_bucket_that_does_not_split_over_the_hosts_is_refused_before_the_first_step(tmp_path, sizes):
    pipe = _base().bucket(BOUNDS, sizes, key="tokens", cache_dir=tmp_path)
    want = "bucket 'len<=4' has batch size 3, which is not divisible by the host count (process_count) 2"
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
        pipe.iterator(process_index=0, process_count=2)
    other = [s for s in range(40) if len(pipe.explain(s)) == sizes[1]]
    assert other, "some step is in the bucket that splits"
    for call in (lambda: pipe.batch_at(other[0], 0, 2), lambda: pipe.explain(other[0], 1, 2)):
        with pytest.raises(ValueError, match="bucket 'len<=4' has batch size 3"):
            call()  # even at a step of the bucket that would split
    with pipe.iterator(process_count=1) as it:  # one host: every batch size splits
        assert len(next(it)["tokens"]) in sizes


def test_bucket_batch_sizes_that_split_over_the_hosts_give_the_global_batch(tmp_path):
    pipe = _base().bucket(BOUNDS, [4, 2], key="tokens", cache_dir=tmp_path)
    with pipe.iterator(process_index=1, process_count=2) as it:
        for s in range(10):
            full = pipe.batch_at(s)["tokens"]
            assert np.array_equal(next(it)["tokens"], full[len(full) // 2 :]), s
    with pytest.raises(ValueError, match="bucket 'len<=4' has batch size 4, which is not divisible by the host count"):
        pipe.batch_at(0, 0, 3)


# --------------------------------------------------------------------------- point 11: a full cache folder


def test_a_full_disk_leaves_no_temporary_file_in_the_packing_cache(tmp_path):
    """The rows of a best_fit epoch are counted once and kept under ``packing/``; when that
    file cannot be written (here: the process may write no byte to a file, RLIMIT_FSIZE,
    which fails the write as a full disk does, with an OSError), the count is kept in
    memory and no temporary file is left behind."""
    cache = tmp_path / "cache"
    code = textwrap.dedent(
        f"""
        import json, resource, signal, sys
        import numpy as np
        import quern
        lengths = np.arange(200) % 13 + 1
        docs = [np.full(int(n), i, dtype=np.int32) for i, n in enumerate(lengths)]
        pipe = quern.Pipeline.from_source(docs, seed=1).shuffle().pack(16, lengths=lengths, cache_dir={str(cache)!r})
        pipe = pipe.batch(4)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        b = pipe.batch_at(0)
        print(json.dumps({{"rows": int(b["tokens"].shape[0]), "per_epoch": pipe.stream.rows_before(1)}}))
        """
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == 4 and got["per_epoch"] > 0
    folder = cache / "packing"
    assert folder.is_dir()  # it tried: the folder is there
    assert sorted(os.listdir(folder)) == [], "no temporary (or partial) file is left"


# --------------------------------------------------------------------------- point 11: empty records


def test_empty_records_are_in_the_first_bucket_as_documented(tmp_path):
    lengths = LEN.copy()
    lengths[[10, 60]] = 0
    pipe = _base(lengths).bucket(BOUNDS, [4, 2], key="tokens", cache_dir=tmp_path)
    seen = set()
    for s in range(60):
        b = pipe.batch_at(s)
        for r, i in enumerate(pipe.explain(s)):
            if i[0][1] in (10, 60):
                seen.add(i[0][1])
                assert b["tokens"].shape[1] == 4 and b["length"][r] == 0 and (b["tokens"][r] == 0).all()
    assert seen == {10, 60}
    doc = quern.Pipeline.bucket.__doc__
    assert "the first from 0" in doc and "first from 1" not in doc
