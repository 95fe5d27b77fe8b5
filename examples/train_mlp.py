"""A plain PyTorch training script: a deep MLP on synthetic data with AdamW and a cosine schedule.

Nothing here knows about autopatch. Run it as is, or zero-code with autopatch:

    FUSEDOPT_ENABLE=1 python examples/train_mlp.py
"""

import argparse
import time

import torch
from torch import nn


def build_model(width, depth):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=48)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    model = build_model(args.width, args.depth)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    x = torch.randn(args.batch * 8, args.width)
    y = torch.randint(0, 10, (args.batch * 8,))

    start = time.perf_counter()
    for step in range(args.steps):
        i = (step * args.batch) % len(x)
        loss = nn.functional.cross_entropy(model(x[i:i + args.batch]), y[i:i + args.batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.6f}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.steps} steps, {len(list(model.parameters()))} tensors ({n_params} weights) "
          f"in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
