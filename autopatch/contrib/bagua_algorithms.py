"""Bagua's algorithm classes, for scripts written against Bagua (``with_bagua`` runs them).

Each class takes Bagua's constructor arguments, with Bagua's defaults, and names one of the
policy's algorithms (comm/algorithms/); the arguments are the settings the policy declares.
"""

import inspect

from ..comm.algorithm_choice import AlgorithmChoice
from ..comm.algorithms import QAdamOptimizer
from ..policy import Algorithm, algorithm_settings


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


def _bagua_class(class_name, algorithm, bagua_defaults, averages=False):
    """Bagua's class for ``algorithm``: its arguments are the settings the policy declares for the
    algorithm (policy.Algorithm), in declaration order and with Bagua's defaults, plus Bagua's
    ``average`` for the gradient algorithms. The checks are the policy's, so a value means the
    same in a script as in a policy file."""
    declared = {name: default for name, default in
                ((f, getattr(Algorithm, f)) for f in algorithm_settings(algorithm))}
    declared.update(bagua_defaults)
    if averages:
        declared["average"] = True
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=v) for k, v in declared.items()]
    signature = inspect.Signature(parameters)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        settings = {k: v for k, v in bound.arguments.items() if k != "self"}
        if averages:
            _averaging(settings.pop("average"))
        BaguaAlgorithm.__init__(self, **settings)
        self.choice()                 # the policy's checks, now rather than at with_bagua

    __init__.__signature__ = signature
    doc = (f"Bagua's ``{class_name}``: the policy's ``algorithm: {{name: {algorithm}}}`` with Bagua's "
           f"arguments and defaults ({', '.join(f'{k}={v!r}' for k, v in declared.items())}).")
    return type(class_name, (BaguaAlgorithm,), {"name": algorithm, "__init__": __init__, "__doc__": doc,
                                                "__module__": __name__})


GradientAllReduceAlgorithm = _bagua_class("GradientAllReduceAlgorithm", "gradient_allreduce",
                                          {"hierarchical": False}, averages=True)
ByteGradAlgorithm = _bagua_class("ByteGradAlgorithm", "bytegrad", {"hierarchical": True}, averages=True)
DecentralizedAlgorithm = _bagua_class("DecentralizedAlgorithm", "decentralized", {"hierarchical": True})
LowPrecisionDecentralizedAlgorithm = _bagua_class("LowPrecisionDecentralizedAlgorithm", "low_precision_decentralized",
                                                  {"hierarchical": True})
_AsyncModelAverage = _bagua_class("AsyncModelAverageAlgorithm", "async", {"warmup_steps": 0})


class AsyncModelAverageAlgorithm(_AsyncModelAverage):
    __doc__ = _AsyncModelAverage.__doc__

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


def _running_async(model):
    import autopatch
    session = autopatch.session()
    algorithm = session.allreduce.algorithm(model) if session is not None and session.allreduce else None
    if algorithm is None or algorithm.name != "async":
        raise ValueError(f"{type(model).__name__} does not run async model averaging (with_bagua with "
                         "AsyncModelAverageAlgorithm, or the async policy)")
    return algorithm
