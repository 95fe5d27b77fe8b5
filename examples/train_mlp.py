"""A plain PyTorch training script: a deep residual MLP learning to classify points drawn around
ten centres, with AdamW and a cosine schedule.

Nothing here knows about autopatch. Run it as is, or zero-code with autopatch:

    FUSEDOPT_ENABLE=1 python examples/train_mlp.py
"""

import argparse
import time

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual: deep stacks of these still train (a plain 48-layer MLP would not)."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(nn.functional.gelu(self.norm(x)))


def build_model(width, depth, classes=10):
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, classes))


def make_task(width, n, classes=10, spread=2.5, seed=1):
    """Points around ``classes`` random centres in ``width`` dimensions: learnable, not trivially."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, width, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + spread * torch.randn(n, width, generator=g), y


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
    x, y = make_task(args.width, 4096 + 1024)
    (x, test_x), (y, test_y) = x.split([4096, 1024]), y.split([4096, 1024])

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
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.steps} steps, {len(list(model.parameters()))} tensors ({n_params} weights) "
          f"in {seconds:.2f} s; test accuracy {100 * accuracy:.1f}%")


if __name__ == "__main__":
    main()
