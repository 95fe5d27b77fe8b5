"""The sample cache: Bagua's checks on both backends, the stores, DataLoader workers sharing the
node-local store, a changed dataset never served an older version's samples, and a Redis server
that dies mid-epoch."""

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from autopatch.data import CachedDataset, CacheLoader, LocalStore, RedisStore
from autopatch.data.store.redis_server import RedisServer
from data_fixtures import Features, redis_server  # noqa: F401,F811 (a fixture)


class BaguaDataset(Dataset):
    """Bagua's test dataset: random arrays made once, returned as they are."""

    def __init__(self, size):
        self.dataset = [(np.random.rand(5, 2), np.random.rand(1)) for _ in range(size)]

    def __getitem__(self, item):
        return self.dataset[item]

    def __len__(self):
        return len(self.dataset)


def backend_options(kind, tmp_path, server):
    return {"backend": "local", "path": tmp_path / "cache"} if kind == "local" else \
        {"backend": "redis", "hosts": [server.url]}


def passes_then_compare(dataset, cached, passes=10):
    for _ in range(passes):
        for _ in cached:
            pass
    for i in range(len(dataset)):
        assert (dataset[i][0] == cached[i][0]).all() and (dataset[i][1] == cached[i][1]).all()


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_bagua_two_datasets_share_a_store(kind, tmp_path, redis_server):  # noqa: F811
    options = backend_options(kind, tmp_path, redis_server)
    d1, d2 = BaguaDataset(102), BaguaDataset(102)
    c1 = CachedDataset(d1, dataset_name="d1", **options)
    c2 = CachedDataset(d2, dataset_name="d2", **options)
    c1.cache_loader.store.clear()

    passes_then_compare(d1, c1)
    c1.cache_loader.flush()
    assert c1.cache_loader.num_keys() == 102
    passes_then_compare(d2, c2)
    c2.cache_loader.flush()
    assert c2.cache_loader.num_keys() == 204
    figures = c1.describe()
    assert figures["misses"] == 102 and figures["hits"] == 10 * 102 - 102 + 2 * 102 and figures["errors"] == 0


def check_store(store):
    """Bagua's store test: set, mset, get, mget, num_keys and status."""
    store.clear()
    assert store.num_keys() == 0
    data = [np.random.rand(10) for _ in range(5)]
    store.set("1", pickle.dumps(data[1]))
    store.mset({"2": pickle.dumps(data[2]), "3": pickle.dumps(data[3]), "4": pickle.dumps(data[4])})
    got = store.mget(["1", "2", "5"])
    assert (pickle.loads(got[0]) == data[1]).all() and (pickle.loads(got[1]) == data[2]).all()
    assert got[2] is None
    assert (pickle.loads(store.get("4")) == data[4]).all() and store.get("6") is None
    assert store.num_keys() == 4
    assert store.status()


def test_store_on_one_redis_server(redis_server):  # noqa: F811
    check_store(RedisStore(hosts=[redis_server.url], cluster_mode=False))


def test_store_sharded_over_three_redis_servers():
    servers = [RedisServer(capacity=16 << 20) for _ in range(3)]
    try:
        store = RedisStore(hosts=[s.url for s in servers], cluster_mode=True)
        check_store(store)
        store.mset({f"k{i}": b"v" for i in range(60)})
        shares = [s.num_keys() for s in store.stores]
        assert sum(shares) == 64 and min(shares) > 0, shares   # every server holds a share
    finally:
        for s in servers:
            s.stop()


def test_store_on_the_local_directory(tmp_path):
    check_store(LocalStore(path=tmp_path / "cache"))


def test_redis_server_per_node_started_without_process_group():
    """hosts=None: this process is local rank 0 of a one-node run, so it starts the server."""
    from autopatch.data.store.node_servers import started_server
    store = RedisStore(hosts=None, capacity_per_node=16 << 20)
    check_store(store)
    assert started_server() is not None and started_server().alive()


def test_local_store_evicts_when_full(tmp_path):
    store = LocalStore(path=tmp_path / "small", capacity=1 << 20)
    for i in range(40):
        store.mset({f"k{i}-{j}": bytes(4000) for j in range(10)})   # 1.6 MB into a 1 MiB map
    assert 0 < store.num_keys() < 400


def test_cache_loader_get_and_buffered_writes(tmp_path):
    loader = CacheLoader("local", "numbers", writer_buffer_size=5, path=tmp_path / "cache")
    loader.writes.max_age = 600   # (a second-old write would go by itself: write_buffer)
    loader.store.clear()
    calls = []
    assert [loader.get(k, lambda k: calls.append(k) or k * k) for k in range(7)] == [k * k for k in range(7)]
    assert loader.store.num_keys() == 5   # one mset of 5; two still buffered
    assert [loader.get(k, lambda k: calls.append(k)) for k in range(7)] == [k * k for k in range(7)]
    assert calls == list(range(7))
    assert loader.num_keys() == 7   # what waits is sent before counting


def test_workers_share_the_local_store_and_report_their_counts(tmp_path):
    dataset = Features(48)
    cached = CachedDataset(dataset, dataset_name="features", path=tmp_path / "cache", writer_buffer_size=4)
    loader = DataLoader(cached, batch_size=6, num_workers=2)
    first = [b for b in loader]
    assert cached.cache_loader.num_keys() == 48   # written by the workers, seen here
    second = [b for b in loader]
    plain = list(DataLoader(dataset, batch_size=6))
    for a, b, c in zip(first, second, plain):
        assert torch.equal(a[0], c[0]) and torch.equal(b[0], c[0]) and torch.equal(b[1], c[1])
    figures = cached.describe()
    # the signature's four loads are not counted; every other sample went through the workers
    assert (figures["misses"], figures["hits"], figures["errors"]) == (48, 48, 0), figures


def test_a_changed_dataset_is_never_served_an_older_version(tmp_path):
    old = CachedDataset(Features(16, version=1), dataset_name="same", path=tmp_path / "cache")
    [old[i] for i in range(16)]
    old.cache_loader.flush()
    new_dataset = Features(16, version=2)
    new = CachedDataset(new_dataset, dataset_name="same", path=tmp_path / "cache")
    for i in range(16):
        assert torch.equal(new[i][0], new_dataset[i][0])
    assert new.describe()["misses"] == 16 and new.describe()["hits"] == 0
    again = CachedDataset(Features(16, version=2), dataset_name="same", path=tmp_path / "cache")
    new.cache_loader.flush()
    [again[i] for i in range(16)]
    assert again.describe()["hits"] == 16   # the same version reads what the other wrote


def test_redis_killed_mid_epoch_degrades_to_loading(tmp_path):
    server = RedisServer(capacity=16 << 20)
    dataset = Features(64)
    cached = CachedDataset(dataset, backend=server.url, dataset_name="dies", writer_buffer_size=4)
    loader = DataLoader(cached, batch_size=4, num_workers=2)
    list(loader)   # the first epoch fills the cache
    batches = []
    for b in loader:
        if not batches:
            server.kill()
        batches.append(b)
    plain = list(DataLoader(dataset, batch_size=4))
    assert len(batches) == len(plain)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, plain))
    figures = cached.describe()
    assert figures["errors"] >= 1 and "Connection" in figures["last_error"], figures
    assert figures["hits"] + figures["misses"] == 128
