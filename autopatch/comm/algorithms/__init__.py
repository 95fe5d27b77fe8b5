"""Communication algorithms that change what ranks exchange, by Bagua's names.

Two of Bagua's algorithms only change how gradients are averaged, and are the bucketed
allreduce itself (``comm/allreduce.py``), with no class here:

- ``gradient_allreduce``: ``BucketedAllreduce`` as it is (Bagua's default hierarchical=False).
- ``bytegrad``: ``BucketedAllreduce(compression="minmax_uint8")``, whose buckets already go
  through Bagua's 8-bit min-max scatter-gather (``averager.py``). Bagua's defaults were
  hierarchical=True and average=True; averaging is what the allreduce always does, and
  hierarchical is the allreduce's own ``hierarchical`` setting.

The others exchange weights or optimizer state, and are driven through ``base.Algorithm``'s
hooks (one instance per DDP model; see ``base.py`` for when each hook runs):

- ``decentralized``: ``Decentralized(params, group, peer_selection_mode="all" | "shift_one",
  communication_interval=1, hierarchical=False)``.
- ``low_precision_decentralized``: ``LowPrecisionDecentralized(params, group,
  hierarchical=False, communication_interval=1, row_elements=1024)``.
- ``async``: ``AsyncModelAverage(params, group, sync_interval_ms=500, warmup_steps=0)``, with
  ``abort()`` / ``resume()``.
- ``qadam``: ``QAdam(params, group, warmup_steps=100, hierarchical=False,
  compression="minmax_uint8")``, whose ``step(optimizer)`` continues a user's Adam or AdamW after
  warm-up; or, written into a script, ``QAdamOptimizer``.

Bagua defaulted ``hierarchical`` to True for the weight algorithms; here it is False, as for the
allreduce: on one node a hierarchical ``shift_one`` has a single participant and cannot pair.
Every constructor also takes ``timeout_seconds``, the bound on each wait for a collective.
"""

from ...policy import check_algorithm_name
from ...vocabulary import GRADIENT_ALGORITHMS
from .async_average import AsyncModelAverage
from .base import Algorithm
from .decentralized import Decentralized
from .low_precision import LowPrecisionDecentralized
from .qadam import QAdam, QAdamOptimizer

ALGORITHMS = {cls.name: cls for cls in (Decentralized, LowPrecisionDecentralized, AsyncModelAverage, QAdam)}


def build(name, params, group, **settings):
    """The algorithm ``name`` for one model's ``params`` over ``group``; a collective."""
    check_algorithm_name(name, "algorithms.build")
    if name in GRADIENT_ALGORITHMS:
        raise ValueError(f"{name} has no algorithm object: it is the bucketed allreduce's compression setting")
    return ALGORITHMS[name](params, group, **settings)


__all__ = ["ALGORITHMS", "GRADIENT_ALGORITHMS", "Algorithm", "AsyncModelAverage", "Decentralized",
           "LowPrecisionDecentralized", "QAdam", "QAdamOptimizer", "build"]
