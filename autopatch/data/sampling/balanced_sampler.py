"""Bagua's ``LoadBalancingDistributedSampler``: each rank the same number of samples, and at each
position (each step) samples of about the same complexity on every rank.

Every sample is scored once. Each epoch, the dataset is ordered as DistributedSampler orders it
(a permutation seeded by ``seed + epoch``, or index order without ``shuffle``), padded or cut the
same way, sorted by complexity (plus noise scaled by ``random_level``), and cut into groups of
``num_replicas`` neighbours: one sample of each group per rank. Bagua's defects are gone:

- Bagua gave rank r the r-th lightest of every group, so the last rank always got the heaviest;
  here each group's heaviest goes to the rank with the least load so far (within a step when
  ``batch_size`` is known), so every rank's load stays within one group's spread of the others'.
- With ``drop_last`` Bagua dropped the heaviest samples every epoch; here the dropped samples are
  DistributedSampler's: the tail of the epoch's permutation (the last indices without shuffle).
- Ties in complexity are broken by the epoch's permutation, so groups change between epochs.

``batch_size`` (an addition): when given, samples are grouped by step as well, like transformers'
DistributedLengthGroupedSampler: the epoch's permutation is cut into blocks of 50 steps, each
block sorted by complexity and cut into steps of similar samples, steps shuffled inside the
block. Batches padded to their longest sample then waste little, on every rank alike.
"""

import math

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..looking.rng_states import seeded
from ..looking.side_copy import looking_at

__all__ = ["LoadBalancingDistributedSampler", "score_samples"]

STEPS_PER_BLOCK = 50


def score_samples(dataset, complexity_fn, seed=0):
    """``complexity_fn`` of every sample, in index order, loaded under fixed seeds from a shallow
    copy (every global generator, and the dataset's own, restored afterwards: ``side_copy``).
    Ranks may still score differently (a dataset seeded per rank): the zero-code path agrees on
    one set of scores (``agreed_scores``)."""
    with seeded(seed), looking_at(dataset) as source:
        return [float(complexity_fn(source[i])) for i in range(len(source))]


class LoadBalancingDistributedSampler(Sampler):
    def __init__(self, dataset, complexity_fn, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False, random_level=0, *, batch_size=None, complexities=None):
        """``complexity_fn(sample)`` -> a number; ``complexities``: the scores of every index
        already known (then ``complexity_fn`` is not called)."""
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("num_replicas and rank are needed without an initialised process group")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        if not 0.0 <= random_level <= 1.0:
            raise ValueError(f"random_level {random_level} is not in [0, 1]")
        if complexity_fn is None and complexities is None:
            raise ValueError("a complexity_fn, or the complexities, are needed")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size {batch_size} is not positive")
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.random_level, self.batch_size = random_level, batch_size
        self.epoch = 0
        n = len(dataset)
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.complexities = ([float(c) for c in complexities] if complexities is not None
                             else score_samples(dataset, complexity_fn))
        if len(self.complexities) != n:
            raise ValueError(f"{len(self.complexities)} complexities for {n} samples")
        self._spread = (max(self.complexities) - min(self.complexities)) if n else 0.0
        self._assigned = None   # (epoch, every rank's indices)

    def __iter__(self):
        return iter(self.rank_indices()[self.rank])

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch):
        self.epoch = epoch

    def rank_indices(self):
        """Every rank's indices for this epoch, in order (the same on every rank)."""
        if self._assigned is None or self._assigned[0] != self.epoch:
            self._assigned = (self.epoch, self._assign())
        return self._assigned[1]

    def _assign(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        n, c = len(self.complexities), self.complexities
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        if self.drop_last:
            order = order[:self.total_size]
        elif order:
            order += (order * math.ceil(self.total_size / n))[:self.total_size - n]
        keys = [c[i] for i in order]
        if self.shuffle and self.random_level > 0:
            noise = torch.rand(len(order), generator=g).tolist()
            keys = [k + self.random_level * self._spread * u for k, u in zip(keys, noise)]
        steps = self._steps(order, keys, g)
        out = [[] for _ in range(self.num_replicas)]
        for step in steps:
            self._balance(step, out)
        return out

    def _steps(self, order, keys, g):
        """Lists of groups (each ``num_replicas`` indices of similar complexity); the loads of a
        list are balanced together."""
        r = self.num_replicas
        if self.batch_size is None:
            ranked = [order[p] for p in sorted(range(len(order)), key=keys.__getitem__)]
            groups = [ranked[i:i + r] for i in range(0, len(ranked), r)]
            if self.shuffle:
                groups = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
            return [groups]
        block = r * self.batch_size * STEPS_PER_BLOCK
        steps = []
        for start in range(0, len(order), block):
            span = range(start, min(start + block, len(order)))
            ranked = [order[p] for p in sorted(span, key=keys.__getitem__)]
            groups = [ranked[i:i + r] for i in range(0, len(ranked), r)]
            in_block = [groups[i:i + self.batch_size] for i in range(0, len(groups), self.batch_size)]
            if self.shuffle:
                full = len(in_block) - (len(groups) % self.batch_size != 0)   # a short last step stays last
                perm = torch.randperm(full, generator=g).tolist()
                in_block = [in_block[i] for i in perm] + in_block[full:]
            steps += in_block
        return steps

    def _balance(self, groups, out):
        """Each group's heaviest sample to the rank with the least load so far."""
        c = self.complexities
        load = [0.0] * self.num_replicas
        for group in groups:
            ranks = sorted(range(self.num_replicas), key=lambda q: (load[q], q))
            for q, i in zip(ranks, sorted(group, key=lambda i: -c[i])):
                out[q].append(i)
                load[q] += c[i]
