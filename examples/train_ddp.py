"""A plain DistributedDataParallel training script: the residual MLP of train_mlp.py on every rank
of a CPU job (gloo), AdamW with weight decay, each rank drawing its own batches.

Nothing here knows about autopatch. Run it under torchrun as is, or zero-code with autopatch, here
holding a 1/N share of AdamW's state on each rank:

    torchrun --nproc_per_node=2 examples/train_ddp.py
    FUSEDOPT_ENABLE=1 FUSEDOPT_SHARD=1 torchrun --nproc_per_node=2 examples/train_ddp.py

Both print the same losses and the same digest of the final weights.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn

from train_mlp import build_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=16)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    centres = torch.randn(10, args.width) * 2
    model = nn.parallel.DistributedDataParallel(build_model(args.width, args.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        y = torch.randint(0, 10, (64,), generator=g)
        x = centres[y] + torch.randn(64, args.width, generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    if rank == 0:
        print(f"weights {digest[:16]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
