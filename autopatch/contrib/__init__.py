"""For code written against Bagua: its APIs, on modern PyTorch, backed by autopatch.

- ``fuse_optimizer`` / ``fuse_step`` / ``is_fused_optimizer``: Bagua's generic fused optimizer;
- ``CachedDataset`` / ``CacheLoader``: Bagua's cached dataset (a node-local store by default,
  Redis across machines), and ``LoadBalancingDistributedSampler`` /
  ``LoadBalancingDistributedBatchSampler``: its load-balanced sampler (autopatch/data/);
- ``RedisStore``: Bagua's Redis-backed store (a server per node, or existing servers);
- ``with_bagua`` and Bagua's algorithm classes (``GradientAllReduceAlgorithm``,
  ``ByteGradAlgorithm``, ``DecentralizedAlgorithm``, ``LowPrecisionDecentralizedAlgorithm``,
  ``AsyncModelAverageAlgorithm``, ``QAdamAlgorithm``) and ``QAdamOptimizer`` (comm/algorithms/);
- ``autopatch.contrib.bagua``: a stand-in for ``bagua.torch_api`` (``init_process_group``,
  ``get_rank``, ..., ``model.with_bagua(...)``, ``bagua.algorithms.gradient_allreduce`` and the
  other algorithm modules), so a script changes only its import.
"""

from .bagua_algorithms import (AsyncModelAverageAlgorithm, ByteGradAlgorithm, DecentralizedAlgorithm,
                               GradientAllReduceAlgorithm, LowPrecisionDecentralizedAlgorithm, QAdamAlgorithm,
                               QAdamOptimizer)
from .fused_optimizer import LEFT_TO_FUSE_STEP, fuse_optimizer, fuse_step, is_fused_optimizer
from .with_bagua import with_bagua

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "LEFT_TO_FUSE_STEP", "CachedDataset",
           "CacheLoader", "LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler",
           "RedisStore", "with_bagua", "GradientAllReduceAlgorithm", "ByteGradAlgorithm",
           "DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm", "AsyncModelAverageAlgorithm",
           "QAdamAlgorithm", "QAdamOptimizer"]

_DATA = ("CachedDataset", "CacheLoader", "LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler",
         "RedisStore")


def __getattr__(name):
    if name in _DATA:
        from .. import data
        return getattr(data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
