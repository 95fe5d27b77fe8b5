"""Bagua's ``LoadBalancingDistributedBatchSampler``: variable-sized batches from a load-balanced
sampler, the same number of batches on every rank.

``batch_fn(indices) -> list of batches`` is applied to every rank's indices; ranks with fewer
batches repeat their own from the start (``drop_last=False``), or ranks with more stop at the
fewest (``drop_last=True``). Bagua padded with a slice that, under ``drop_last=True``, added
batches instead of dropping them, so ranks yielded more than ``len()`` and different counts. Here
every rank yields exactly ``len()`` batches, and batches follow the sampler's epoch even when
``set_epoch`` was called on the sampler itself.
"""

import math

from torch.utils.data import Sampler

from .balanced_sampler import LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler"]


class LoadBalancingDistributedBatchSampler(Sampler):
    def __init__(self, sampler, batch_fn, drop_last=False):
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError("sampler should be a LoadBalancingDistributedSampler")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.num_replicas, self.rank = sampler.num_replicas, sampler.rank
        self._batches = None   # (epoch, this rank's batches)

    def batches(self):
        """This rank's batches for the sampler's current epoch."""
        if self._batches is None or self._batches[0] != self.sampler.epoch:
            self._batches = (self.sampler.epoch, self._make())
        return self._batches[1]

    def _make(self):
        every = [[list(b) for b in self.batch_fn(ix)] for ix in self.sampler.rank_indices()]
        counts = [len(b) for b in every]
        total = min(counts) if self.drop_last else max(counts)
        mine = every[self.rank] or next((b for b in every if b), [])
        if len(mine) >= total:
            return mine[:total]
        return (mine * math.ceil(total / len(mine)))[:total]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self):
        return len(self.batches())

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
