"""MaxText's pretrain pipeline, grain against quern: rows/s, real tokens/s, fill and time to the first batch.

What is measured
----------------
The documents and the steps of ``examples/maxtext_pipeline.py`` (imported from it):
``--docs`` (4,000) documents of 5-150 words in one ArrayRecord file of serialized
``tf.train.Example`` protos, a word-level ``tokenizers`` tokenizer trained on them, and
per document: parse the Example, tokenize with BOS/EOS, truncate to ``--seq-len``
(512) tokens, ``inputs`` = ``targets``; then pack ``inputs`` and ``targets`` together
into rows of ``--seq-len``, batch 16 rows, shift the inputs right (MaxText's
``ShiftData``, vectorised over the batch). The same on both sides:

* **grain first_fit**: ``MapDataset.source(ArrayRecordDataSource).shuffle(seed).repeat()``,
  ``.map(parse).map(tokenize)``, ``.to_iter_dataset(ReadOptions(num_threads=0))``,
  ``FirstFitPackIterDataset(length_struct={inputs, targets}, num_packing_bins=16,
  shuffle_bins=False)``, ``.batch(16)``, ``.map(shift)``; 2 workers:
  ``.mp_prefetch(MultiprocessingOptions(num_workers=2))``;
* **quern first_fit** and **quern best_fit**: ``Pipeline.from_source(ArrayRecordSource)
  .shuffle().map(parse).map(tokenize).pack({inputs, targets}, mode, num_bins=16)
  .batch(16).map_batch(shift)``, ``pipe.iterator(num_workers=0 or 2)``.

* **rows/s, real tokens/s**: a fresh iterator, 1 batch untimed, then at least
  ``--min-seconds`` (3 s); ``--runs`` (3) rounds, configs in turn; the median.
  Real tokens are the non-zero ``targets_segment_ids``.
* **fill**: real tokens / token slots over the first 40 batches.
* **time to first batch**: from building the pipeline to the first batch (quern's
  ``first_fit`` measures the documents its first rows reach; ``best_fit`` scans every
  document's length first), in a fresh process's state: *cold* with an empty
  quern cache folder, *warm* with the one the cold run filled (grain keeps no cache:
  both of its figures are a fresh build). Then quern ``first_fit``'s and ``concat``'s cold
  first batch over ``--docs`` documents and over 10x as many (median of 3).

Run:  python benchmarks/maxtext.py  [--docs 4000] [--seq-len 512] [--runs 3] [--min-seconds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import quern  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 16


def example() -> Any:
    """``examples/maxtext_pipeline.py`` as a module."""
    spec = importlib.util.spec_from_file_location(
        "maxtext_pipeline", os.path.join(ROOT, "examples", "maxtext_pipeline.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Truncated:
    """The example's ``Tokenize``, its ids truncated to ``seq_len`` (MaxText truncates before packing)."""

    def __init__(self, tokenize: Any, seq_len: int) -> None:
        self.tokenize, self.seq_len = tokenize, seq_len

    def __call__(self, record: Any) -> dict:
        out = self.tokenize(record)
        return {k: v[: self.seq_len] for k, v in out.items()}


def grain_pipeline(mx: Any, path: str, tokenize: Any, seq_len: int, workers: int) -> Any:
    import grain
    from grain._src.python.dataset.transformations.packing import FirstFitPackIterDataset

    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([path])).shuffle(seed=0).repeat()
    ds = ds.map(mx.parse_example).map(tokenize)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    it = FirstFitPackIterDataset(
        it, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=BATCH, shuffle_bins=False
    )
    it = it.batch(BATCH).map(mx.shift_inputs)
    if workers:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return it


def quern_pipeline(mx: Any, path: str, tokenize: Any, seq_len: int, mode: str, cache: str) -> quern.Pipeline:
    src = quern.sources.ArrayRecordSource(path, name="docs")
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle().map(mx.parse_example).map(tokenize)
    packed = pipe.pack(
        {"inputs": seq_len, "targets": seq_len},
        mode=mode,
        num_bins=BATCH if mode == "first_fit" else None,
        cache_dir=cache,
        num_workers=0,
    )
    return packed.batch(BATCH).map_batch(mx.shift_inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    args = ap.parse_args()
    import grain

    common.grain_flags()
    started = common.begin(grain=getattr(grain, "__version__", "?"))
    mx = example()
    with tempfile.TemporaryDirectory(prefix="quern-maxtext-") as tmp:
        path = os.path.join(tmp, "docs.array_record")
        texts = mx.write_corpus(path, "web", args.docs, seed=0)
        tokenize = Truncated(mx.Tokenize(mx.train_tokenizer(texts)), args.seq_len)
        configs: list[tuple[str, Any]] = []
        for workers in (0, 2):
            configs.append((f"grain first_fit, {workers} workers", ("grain", None, workers)))
            for mode in ("first_fit", "best_fit"):
                configs.append((f"quern {mode}, {workers} workers", ("quern", mode, workers)))

        def build(kind: str, mode: str | None, workers: int, cache: str) -> Any:
            if kind == "grain":
                return iter(grain_pipeline(mx, path, tokenize, args.seq_len, workers))
            return quern_pipeline(mx, path, tokenize, args.seq_len, str(mode), cache).iterator(num_workers=workers)

        first: dict[str, list[float]] = {}
        for name, (kind, mode, workers) in configs:
            cache = tempfile.mkdtemp(dir=tmp, prefix="cache-")
            times = []
            for _ in ("cold", "warm"):
                t0 = time.perf_counter()
                it = build(kind, mode, workers, cache)
                next(it)
                times.append(time.perf_counter() - t0)
                common.close(it)
            first[name] = times

        fills: dict[str, float] = {}
        for name, (kind, mode, workers) in configs:
            it = build(kind, mode, workers, os.path.join(tmp, "fills"))
            real = slots = 0
            for _ in range(40):
                b = next(it)
                seg = np.asarray(b["targets_segment_ids"])
                real, slots = real + int((seg > 0).sum()), slots + seg.size
            common.close(it)
            fills[name] = real / slots

        def measure(kind: str, mode: str | None, workers: int) -> tuple[float, float]:
            it = build(kind, mode, workers, os.path.join(tmp, "fills"))
            next(it)
            tokens = [0]

            def one() -> Any:
                b = next(it)
                tokens[0] += int((np.asarray(b["targets_segment_ids"]) > 0).sum())
                return b

            t0 = time.perf_counter()
            batches_per_s = common.rate(one, args.min_seconds)
            elapsed = time.perf_counter() - t0
            common.close(it)
            return batches_per_s * BATCH, tokens[0] / elapsed

        results = common.interleaved(
            [(name, lambda c=cfg: measure(*c)) for name, cfg in configs], args.runs, alternate=True, progress=True
        )
        scale = []  # first_fit's and concat's first batch, cold, over the documents and over 10x as many
        for n in (args.docs, 10 * args.docs):
            big = os.path.join(tmp, f"docs-{n}.array_record")
            mx.write_corpus(big, "web", n, seed=1)
            for mode in ("first_fit", "concat"):
                times = []
                for _ in range(3):
                    cache = tempfile.mkdtemp(dir=tmp, prefix="scale-")
                    t0 = time.perf_counter()
                    it = quern_pipeline(mx, big, tokenize, args.seq_len, mode, cache).iterator()
                    next(it)
                    times.append(time.perf_counter() - t0)
                    common.close(it)
                scale.append((mode, n, statistics.median(times)))
    header = ["config", "rows/s", "real tokens/s", "fill", "first batch cold (s)", "first batch warm (s)"]
    rows = []
    for name, _ in configs:
        rps = statistics.median(r for r, _ in results[name])
        tps = statistics.median(t for _, t in results[name])
        rows.append(
            [name, f"{rps:,.0f}", f"{tps:,.0f}", f"{fills[name]:.3f}", f"{first[name][0]:.2f}", f"{first[name][1]:.2f}"]
        )
    common.print_table(header, rows)
    print()
    print(common.markdown_header(header))
    for row in rows:
        print(common.markdown_row(row))
    print()
    for mode, n, t in scale:
        print(f"quern {mode}, first batch cold over {n:,} documents: {t:.3f} s (median of 3)")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
