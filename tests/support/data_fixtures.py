"""Datasets and Redis servers that the data tests share (importable by DataLoader workers and
by the scripts the tests run)."""

import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

LOAD_SECONDS = 0.001   # each sample costs real CPU time, so that the cache pays


def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Features(Dataset):
    """A deterministic dataset: sample i is a fixed function of i (and of ``version``)."""

    def __init__(self, n=48, width=6, version=0, load_seconds=LOAD_SECONDS):
        self.n, self.width, self.version, self.load_seconds = n, width, version, load_seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        busy(self.load_seconds)
        g = torch.Generator().manual_seed(1000 * self.version + i)
        return torch.randn(self.width, generator=g), i % 3


class TorchAugmented(Features):
    """Random augmentation from torch's global generator: caching would freeze it."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.rand(self.width), y


class NumpyAugmented(Features):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x * float(np.random.uniform(0.9, 1.1)), y


class PythonAugmented(Features):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (x.flip(0) if random.random() < 0.5 else x), y


class Stream(IterableDataset):
    def __iter__(self):
        return iter(Features(8))


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on 127.0.0.1, started for these tests and stopped after them."""
    from autopatch.data.redis_server import RedisServer
    server = RedisServer(capacity=64 << 20)
    yield server
    server.stop()
