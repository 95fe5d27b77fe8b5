"""Taking over the gradient sync of DistributedDataParallel models, and handing it back.

DDP still builds the model (checks shapes across ranks, broadcasts parameters and buffers from
rank 0) and still runs its forward (buffer broadcast, ``state_dict`` keys, ``no_sync()``). Only the
backward changes: during each forward of a taken-over model ``require_backward_grad_sync`` is held
False, which is what ``no_sync()`` itself does, so DDP's reducer stays idle. The user's own setting
(True, or False inside ``no_sync()``) arms autopatch's ``BucketedAllreduce`` instead, and
``require_forward_param_sync`` is set as DDP would have set it, so buffers are still broadcast.

Left to DDP, with the reason in the report: world size 1, ``static_graph``, a registered comm
hook, DDP ``mixed_precision``, delayed-allreduce parameters, compiled DDP (python reducer), sparse
gradients, complex parameters, optimizers applied in backward. A taken-over model is handed back
to DDP when a comm hook or static graph is set on it later, or when it enters a ``Join`` context
for uneven inputs (DDP's join hook shadows DDP's own collectives, which autopatch does not issue).

The policy's communication algorithm (``algorithm_choice.py``) decides what travels. The gradient
algorithms are settings of the bucketed allreduce; the others are an object per model
(``comm/algorithms/``) that the forward wrapper drives (``before_forward``, and the allreduce is
armed only while ``gradient_sync()`` says so) and the runtime drives around each optimizer step
(``before_step`` / ``after_step`` / ``step_of``). Retiring a model, handing it back and
``remove()`` close its algorithm. What was done per model, for the report, is the
``TakeoverLog``'s (``takeover_log.py``).
"""

import collections
import gc
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..patching import Ledger
from ..policy import PolicyError
from ..topology import topology, why_not_hierarchical
from ..torch_internals import DDP_HANDING_BACK, applied_in_backward, ddp_reducer_params, ddp_unsupported
from .algorithm_choice import AlgorithmChoice
from .allreduce import BucketedAllreduce
from .compression import checked
from .model_algorithms import ModelAlgorithms
from .takeover_log import TakeoverLog

def _unsupported(ddp):
    """Why DDP must keep reducing this model itself, or None."""
    why = ddp_unsupported(ddp)
    if why:
        return why
    if dist.get_world_size(ddp.process_group) < 2:
        return "world size is 1: there is nothing to synchronise"
    if getattr(ddp, "static_graph", False):
        return "static_graph=True: DDP's static-graph schedule is kept"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP mixed_precision casts parameters and gradients itself"
    params, sparse = ddp_reducer_params(ddp)
    if any(sparse):
        return "sparse gradients (Embedding or EmbeddingBag with sparse=True)"
    if any(p.is_complex() for p in params):
        return "complex parameters"
    if any(applied_in_backward(p) for p in params):
        return "optimizers are applied in backward (apply_optimizer_in_backward)"
    return None


class DDPTakeover:
    """The patches on DistributedDataParallel and the reducer of every adopted model.

    ``set_bucket_bytes``, ``set_compression`` and ``set_hierarchical`` apply to every adopted
    model (and to models built later) from the next synchronised backward on; call them on every
    rank between the same two steps.
    """

    def __init__(self, *, bucket_bytes, compression="none", hierarchical=False,
                 timeout_seconds=None, warn=False, algorithm=None, keeps=None):
        """``algorithm``: an ``AlgorithmChoice`` for the models built from now on (default:
        gradient_allreduce); ``keeps(world)``: why DDP's own reducer keeps a model of ``world``
        ranks unless asked otherwise (``use_algorithm``), or None to take it over
        (sync_owner.py)."""
        self.choice = algorithm or AlgorithmChoice()
        self.keeps = keeps or (lambda world: None)
        self.kept = weakref.WeakSet()    # models DDP keeps because nothing asked for the takeover
        self.uneven = weakref.WeakSet()  # models whose ranks may step unevenly (a Join context)
        self.options = {"bucket_bytes": int(bucket_bytes), "compression": self.choice.compression(compression),
                        "hierarchical": bool(hierarchical), "timeout_seconds": timeout_seconds}
        self.ledger = Ledger()
        self.reducers = weakref.WeakKeyDictionary()     # DDP model -> BucketedAllreduce, while in charge
        self.algorithms = ModelAlgorithms(self._dropped)
        self.log = TakeoverLog(warn)
        self.groups = weakref.WeakKeyDictionary()       # every DDP model seen -> its process group
        self.topology = None     # the job's nodes, once a model over the whole world was built
        # on_averaged() callbacks by handle id; torch's RemovableHandle needs a weakref-able dict
        self._listeners = collections.OrderedDict()

    # -- backward fusion's view ------------------------------------------------------------------
    def averages(self, params):
        """True when autopatch averages the gradient of every parameter in ``params``."""
        mine = {id(p) for reducer in self.reducers.values() for p in reducer.params}
        return all(id(p) in mine for p in params)

    def on_averaged(self, fn):
        """Call ``fn(params)`` whenever the averaged gradients of ``params`` are final, inside
        backward. Returns a handle whose ``remove()`` stops it."""
        handle = RemovableHandle(self._listeners)
        self._listeners[handle.id] = fn
        return handle

    def _averaged(self, params):
        for fn in list(self._listeners.values()):
            fn(params)

    def install(self, distributed_module):
        ddp_class = distributed_module.DistributedDataParallel
        self.ledger.wrap(ddp_class, "__init__", self._after_init)
        self.ledger.wrap(ddp_class, "forward", self._forward)
        for name, reason in DDP_HANDING_BACK.items():
            self.ledger.wrap(ddp_class, name, self._handing_back(reason, uneven=name == "join_hook"))
        for obj in gc.get_objects():
            if ddp_class in type(obj).__mro__:   # not issubclass: its ABC checks are slow over every object
                self.adopt(obj)

    def adopt(self, ddp, asked=False):
        """Take ``ddp``'s gradient sync over, or say why DDP keeps it; ``asked``: a communication
        algorithm was asked for this model (``use_algorithm``), whatever ``keeps`` says."""
        if ddp in self.reducers:
            return
        self.groups[ddp] = ddp.process_group
        if self.topology is None and why_not_hierarchical(ddp.process_group) is None:
            self.topology = topology()       # every rank builds the model: a good moment to ask
        reducer = algorithm = None
        try:
            reason = _unsupported(ddp)
            if reason is None and not asked:
                reason = self.keeps(dist.get_world_size(ddp.process_group))
                if reason is not None:
                    self.kept.add(ddp)
            if reason is None:
                params, _ = ddp_reducer_params(ddp)
                name_of = {id(p): n for n, p in ddp.module.named_parameters()}
                options = self.choice.allreduce_options(self._options_for(ddp), ddp.process_group)
                reducer = BucketedAllreduce(
                    params, [name_of.get(id(p), "?") for p in params], ddp.process_group,
                    find_unused=ddp.find_unused_parameters, on_averaged=self._averaged, **options)
                algorithm = self.choice.build(params, ddp.process_group, self.options["timeout_seconds"])
        except PolicyError:      # settings this world cannot run: every rank raises here alike
            if reducer is not None:
                reducer.remove()
            raise
        except Exception as e:   # an optimisation must never stop the user's model from training
            if reducer is not None:
                reducer.remove()
            reason = f"could not take over ({type(e).__name__}: {e})"
        if reason is not None:
            self.log.leave(ddp, reason)
            return
        self.reducers[ddp] = reducer
        if algorithm is not None:
            self.algorithms.add(ddp, algorithm)
        entry = self.log.add(ddp, reducer, algorithm)
        weakref.finalize(ddp, self.log.retire, entry, "the model was freed")   # the report outlives it

    def _entry(self, ddp):
        return self.log.entry_of(self.reducers.get(ddp))

    def _dropped(self, ddp, algorithm, why):
        """An algorithm cannot go on for this model (qadam over an optimizer it cannot continue):
        it is closed, and the bucketed allreduce averages the gradients from now on."""
        self.log.close_algorithm(self._entry(ddp), why)
        if dist.get_rank() == 0:
            warnings.warn(f"autopatch: {type(ddp.module).__name__}: {algorithm.name} is not used: {why}",
                          RuntimeWarning, stacklevel=2)

    def _options_for(self, ddp):
        """The allreduce's options for ``ddp``: hierarchical only where its group allows it."""
        allowed = why_not_hierarchical(ddp.process_group) is None
        return dict(self.options, hierarchical=self.options["hierarchical"] and allowed)

    def hand_back(self, ddp, reason):
        if ddp in self.reducers:
            entry = self._entry(ddp)
            del self.reducers[ddp]
            self.algorithms.pop(ddp)
            self.log.retire(entry, f"handed back to DDP: {reason}")
            self.log.leave(ddp, reason)

    # -- the wrappers ---------------------------------------------------------------------------
    def _after_init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        self.adopt(instance)

    def _forward(self, wrapped, instance, args, kwargs):
        reducer = self.reducers.get(instance)
        if reducer is None:
            return wrapped(*args, **kwargs)
        algorithm = self.algorithms.get(instance)
        wanted = instance.require_backward_grad_sync
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and algorithm is not None:
            algorithm.before_forward(wanted)
        instance.require_backward_grad_sync = False
        try:
            out = wrapped(*args, **kwargs)
        finally:
            instance.require_backward_grad_sync = wanted
        instance.require_forward_param_sync = grad_enabled and wanted and (
            algorithm is None or algorithm.syncs_buffers)
        if grad_enabled:
            reducer.arm(wanted and (algorithm is None or algorithm.gradient_sync()))
        return out

    def _handing_back(self, reason, uneven=False):
        def wrapper(wrapped, instance, args, kwargs):
            if uneven:
                self.uneven.add(instance)
            self.hand_back(instance, reason)
            return wrapped(*args, **kwargs)
        return wrapper

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def in_charge(self):
        """True while autopatch averages the gradients of some DDP model."""
        return bool(self.reducers)

    @property
    def wait_seconds(self):
        """Seconds spent waiting for gradient communication so far, over the models in charge."""
        return float(sum(r.wait_seconds for r in self.reducers.values()))

    def set_bucket_bytes(self, nbytes):
        self.options["bucket_bytes"] = int(nbytes)
        for reducer in self.reducers.values():
            reducer.set_bucket_bytes(nbytes)

    def set_compression(self, compression):
        self.options["compression"] = checked(compression)
        for reducer in self.reducers.values():
            reducer.set_compression(compression)

    def set_hierarchical(self, flag):
        self.options["hierarchical"] = bool(flag)
        for ddp, reducer in self.reducers.items():
            reducer.set_hierarchical(self._options_for(ddp)["hierarchical"])

    # -- report and removal -------------------------------------------------------------------
    def describe(self):
        return self.log.describe(self.choice, self.options, self.topology)

    def remove(self):
        """Give every model back to DDP's own reducer, close every algorithm, and restore the
        DDP class."""
        self.log.retire_all("autopatch was disabled")
        self.reducers.clear()
        self.algorithms.clear()
        self.ledger.uninstall()

    # -- the algorithms, for the runtime and for code that names one ------------------------------
    def algorithm(self, model):
        """The algorithm object of ``model`` (the DDP model, or the module it wraps), or None
        (a gradient algorithm, or a model not taken over): ``algorithm(model).abort()`` and
        ``.resume()`` stop and restart async averaging."""
        return self.algorithms.of_model(model)

    def use_algorithm(self, ddp, choice):
        """Run ``ddp`` with ``choice`` (an ``AlgorithmChoice``) from its next forward on; its
        current algorithm is closed. A collective over its process group. Returns None, or why
        DDP keeps its own gradient sync for this model."""
        if ddp in self.kept:             # asked for now: autopatch's allreduce runs it
            self.kept.discard(ddp)
            self.log.rejoin(ddp)
            self.adopt(ddp, asked=True)
        if ddp not in self.reducers:
            return self.log.why_left(ddp) or "it is not a DistributedDataParallel model autopatch took over"
        entry = self._entry(ddp)
        self.algorithms.pop(ddp)
        self.log.close_algorithm(entry, f"replaced by {choice.name}")
        reducer = entry["reducer"]
        options = choice.allreduce_options(self._options_for(ddp), ddp.process_group)
        reducer.set_compression(options["compression"])
        reducer.set_hierarchical(options["hierarchical"])
        algorithm = choice.build(reducer.params, ddp.process_group, self.options["timeout_seconds"])
        self.log.set_algorithm(entry, algorithm)
        if algorithm is not None:
            self.algorithms.add(ddp, algorithm)
        return None

    def group_of(self, params):
        """The process group of the DDP model (taken over or left to DDP) holding any of
        ``params``, whose ranks step together; None when none does, or when its ranks may step
        unevenly (an algorithm such as async, a Join context): then each rank decides alone."""
        ids = {id(p) for p in params}
        for ddp in list(self.groups):
            if any(id(p) in ids for p in ddp.module.parameters()):
                algorithm = self.algorithms.get(ddp)
                if ddp in self.uneven or (algorithm is not None and algorithm.steps_unevenly):
                    return None
                return self.groups[ddp]
        return None

    def algorithm_of(self, params):
        """The algorithm exchanging the weights or optimizer state of any of ``params``, or None."""
        return self.algorithms.of_params(params)

    def before_step(self, opt):
        """``opt`` is about to step: the algorithms of the models it updates prepare."""
        if self.algorithms and opt is not None:
            self.algorithms.before_step(opt)

    def after_step(self, opt):
        if self.algorithms and opt is not None:
            self.algorithms.after_step(opt)

    def step_of(self, opt):
        """What takes ``opt``'s step over (an object with ``name`` and ``step(opt)``), or None."""
        return self.algorithms.step_of(opt) if self.algorithms else None
