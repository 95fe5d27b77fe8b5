"""An unchanged DDP training script, as a user who outgrows one machine runs it under torchrun on
two nodes; autopatch is switched on from outside (FUSEDOPT_ENABLE, FUSEDOPT_POLICY,
FUSEDOPT_DATA_CACHE, FUSEDOPT_REPORT). Its dataset takes a few milliseconds a sample, so the
sample cache pays. Each rank writes its losses next to its report."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SlowFeatures(Dataset):
    """Features that take a while to compute, the same every time for the same index."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.003)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), i % 4


def main(out):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = SlowFeatures()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    losses, started = [], time.perf_counter()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    with open(os.path.join(out, f"losses-{dist.get_rank()}.json"), "w") as f:
        json.dump({"losses": losses, "seconds": time.perf_counter() - started}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
