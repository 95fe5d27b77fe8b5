"""One rank of the two-rank data tests: ``python data_worker.py SUITE RANK INIT_FILE OUT``.

``zero_code``: the data patches with the Redis backend and balancing, installed before the
program builds its DataLoader over a DistributedSampler, as an unchanged script would run.
Saves each epoch's indices, the Redis servers' URLs and the report."""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from autopatch.data.node_servers import node_server_urls
from autopatch.data.patches import DataPatches
from autopatch.patching import Ledger
from data_fixtures import Features

SUITE, RANK, INIT_FILE, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


class Sequences(Features):
    """Sample i: (a sequence whose length follows a long tail, its index)."""

    def __getitem__(self, i):
        x, _ = super().__getitem__(i)
        return torch.zeros(4 + (i * 37) % 29 + (60 if i % 11 == 0 else 0)), i


def zero_code():
    ledger = Ledger()
    patches = DataPatches(cache="redis", capacity=32 << 20, balance="len")
    patches.install(ledger)
    dataset = Sequences(40, load_seconds=0.005)   # slow enough that Redis pays even on a busy machine
    sampler = DistributedSampler(dataset, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1,
                        collate_fn=lambda batch: [i for _, i in batch])
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)   # on the user's own sampler object
        epochs.append([i for batch in loader for i in batch])
    report = patches.describe()
    ledger.uninstall()
    return {"epochs": epochs, "urls": node_server_urls(), "report": report,
            "sampler": type(loader.sampler).__name__}


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"file://{INIT_FILE}", rank=RANK, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    result = {"zero_code": zero_code}[SUITE]()
    dist.barrier()
    torch.save(result, OUT)
    dist.destroy_process_group()
