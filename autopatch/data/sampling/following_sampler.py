"""The load-balanced sampler standing in for a user's DistributedSampler.

It keeps the user's sampler's num_replicas, rank, seed, shuffle and drop_last, and follows its
epoch: training loops call ``set_epoch`` on their own sampler object, so the epoch is read from
it at every ``__iter__``, and ``set_epoch`` called on this one (as Lightning and transformers do
through ``loader.sampler``) is passed on to it. ``bypass`` hands iteration back to the user's
sampler (autopatch was disabled).
"""

from .balanced_sampler import LoadBalancingDistributedSampler

__all__ = ["FollowingSampler"]


class FollowingSampler(LoadBalancingDistributedSampler):
    def __init__(self, followed, dataset, complexities, batch_size=None):
        super().__init__(dataset, None, num_replicas=followed.num_replicas, rank=followed.rank,
                         shuffle=followed.shuffle, seed=followed.seed, drop_last=followed.drop_last,
                         batch_size=batch_size, complexities=complexities)
        self.followed = followed
        self.bypassed = False

    def __iter__(self):
        if self.bypassed:
            return iter(self.followed)
        self.epoch = self.followed.epoch
        return super().__iter__()

    def set_epoch(self, epoch):
        self.followed.set_epoch(epoch)
        self.epoch = epoch

    def bypass(self):
        self.bypassed = True
