"""One rank of the two-rank data tests: ``python data_worker.py SUITE RANK INIT_FILE OUT``.

``zero_code``: the data patches with the Redis backend and balancing, installed before the
program builds its DataLoader over a DistributedSampler, as an unchanged script would run.
Saves each epoch's indices, the Redis servers' URLs, what the store holds, and the report.

``agreement``: what each rank would decide differently on its own: sample lengths drawn from a
generator seeded by the rank (scores differ), and a dataset that loads slowly on rank 0 only
(whether the cache pays differs). Saves each epoch's indices and the report.

``two_nodes``: each rank a node of its own (``LOCAL_WORLD_SIZE=1``) whose other nodes reach it by
this machine's first non-loopback address (``MASTER_ADDR``): each rank starts its node's Redis
server and saves whether it answers on that address and on 127.0.0.1."""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from autopatch.data.store.node_servers import KEY, node_server_urls
from autopatch.data.zero_code.patches import DataPatches
from data_fixtures import Features

SUITE, RANK, INIT_FILE, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


class Sequences(Features):
    """Sample i: (a sequence whose length follows a long tail, its index)."""

    def __getitem__(self, i):
        x, _ = super().__getitem__(i)
        return torch.zeros(4 + (i * 37) % 29 + (60 if i % 11 == 0 else 0)), i


def zero_code():
    patches = DataPatches(cache="redis", capacity=32 << 20, balance="len")
    patches.install()
    dataset = Sequences(40, load_seconds=0.005)   # slow enough that Redis pays even on a busy machine
    sampler = DistributedSampler(dataset, seed=3)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1,
                        collate_fn=lambda batch: [i for _, i in batch])
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)   # on the user's own sampler object
        epochs.append([i for batch in loader for i in batch])
    report = patches.describe()
    patches.uninstall()
    from autopatch.torch_internals import default_store
    return {"epochs": epochs, "urls": node_server_urls(), "report": report,
            "sampler": type(loader.sampler).__name__, "published": default_store().get(KEY.format(0)).decode()}


class RankLengths(Features):
    """Sample i: a sequence whose length is drawn from a generator seeded by the rank."""

    def __init__(self, n):
        super().__init__(n, load_seconds=0)
        self.generator = torch.Generator().manual_seed(100 + RANK)

    def __getitem__(self, i):
        return torch.zeros(1 + int(torch.randint(0, 50, (1,), generator=self.generator))), i


def agreement():
    patches = DataPatches(cache="local", path=CACHE_DIR, balance="len")
    patches.install()
    slow_here = Features(32, load_seconds=0.004 if RANK == 0 else 0.0)
    cached = DataLoader(slow_here, batch_size=4)
    dataset = RankLengths(40)
    sampler = DistributedSampler(dataset, seed=5)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=lambda batch: [i for _, i in batch])
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([i for batch in loader for i in batch])
    report = patches.describe()
    patches.uninstall()
    return {"epochs": epochs, "report": report, "cached_type": type(cached.dataset).__name__}


def machine_address():
    """The address of the interface holding the default route (no packet is sent)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 1))
        return s.getsockname()[0]


def two_nodes():
    import redis
    from autopatch.data.store.node_servers import started_server
    urls = node_server_urls(capacity=16 << 20)
    server = started_server()
    answers = {}
    for host in (machine_address(), "127.0.0.1"):
        try:
            answers[host] = redis.Redis(host=host, port=server.port, password=server.password,
                                        socket_connect_timeout=2).ping()
        except redis.ConnectionError as e:
            answers[host] = f"refused: {e}"
    return {"urls": urls, "port": server.port, "answers": answers}


if __name__ == "__main__":
    import os
    if SUITE == "two_nodes":
        os.environ.update(RANK=str(RANK), LOCAL_WORLD_SIZE="1", MASTER_ADDR=machine_address())
    CACHE_DIR = os.path.join(os.path.dirname(OUT), "cache")
    dist.init_process_group("gloo", init_method=f"file://{INIT_FILE}", rank=RANK, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    result = {"zero_code": zero_code, "agreement": agreement, "two_nodes": two_nodes}[SUITE]()
    dist.barrier()
    torch.save(result, OUT)
    dist.destroy_process_group()
