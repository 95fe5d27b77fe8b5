"""How evenly a sampler spreads work over ranks, step by step: for each step, the largest
rank's total complexity over the mean of the ranks' totals (1.0 is perfect), for the
load-balanced sampler and for what torch's DistributedSampler would have given."""

import statistics

from torch.utils.data import DistributedSampler

__all__ = ["step_spreads", "distributed_sampler_indices", "spread_summary"]


def step_spreads(rank_indices, complexities, batch_size):
    """max/mean of the ranks' complexity per step, for steps of ``batch_size`` samples per rank."""
    steps = min(len(ix) for ix in rank_indices)
    out = []
    for s in range(0, steps, batch_size):
        loads = [sum(complexities[i] for i in ix[s:s + batch_size]) for ix in rank_indices]
        mean = sum(loads) / len(loads)
        out.append(max(loads) / mean if mean > 0 else 1.0)
    return out


def distributed_sampler_indices(dataset, num_replicas, seed, epoch, shuffle, drop_last):
    """Every rank's indices under torch's DistributedSampler with these settings."""
    out = []
    for rank in range(num_replicas):
        s = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                               seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def spread_summary(spreads):
    if not spreads:
        return {"steps": 0}
    return {"steps": len(spreads), "median": round(statistics.median(spreads), 4),
            "worst": round(max(spreads), 4)}
