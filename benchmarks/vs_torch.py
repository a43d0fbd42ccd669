"""quern in PyTorch and grain: records/s, time to the first batch, and time to resume at step 10^6.

The files and the transform of ``benchmarks/vs_grain.py`` (``--records`` int32 records of
64-512 tokens in 8 ArrayRecord shards; shuffle, decode, pad to 512, batches of 256):

* ``quern.interop.torch.loader(pipe)`` with 0 and 2 quern worker processes;
* a ``torch.utils.data.Dataset`` of the same files (one ``ArrayRecordReader`` per file and
  worker; ``__getitems__`` reads a batch's records with one call per file) in torch's
  ``DataLoader(batch_size=256, shuffle=True, num_workers=2, prefetch_factor=4,
  persistent_workers=True)``;
* the same in torchdata's ``StatefulDataLoader`` (when torchdata is installed);
* quern inside grain: ``quern.interop.grain.map_dataset(pipe).to_iter_dataset()``.

Each: a fresh loader, the first batch timed (*first batch*), 2 more untimed, then
at least ``--min-seconds``; ``--runs`` rounds, configs in turn, the median. *Resume at
step 10^6*: quern's loaders and grain's iterator are built at that step (the next batch
timed); torch's ``DataLoader`` has no state, and ``StatefulDataLoader`` restores its
sampler by drawing the indices of every batch before it: their figure is the time to
draw 10^4 batches of indices, times 100 (labelled extrapolated).

Run:  python benchmarks/vs_torch.py  [--records 100000] [--runs 3] [--min-seconds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import vs_grain  # noqa: E402  (the same files and transform)

import quern  # noqa: E402

RESUME_AT = 10**6


class ArrayRecordDataset:
    """A torch map-style dataset of the ArrayRecord files: ``decode_pad`` records, bulk-read by ``__getitems__``."""

    def __init__(self, paths: list[str]) -> None:
        from array_record.python import array_record_module

        self.paths = paths
        counts = []
        for p in paths:
            r = array_record_module.ArrayRecordReader(p, "readahead_buffer_size:0")
            counts.append(r.num_records())
            r.close()
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._readers: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _reader(self, f: int) -> Any:
        from array_record.python import array_record_module

        if f not in self._readers:  # opened in each worker process
            self._readers[f] = array_record_module.ArrayRecordReader(
                self.paths[f], "readahead_buffer_size:0,max_parallelism:0"
            )
        return self._readers[f]

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, ids: list[int]) -> list[dict]:
        ids_ = np.asarray(ids, dtype=np.int64)
        files = np.searchsorted(self.starts, ids_, side="right") - 1
        out: list[Any] = [None] * len(ids_)
        for f in np.unique(files).tolist():
            where = np.flatnonzero(files == f)
            for k, rec in zip(where.tolist(), self._reader(f).read((ids_[where] - self.starts[f]).tolist())):
                out[k] = vs_grain.decode_pad(rec)
        return out

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_readers": {}}


def torch_loader(paths: list[str], stateful: bool) -> Any:
    import torch

    kind: Any = torch.utils.data.DataLoader
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        kind = StatefulDataLoader
    gen = torch.Generator().manual_seed(0)
    return kind(
        ArrayRecordDataset(paths),
        batch_size=vs_grain.BATCH,
        shuffle=True,
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=True,
        generator=gen,
        drop_last=True,
    )


def forever(dl: Any) -> Any:
    """Epoch after epoch of a torch loader (a quern pipeline is endless; so is this)."""
    while True:
        yield from dl


def quern_pipeline(paths: list[str]) -> quern.Pipeline:
    return vs_grain.quern_pipeline(paths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    args = common.parse_args(ap)
    assert args is not None
    import grain
    import torch

    from quern.interop.grain import map_dataset
    from quern.interop.torch import loader

    try:
        import torchdata  # noqa: F401

        have_torchdata = True
    except ImportError:
        have_torchdata = False
    common.grain_flags()
    started = common.begin(torch=torch.__version__, grain=getattr(grain, "__version__", "?"))
    paths = vs_grain.make_data(args.records)
    common.warm_page_cache(paths)
    pipe = quern_pipeline(paths)

    def make(name: str, start: int = 0) -> Any:
        if name == "quern loader, 0 workers":
            return iter(loader(pipe, start_step=start))
        if name == "quern loader, 2 workers":
            return iter(loader(pipe, num_workers=2, start_step=start))
        if name == "quern inside grain (map_dataset)":
            it = iter(map_dataset(pipe).to_iter_dataset(grain.ReadOptions(num_threads=0)))
            if start:
                state = it.get_state()
                state["next_index"] = start
                it.set_state(state)
            return it
        return forever(torch_loader(paths, stateful=name.startswith("torchdata")))

    names = ["quern loader, 0 workers", "quern loader, 2 workers", "quern inside grain (map_dataset)"]
    names += ["torch DataLoader, 2 workers"] + (["torchdata StatefulDataLoader, 2 workers"] if have_torchdata else [])
    first: dict[str, list[float]] = {n: [] for n in names}

    def run(name: str) -> float:
        t0 = time.perf_counter()
        it = make(name)
        next(it)
        first[name].append(time.perf_counter() - t0)
        next(it)
        next(it)
        r = common.rate(it.__next__, args.min_seconds) * vs_grain.BATCH
        common.close(it)
        return r

    results = common.interleaved([(n, lambda n=n: run(n)) for n in names], args.runs, alternate=True, progress=True)
    resume: dict[str, str] = {}
    for name in names[:3]:
        t0 = time.perf_counter()
        it = make(name, RESUME_AT)
        batch = next(it)
        resume[name] = f"{time.perf_counter() - t0:.3f} s"
        want = pipe.batch_at(RESUME_AT)["tokens"]
        got = np.asarray(batch["tokens"])
        assert np.array_equal(got, want), name  # the batch of step 10^6, not another
        del it
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(range(args.records), generator=torch.Generator().manual_seed(0)),
        vs_grain.BATCH,
        drop_last=True,
    )
    t0, n, draws = time.perf_counter(), 0, iter(sampler)
    while n < 10_000:
        try:
            next(draws)
        except StopIteration:
            draws = iter(sampler)
        n += 1
    skip = (time.perf_counter() - t0) * (RESUME_AT / 10_000)
    for name in names[3:]:
        resume[name] = f"{skip:.1f} s (extrapolated: drawing the indices of 10^6 batches)"
    header = ["config", "records/s", "first batch (s)", "resume at step 10^6"]
    rows = []
    for name in names:
        rows.append(
            [
                name,
                f"{statistics.median(results[name]):,.0f}",
                f"{statistics.median(first[name]):.3f}",
                resume[name],
            ]
        )
    common.print_table(header, rows)
    print()
    print(common.markdown_header(header))
    for row in rows:
        print(common.markdown_row(row))
    if not have_torchdata:
        print("torchdata not installed: StatefulDataLoader not measured (pip install torchdata)")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
