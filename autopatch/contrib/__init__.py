"""For code written against Bagua: its APIs, on modern PyTorch, backed by autopatch.

- ``fuse_optimizer`` / ``fuse_step`` / ``is_fused_optimizer``: Bagua's generic fused optimizer;
- ``CachedDataset`` / ``CacheLoader``: Bagua's cached dataset (a node-local store by default,
  Redis across machines), and ``LoadBalancingDistributedSampler`` /
  ``LoadBalancingDistributedBatchSampler``: its load-balanced sampler (autopatch/data/);
- ``with_bagua`` and Bagua's algorithm classes (``GradientAllReduceAlgorithm``,
  ``ByteGradAlgorithm``, ``DecentralizedAlgorithm``, ``LowPrecisionDecentralizedAlgorithm``,
  ``AsyncModelAverageAlgorithm``, ``QAdamAlgorithm``) and ``QAdamOptimizer`` (comm/algorithms/).
"""

from .bagua_algorithms import (AsyncModelAverageAlgorithm, ByteGradAlgorithm, DecentralizedAlgorithm,
                               GradientAllReduceAlgorithm, LowPrecisionDecentralizedAlgorithm, QAdamAlgorithm,
                               QAdamOptimizer, with_bagua)
from .fused_optimizer import LEFT_TO_FUSE_STEP, fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "LEFT_TO_FUSE_STEP", "CachedDataset",
           "CacheLoader", "LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler",
           "with_bagua", "GradientAllReduceAlgorithm", "ByteGradAlgorithm", "DecentralizedAlgorithm",
           "LowPrecisionDecentralizedAlgorithm", "AsyncModelAverageAlgorithm", "QAdamAlgorithm",
           "QAdamOptimizer"]

_DATA = ("CachedDataset", "CacheLoader", "LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler")


def __getattr__(name):
    if name in _DATA:
        from .. import data
        return getattr(data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
