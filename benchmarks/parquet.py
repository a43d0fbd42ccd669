"""quern over Parquet vs the raw pyarrow limit.

Data (made by the script, cached under ``benchmarks/data/parquet/``): 200,000
records of int32 tokens, lengths uniform in 64..512, one Parquet file, snappy,
10,000-row row groups, a ``list<int32>`` column ``tokens``.

Measured (records/s, median of 3 runs of at least 2 s, page cache warm), each
producing batches of 256 rows padded/truncated to 512:

* raw: ``ParquetFile.read_row_group`` in order -> offsets/values -> padded
  numpy (the limit: sequential, no shuffle);
* quern ``.shuffle("block", window=4)``: blocks of one row group, shuffled
  within windows of 4 row groups;
* quern ``.shuffle()``: a global shuffle; every step touches most row groups,
  served from the decoded row-group cache (``cache_bytes``, 1 GiB by default).

Run:  .venv/bin/python benchmarks/parquet.py [--records N]
"""

from __future__ import annotations

import argparse
import os
import statistics

import common
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import quern

SEQ_LEN, BATCH, GROUP = 512, 256, 10_000
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "parquet")


def make_data(n: int) -> str:
    path = os.path.join(DATA, f"tokens-{n}.parquet")
    if not os.path.exists(path):
        os.makedirs(DATA, exist_ok=True)
        rng = np.random.default_rng(0)
        lengths = rng.integers(64, 513, n)
        values = rng.integers(1, common.VOCAB, int(lengths.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        pq.write_table(pa.table({"tokens": tokens}), path + ".tmp", row_group_size=GROUP, compression="snappy")
        os.replace(path + ".tmp", path)
    return path


def raw_batches(path: str):
    """Sequential row groups -> padded batches, as fast as pyarrow + numpy go."""
    pf = pq.ParquetFile(path)
    carry_tok: list = []
    while True:
        for g in range(pf.num_row_groups):
            col = pf.read_row_group(g, columns=["tokens"]).column(0).combine_chunks()
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy()
            rows = [values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
            carry_tok += rows
            while len(carry_tok) >= BATCH:
                chunk, carry_tok = carry_tok[:BATCH], carry_tok[BATCH:]
                block = np.zeros((BATCH, SEQ_LEN), np.int32)
                for i, a in enumerate(chunk):
                    n = min(len(a), SEQ_LEN)
                    block[i, :n] = a[:n]
                yield block


def rate(next_batch, runs: int = 3, seconds: float = 2.0) -> tuple[float, list[float]]:
    """Median records/s of ``runs`` consecutive runs of ``seconds`` after 3 untimed batches; and the runs."""
    for _ in range(3):
        next_batch()
    rates = [common.rate(next_batch, seconds) * BATCH for _ in range(runs)]
    return statistics.median(rates), rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    args = ap.parse_args()
    print(common.command_line())
    path = make_data(args.records)
    print(f"data: {args.records:,} records, {os.path.getsize(path) / 2**20:.0f} MiB, row groups of {GROUP:,}")
    src = quern.sources.ParquetSource(path)
    pad = quern.transforms.pad(SEQ_LEN, key="tokens")
    results = []
    raw = raw_batches(path)
    results.append(("raw pyarrow row groups -> padded numpy (sequential)", *rate(lambda: next(raw))))
    for label, pipe in [
        ('quern .shuffle("block", window=4)', quern.Pipeline.from_source(src, seed=0).shuffle("block", window=4)),
        ("quern .shuffle() (global)", quern.Pipeline.from_source(src, seed=0).shuffle()),
    ]:
        with pipe.map(pad).batch(BATCH).iterator() as it:
            results.append((label, *rate(it.__next__)))
    limit = results[0][1]
    for label, med, runs in results:
        print(f"  {label:<55s} {med:>10,.0f} rec/s  {med / limit:5.2f}x raw   runs: {common.join_runs(runs)}")


if __name__ == "__main__":
    main()
