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


def sample_bytes(i, version=0, width=6):
    """What file-backed datasets hold for sample i: ``width`` float32 values of Features'."""
    return Features(i + 1, width, version, 0)[i][0].numpy().tobytes()


def write_samples(root, n, version=0, name="sample_{i}.bin"):
    """``n`` sample files under ``root``; their paths."""
    paths = []
    for i in range(n):
        path = root / name.format(i=i, c=i % 3)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(sample_bytes(i, version))
        paths.append(path)
    return paths


class Files(Features):
    """Sample i's values are read from ``root/sample_{i}.bin`` (its label is Features'): the
    dataset names its directory only."""

    def __init__(self, root, n, load_seconds=LOAD_SECONDS):
        super().__init__(n, load_seconds=load_seconds)
        self.root = root

    def __getitem__(self, i):
        _, label = super().__getitem__(i)
        with open(f"{self.root}/sample_{i}.bin", "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.float32), label


class Folder(Dataset):
    """torchvision's folder datasets as the cache sees them: ``samples`` and ``imgs`` list
    ``(path, class)`` pairs found under class directories, and no other attribute names a file."""

    def __init__(self, root, load_seconds=LOAD_SECONDS):
        import os
        self.classes = sorted(os.listdir(root))
        self.samples = sorted((os.path.join(root, c, f), k) for k, c in enumerate(self.classes)
                              for f in os.listdir(os.path.join(root, c)))
        self.imgs, self.load_seconds = self.samples, load_seconds

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        busy(self.load_seconds)
        path, target = self.samples[i]
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.float32), target


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on 127.0.0.1, started for these tests and stopped after them."""
    from autopatch.data.store.redis_server import RedisServer
    server = RedisServer(capacity=64 << 20)
    yield server
    server.stop()


class ThreadSensitive(Features):
    """A deterministic dataset whose samples depend on torch's thread count, as real ones do: a
    float32 sum over 128k values is split, and so rounded, by the number of threads."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        g = torch.Generator().manual_seed(i)
        return torch.cat([x, torch.randn(1 << 17, generator=g).sum().reshape(1)]), y


class OwnGenerator(Features):
    """Random augmentation from a generator the dataset owns: the probe must not advance it."""

    def __init__(self, n=48, **kw):
        super().__init__(n, **kw)
        self.generator = torch.Generator().manual_seed(123)

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.rand(self.width, generator=self.generator), y


class Patched(Features):
    """Version ``version`` everywhere but at the indices of ``base``, which keep version 0: two
    versions that share the samples a signature looks at and differ everywhere else."""

    def __init__(self, n=48, base=(), **kw):
        super().__init__(n, **kw)
        self.base = set(base)

    def __getitem__(self, i):
        if i in self.base:
            return Features(self.n, self.width, 0, self.load_seconds)[i]
        return super().__getitem__(i)


def run_job(out, *options, cache=None, timeout=120, inside=None, **env):
    """Run ``data_job.py`` (see there) unpatched, or zero-code with ``FUSEDOPT_DATA_CACHE=cache``
    and the local store in ``env``'s policy; its saved batches and report. ``inside``: a shell
    line that ends by running the command it is given as ``"$@"`` (a mount namespace...)."""
    import subprocess
    import sys
    from spawn import SUPPORT, clean_env, patience
    extra = {"OMP_NUM_THREADS": 1, **env}
    if cache is not None:
        extra.update(FUSEDOPT_ENABLE=1, FUSEDOPT_DATA_CACHE=cache)
    command = [sys.executable, str(SUPPORT / "data_job.py"), str(out), *map(str, options)]
    if inside is not None:
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", inside, "job", *command]
    done = subprocess.run(command, env=clean_env(**extra), capture_output=True, text=True, timeout=patience(timeout))
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out, weights_only=False)


def same_batches(a, b):
    """True when two runs' saved epochs hold equal batches, bit for bit."""
    if len(a["epochs"]) != len(b["epochs"]):
        return False
    for ea, eb in zip(a["epochs"], b["epochs"]):
        if len(ea) != len(eb):
            return False
        for (xa, ya), (xb, yb) in zip(ea, eb):
            if not (torch.equal(xa, xb) and torch.equal(ya, yb)):
                return False
    return True


def policy_for(tmp_path, cache_dir, name="cache.yaml"):
    """A policy file that puts the local store in ``cache_dir``."""
    path = tmp_path / name
    path.write_text(f"data:\n  cache:\n    path: {cache_dir}\n")
    return path
