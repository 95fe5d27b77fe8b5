"""The load-balanced sampler and batch sampler: Bagua's checks, then what Bagua got wrong, on 1, 2
and 4 replicas (every rank's sampler built here, as each rank would build it)."""

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from autopatch.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


class Lengths(Dataset):
    """Sequences of long-tailed lengths (8 to 512); the sample is its length."""

    def __init__(self, n, seed=0):
        rng = random.Random(seed)
        self.lengths = [min(512, int(8 * rng.paretovariate(1.1))) for _ in range(n)]

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.lengths[i]


def every_rank(dataset, replicas, epoch=0, **kw):
    samplers = [LoadBalancingDistributedSampler(dataset, float, num_replicas=replicas, rank=r, **kw)
                for r in range(replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers], samplers


def test_bagua_sampler_orders_by_complexity_on_one_replica():
    n = 10
    dataset = TensorDataset(torch.randn(n, 2), torch.randperm(n))
    sampler = LoadBalancingDistributedSampler(dataset, lambda x: x[1], num_replicas=1, rank=0, shuffle=False)
    for i, data in enumerate(DataLoader(dataset, batch_size=1, sampler=sampler)):
        assert i == data[1].item()


def test_bagua_batch_sampler_with_growing_batches():
    n = 15
    dataset = TensorDataset(torch.randn(n, 2), torch.randperm(n))

    def batch_fn(indices):
        out, size = [], 1
        while indices:
            out.append(indices[:size])
            indices, size = indices[size:], size + 1
        return out

    sampler = LoadBalancingDistributedSampler(dataset, lambda x: x[1], num_replicas=1, rank=0, shuffle=False)
    batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn=batch_fn)
    cur = 0
    for i, data in enumerate(DataLoader(dataset, batch_sampler=batches)):
        assert data[0].shape[0] == i + 1 and data[1][0].item() == cur
        cur += i + 1


CASES = [(replicas, n, shuffle, drop_last, batch)
         for replicas in (1, 2, 4) for n in (37, 40) for shuffle in (True, False)
         for drop_last in (False, True) for batch in (None, 4)]


@pytest.mark.parametrize("replicas,n,shuffle,drop_last,batch", CASES)
def test_counts_and_coverage_as_distributed_sampler(replicas, n, shuffle, drop_last, batch):
    dataset = Lengths(n)
    got, samplers = every_rank(dataset, replicas, epoch=3, shuffle=shuffle, drop_last=drop_last, batch_size=batch)
    theirs = [DistributedSampler(dataset, replicas, r, shuffle=shuffle, drop_last=drop_last) for r in range(replicas)]
    assert [len(s) for s in samplers] == [len(t) for t in theirs] == [len(g) for g in got]
    seen = sorted(i for g in got for i in g)
    if drop_last:
        assert len(set(seen)) == len(seen) == len(theirs[0]) * replicas   # distinct, none padded
    else:
        assert set(seen) == set(range(n))   # every index, and only padding repeats
        assert len(seen) - n == len(theirs[0]) * replicas - n


@pytest.mark.parametrize("replicas", [2, 4])
def test_deterministic_by_seed_and_epoch(replicas):
    dataset = Lengths(64)
    a, _ = every_rank(dataset, replicas, epoch=1, seed=5)
    b, _ = every_rank(dataset, replicas, epoch=1, seed=5)
    c, _ = every_rank(dataset, replicas, epoch=2, seed=5)
    d, _ = every_rank(dataset, replicas, epoch=1, seed=6)
    assert a == b and a != c and a != d


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("batch", [None, 8])
def test_load_stays_within_the_spread_of_one_step(replicas, batch):
    """Per step, the ranks' loads differ by at most the spread of the step's samples (per
    prefix without a batch size); Bagua gave the last rank the heaviest of every group."""
    dataset = Lengths(400)
    c = dataset.lengths
    got, _ = every_rank(dataset, replicas, epoch=0, batch_size=batch)
    step = batch or 1
    totals = [0] * replicas
    for s in range(0, len(got[0]), step):
        loads = [sum(c[i] for i in g[s:s + step]) for g in got]
        everything = [c[i] for g in got for i in g[s:s + step]]
        if batch:
            assert max(loads) - min(loads) <= max(everything) - min(everything)
        totals = [t + x for t, x in zip(totals, loads)]
        assert max(totals) - min(totals) <= max(c) - min(c)
    assert max(totals) / (sum(totals) / replicas) < 1.02


def test_drop_last_does_not_always_drop_the_heaviest():
    dataset = Lengths(42)
    heaviest = max(range(42), key=dataset.lengths.__getitem__)
    seen_in = [e for e in range(10)
               if heaviest in {i for g in every_rank(dataset, 4, epoch=e, drop_last=True)[0] for i in g}]
    assert len(seen_in) >= 5


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_yields_len_batches_on_every_rank(drop_last):
    dataset = Lengths(101)

    def by_budget(indices, budget=600):
        out, cur, used = [], [], 0
        for i in indices:
            if cur and used + dataset.lengths[i] > budget:
                out.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += dataset.lengths[i]
        return out + ([cur] if cur else [])

    for epoch in range(3):
        samplers = [LoadBalancingDistributedSampler(dataset, float, num_replicas=4, rank=r) for r in range(4)]
        batch_samplers = [LoadBalancingDistributedBatchSampler(s, batch_fn=by_budget, drop_last=drop_last)
                          for s in samplers]
        for s in samplers:
            s.set_epoch(epoch)   # set on the sampler itself: the batches follow
        own = [by_budget(list(s)) for s in samplers]
        expected = min(map(len, own)) if drop_last else max(map(len, own))
        for mine, batches in zip(own, batch_samplers):
            got = list(batches)
            assert len(batches) == len(got) == expected
            assert got[:len(mine)] == mine[:expected]
            assert got[len(mine):] == (mine * 2)[:max(0, expected - len(mine))]   # padding repeats its own


@pytest.mark.parametrize("batch", [None, 8])
def test_no_rank_is_always_the_heaviest(batch):
    """Bagua handed rank n-1 the heaviest sample of every group: the heaviest at every step."""
    dataset = Lengths(400, seed=1)
    c = dataset.lengths
    got, _ = every_rank(dataset, 4, epoch=0, batch_size=batch)
    step = batch or 8
    heaviest = [0] * 4
    for s in range(0, len(got[0]), step):
        loads = [sum(c[i] for i in g[s:s + step]) for g in got]
        if loads.count(max(loads)) == 1:
            heaviest[loads.index(max(loads))] += 1
    assert max(heaviest) < 0.7 * sum(heaviest), heaviest
