"""How batches come back from worker processes: lent slots vs copying out once.

With ``num_workers > 0`` quern's workers write each batch into a shared-memory
slot. By default the parent *lends* the slot: the batch's arrays are views into
it, and the slot goes back to its worker once no array of the batch is alive.
The alternative (``pipe.iterator(..., copy_batches=True)``, which
exists only for this measurement) copies each batch out of its slot once.

Two pipelines over in-memory ids (so that reading costs nothing and the
hand-over is what is measured), 2 workers each, each config timed for
``--seconds`` after its workers have started and 20 warm-up batches:

* tokens: 256 rows x 512 int32 (512 KiB per batch), like ``vs_grain.py``;
* images: 64 rows x 224 x 224 x 3 uint8 (9.2 MiB per batch).

Reports batches/s and MiB/s for each, and lend / copy. Run:

    .venv/bin/python benchmarks/handover.py [--seconds 5]
"""

from __future__ import annotations

import argparse

import common
import numpy as np

import quern


def tokens(batch: dict) -> dict:
    """256 x 512 int32 tokens made from the ids (512 KiB)."""
    return {"tokens": (batch["id"][:, None] + np.arange(512)).astype(np.int32)}


def images(batch: dict) -> dict:
    """64 RGB 224 x 224 images made from the ids (9.2 MiB)."""
    shape = (len(batch["id"]), 224, 224, 3)
    return {"image": np.broadcast_to(batch["id"].astype(np.uint8)[:, None, None, None], shape).copy()}


def rate(pipe: quern.Pipeline, copy: bool, seconds: float) -> float:
    """Batches per second from 2 workers, lending (``copy=False``) or copying out."""
    with common.started(quern.PipelineIterator(pipe, num_workers=2, copy_batches=copy)) as it:
        for _ in range(20):
            next(it)
        return common.rate(it.__next__, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="timed seconds per config (default 5)")
    args = ap.parse_args()
    ids = {"id": np.arange(100_000, dtype=np.int64)}
    cases = [
        ("tokens 256 x 512 int32", quern.Pipeline.from_source(ids, seed=0).shuffle().batch(256).map_batch(tokens)),
        ("images 64 x 224x224x3 uint8", quern.Pipeline.from_source(ids, seed=0).shuffle().batch(64).map_batch(images)),
    ]
    rows = []
    for name, pipe in cases:
        mib = sum(a.nbytes for a in pipe.batch_at(0).values()) / 2**20
        lend, copy = rate(pipe, False, args.seconds), rate(pipe, True, args.seconds)
        rows.append([name, f"{lend:.1f}", f"{copy:.1f}", f"{lend * mib:.0f}", common.ratio(lend, copy)])
    common.print_table(["batches", "lend: batches/s", "copy: batches/s", "lend MiB/s", "lend / copy"], rows)


if __name__ == "__main__":
    main()
