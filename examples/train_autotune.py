"""A plain PyTorch training script: a deep MLP fed by a DataLoader, trained with AdamW.

Nothing here knows about autopatch. Let autopatch search its settings while it trains, zero-code:

    FUSEDOPT_ENABLE=1 FUSEDOPT_POLICY=autotune FUSEDOPT_LOGDIR=runs/autotune \\
        python examples/train_autotune.py
    tensorboard --logdir runs/autotune      # the "autopatch" tab shows the search

or with Bagua's flags: ``autopatch run --autotune_level 1 --is_output_autotune_log
examples/train_autotune.py``. The DataLoader's batch size makes the score samples/s.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from train_mlp import build_model   # the same model as the main example


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = build_model(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data = TensorDataset(torch.randn(args.batch * 64, args.width), torch.randint(0, 10, (args.batch * 64,)))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)

    start, step = time.perf_counter(), 0
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 500 == 0 or step == args.steps:
                print(f"step {step:5d}  loss {loss.item():.4f}  {step / (time.perf_counter() - start):.0f} steps/s")
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
