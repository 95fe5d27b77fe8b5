"""Bagua's algorithm classes and ``with_bagua``, for scripts written against Bagua.

Each class takes Bagua's constructor arguments, with Bagua's defaults, and names one of the
policy's algorithms (comm/algorithms/). ``with_bagua(model, optimizers, algorithm)`` stands for
Bagua's ``model.with_bagua(optimizers, algorithm)``: it wraps the model in
``DistributedDataParallel``, whose gradient sync autopatch takes over, and runs the algorithm for
that model. It enables autopatch first when it is off (the policy ``FUSEDOPT_POLICY`` names, else
``default``), since the algorithms hear of each optimizer step through autopatch's hooks.

Unlike Bagua's, which returned the module itself, ``with_bagua`` returns the DDP model: call it
as Bagua's was called (``model = with_bagua(model, ...)``); its ``.module`` is the user's module.
"""

import warnings

import torch

from ..comm.algorithm_choice import AlgorithmChoice
from ..comm.algorithms import QAdamOptimizer
from .fused_optimizer import is_fused_optimizer


class BaguaAlgorithm:
    """One of Bagua's algorithms as a name and the policy's settings for it."""

    name = ""

    def __init__(self, **settings):
        self.settings = settings

    def choice(self):
        return AlgorithmChoice(self.name, source=type(self).__name__, **self.settings)


def _averaging(average):
    if not average:
        raise ValueError("average=False (summed gradients) is not offered: autopatch averages gradients, "
                         "as DDP does; scale the learning rate by the world size instead")


class GradientAllReduceAlgorithm(BaguaAlgorithm):
    name = "gradient_allreduce"

    def __init__(self, hierarchical=False, average=True):
        _averaging(average)
        super().__init__(hierarchical=hierarchical)


class ByteGradAlgorithm(BaguaAlgorithm):
    name = "bytegrad"

    def __init__(self, hierarchical=True, average=True):
        _averaging(average)
        super().__init__(hierarchical=hierarchical)


class DecentralizedAlgorithm(BaguaAlgorithm):
    name = "decentralized"

    def __init__(self, hierarchical=True, peer_selection_mode="all", communication_interval=1):
        super().__init__(hierarchical=hierarchical, peer_selection_mode=peer_selection_mode,
                         communication_interval=communication_interval)


class LowPrecisionDecentralizedAlgorithm(BaguaAlgorithm):
    name = "low_precision_decentralized"

    def __init__(self, hierarchical=True, communication_interval=1):
        super().__init__(hierarchical=hierarchical, communication_interval=communication_interval)


class AsyncModelAverageAlgorithm(BaguaAlgorithm):
    name = "async"

    def __init__(self, peer_selection_mode="all", sync_interval_ms=500, warmup_steps=0):
        if peer_selection_mode != "all":
            raise ValueError(f"peer_selection_mode {peer_selection_mode!r}: async model averaging averages "
                             "over every rank ('all'), as Bagua's did")
        super().__init__(sync_interval_ms=sync_interval_ms, warmup_steps=warmup_steps)

    def abort(self, model):
        """Stop averaging ``model`` (what ``with_bagua`` returned); every rank calls it."""
        _running_async(model).abort()

    def resume(self, model):
        """Average again after ``abort``; every rank calls it."""
        _running_async(model).resume()


class QAdamAlgorithm(BaguaAlgorithm):
    """QAdam for the ``QAdamOptimizer`` given, which switches by itself after its warm-up and
    averages its first moment as ``hierarchical`` says."""

    name = "qadam"

    def __init__(self, q_adam_optimizer, hierarchical=True):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(f"QAdamAlgorithm takes a QAdamOptimizer, not {type(q_adam_optimizer).__name__}")
        q_adam_optimizer.set_hierarchical(hierarchical)
        self.optimizer = q_adam_optimizer
        super().__init__(hierarchical=hierarchical, warmup_steps=q_adam_optimizer.warmup_steps)


def _takeover():
    import autopatch
    session = autopatch.session() or autopatch.enable()
    if session.allreduce is None:
        raise RuntimeError(f"with_bagua needs autopatch's takeover of DistributedDataParallel, which the "
                           f"policy {session.policy.source} turns off (allreduce.enabled: false)")
    return session


def _running_async(model):
    import autopatch
    session = autopatch.session()
    algorithm = session.allreduce.algorithm(model) if session is not None and session.allreduce else None
    if algorithm is None or algorithm.name != "async":
        raise ValueError(f"{type(model).__name__} does not run async model averaging (with_bagua with "
                         "AsyncModelAverageAlgorithm, or the async policy)")
    return algorithm


def with_bagua(model, optimizers, algorithm, process_group=None, do_flatten=True):
    """Bagua's ``model.with_bagua(optimizers, algorithm, process_group, do_flatten)``: returns
    ``DistributedDataParallel(model)`` running ``algorithm``. Every rank calls it together.
    ``do_flatten`` is accepted and has nothing left to do: the allreduce's buckets are flat."""
    session = _takeover()
    for opt in optimizers:
        if is_fused_optimizer(opt):
            raise ValueError(f"with_bagua: {type(opt).__name__} was given to fuse_optimizer, so its "
                             f"fuse_step() runs outside autopatch's hooks and {algorithm.name} would never "
                             "hear of its steps; drop fuse_optimizer (autopatch fuses every step itself)")
        session.optimizer(opt)         # KeyError: autopatch does not see this optimizer's steps
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group)
    if not session.allreduce.use_algorithm(ddp, algorithm.choice()):
        warnings.warn(f"autopatch: with_bagua: {algorithm.name} does not run, DDP keeps its own gradient sync: "
                      f"{session.allreduce.describe()['left_to_ddp'][-1]['reason']}", RuntimeWarning, stacklevel=2)
    return ddp
