"""The data side: a sample cache that outlives the run, and a load-balanced distributed sampler.

    from autopatch.data import CachedDataset, LoadBalancingDistributedSampler
    loader = DataLoader(CachedDataset(dataset, backend="local", dataset_name="train"), ...)

Bagua's API (``CachedDataset``, ``CacheLoader``, ``LoadBalancingDistributedSampler``,
``LoadBalancingDistributedBatchSampler``) with a node-local lmdb store as the default backend
and Redis as the distributed one; ``DataPatches`` applies both to unchanged programs. Importing
this package imports nothing heavy: each name loads its module on first use.
"""

import importlib

_EXPORTS = {
    "CachedDataset": "cache.cached_dataset",
    "CacheLoader": "cache.cache_loader",
    "LoadBalancingDistributedSampler": "sampling.balanced_sampler",
    "LoadBalancingDistributedBatchSampler": "sampling.balanced_batch_sampler",
    "DataPatches": "zero_code.patches",
    "LocalStore": "store.local_store",
    "RedisStore": "store.redis_store",
    "RedisServer": "store.redis_server",
    "ShardedStore": "store.sharded_store",
    "sequence_length": "sampling.complexity",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__():
    return sorted(__all__)
