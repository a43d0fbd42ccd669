"""A small byte-level language model trained with PyTorch DDP on batches from ``quern.interop.torch``.

The data is the quickstart's (the standard library's ``.py`` files as byte records,
built on first use): shuffled, decoded to bytes and packed (``concat``) into rows of
``CONTEXT + 1`` tokens, a global batch of ``--batch`` rows. ``--world-size`` processes
(the gloo backend on 127.0.0.1, forked here) each train on their rows of every global
batch, ``quern.interop.torch.loader(pipe)`` taking the rank and world size from
``torch.distributed``; DistributedDataParallel averages the gradients.

Every ``--ckpt-every`` steps rank 0 saves the model, the optimizer and the loader's
``state_dict()`` (quern's state: the next step and the pipeline's fingerprint) with
``torch.save`` (``latest.pt``, and ``step-N.pt`` kept); on start ``latest.pt`` is loaded, on any
world size that divides
the batch. Each step prints the loss averaged over the ranks and a digest of the
step's global batch (gathered from the ranks), so a stopped and resumed run can be
checked: on the same world size its losses are bit-equal to an uninterrupted run's,
and on any world size its global batches are.

Run:  python examples/train_torch.py [--world-size 2] [--steps 40] [--ckpt-every 10] [--ckpt-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart  # noqa: E402  (the dataset of the quickstart)

import quern  # noqa: E402
from quern.interop.torch import loader  # noqa: E402

CONTEXT = 32  # tokens the model reads per row; packed rows hold CONTEXT + 1


def make_pipeline(folder: str, batch: int, cache_dir: str) -> quern.Pipeline:
    """Shuffled byte records packed (concat) into rows of ``CONTEXT + 1`` tokens, ``batch`` rows a step."""
    source = quern.sources.ArrayRecordSource(folder)
    return (
        quern.Pipeline.from_source(source, seed=2026)
        .shuffle()
        .map(quern.transforms.decode(np.uint8))
        .pack(CONTEXT + 1, mode="concat", cache_dir=cache_dir)
        .batch(batch)
    )


class ByteMLP(nn.Module):
    """Next-byte logits from the previous four bytes' embeddings (a small MLP language model)."""

    def __init__(self, width: int = 64, window: int = 4) -> None:
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(256, width)
        self.mlp = nn.Sequential(nn.Linear(window * width, 128), nn.GELU(), nn.Linear(128, 256))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (rows, CONTEXT, width)
        padded = nn.functional.pad(x, (0, 0, self.window - 1, 0))
        windows = torch.cat([padded[:, k : k + tokens.shape[1]] for k in range(self.window)], dim=-1)
        return self.mlp(windows)


def digest(batch: torch.Tensor) -> str:
    """A short hash of a step's global batch of tokens (its bytes, row by row)."""
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]


def train(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank's training loop."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    pipe = make_pipeline(args.folder, args.batch, os.path.join(args.data, "quern_cache"))
    model = ByteMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = loader(pipe)  # rank and world size from torch.distributed
    path = os.path.join(args.ckpt_dir, "latest.pt")
    if os.path.exists(path):
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        batches.load_state_dict(saved["data"])  # refused if the pipeline changed
        if rank == 0:
            print(f"resumed from checkpoint at step {saved['data']['step']} on {world} process(es)", flush=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    step, stream = batches.step, iter(batches)
    while step < args.steps:  # a batch is taken only for a step that trains
        batch = next(stream)
        tokens = batch["tokens"].long()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        loss = nn.functional.cross_entropy(ddp(inputs).reshape(-1, 256), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        parts = [torch.empty_like(batch["tokens"]) for _ in range(world)]
        dist.all_gather(parts, batch["tokens"].contiguous())
        step += 1
        if rank == 0:
            print(f"step {step - 1} loss {float(mean) / world!r} batch {digest(torch.cat(parts))}", flush=True)
        if step % args.ckpt_every == 0:
            if rank == 0:
                os.makedirs(args.ckpt_dir, exist_ok=True)
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "data": batches.state_dict()}
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
                shutil.copyfile(path, os.path.join(args.ckpt_dir, f"step-{step}.pt"))  # each kept, to resume from
                print(f"checkpoint saved at step {step}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(here, "data"), help="dataset folder (built on first use)")
    ap.add_argument("--ckpt-dir", default=os.path.join(here, "data", "train_torch_ckpt"))
    ap.add_argument("--world-size", type=int, default=2, help="processes (gloo on 127.0.0.1)")
    ap.add_argument("--steps", type=int, default=40, help="train until this step")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="global batch size (packed rows)")
    args = ap.parse_args(argv)
    args.folder, _ = quickstart.build_dataset(args.data)  # once, before the processes start
    # fork: the ranks start with torch and quern already imported (nothing here has touched CUDA)
    mp.start_processes(train, args=(args.world_size, free_port(), args), nprocs=args.world_size, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
