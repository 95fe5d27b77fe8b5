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
"""

import collections
import gc
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..patching import Ledger
from .allreduce import BucketedAllreduce
from .compression import checked

HANDED_BACK_BY = {
    "register_comm_hook": "a DDP communication hook was registered",
    "_register_builtin_comm_hook": "a DDP communication hook was registered",
    "_register_fused_optim": "an optimizer was fused into DDP's backward",
    "_set_static_graph": "static graph was set",
    "join_hook": "it entered a Join context for uneven inputs, whose hook shadows DDP's own collectives",
}


def _unsupported(ddp):
    """Why DDP must keep reducing this model itself, or None."""
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "delay_all_reduce_named_params is set"
    if getattr(ddp, "_use_python_reducer", False):
        return "compiled DDP (python reducer) reduces gradients itself"
    if dist.get_world_size(ddp.process_group) < 2:
        return "world size is 1: there is nothing to synchronise"
    if ddp.static_graph:
        return "static_graph=True: DDP's static-graph schedule is kept"
    if ddp.mixed_precision is not None:
        return "DDP mixed_precision casts parameters and gradients itself"
    if getattr(ddp, "_comm_hooks", None):
        return "a DDP communication hook is registered"
    if ddp._join_config.enable:
        return "it is inside a Join context for uneven inputs"
    params, sparse = ddp._build_params_for_reducer()
    if any(sparse):
        return "sparse gradients (Embedding or EmbeddingBag with sparse=True)"
    if any(p.is_complex() for p in params):
        return "complex parameters"
    if any(hasattr(p, "_in_backward_optimizers") for p in params):
        return "optimizers are applied in backward (apply_optimizer_in_backward)"
    return None


class DDPTakeover:
    """The patches on DistributedDataParallel and the reducer of every adopted model.

    ``set_bucket_bytes``, ``set_compression`` and ``set_hierarchical`` apply to every adopted
    model (and to models built later) from the next synchronised backward on; call them on every
    rank between the same two steps.
    """

    def __init__(self, *, bucket_bytes, compression="none", hierarchical=False,
                 timeout_seconds=None, warn=False):
        self.options = {"bucket_bytes": int(bucket_bytes), "compression": compression,
                        "hierarchical": bool(hierarchical), "timeout_seconds": timeout_seconds}
        self.warn = warn
        self.ledger = Ledger()
        self.reducers = weakref.WeakKeyDictionary()     # DDP model -> BucketedAllreduce, while in charge
        self.history = []      # per adopted model: its reducer, or once retired its last description
        self.left_to_ddp = []
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
        for name, reason in HANDED_BACK_BY.items():
            self.ledger.wrap(ddp_class, name, self._handing_back(reason))
        for obj in gc.get_objects():
            if ddp_class in type(obj).__mro__:   # not issubclass: its ABC checks are slow over every object
                self.adopt(obj)

    def adopt(self, ddp):
        if ddp in self.reducers:
            return
        try:
            reason = _unsupported(ddp)
            if reason is None:
                params, _ = ddp._build_params_for_reducer()
                name_of = {id(p): n for n, p in ddp.module.named_parameters()}
                reducer = BucketedAllreduce(
                    params, [name_of.get(id(p), "?") for p in params], ddp.process_group,
                    find_unused=ddp.find_unused_parameters, on_averaged=self._averaged,
                    **self._options_for(ddp))
        except Exception as e:   # an optimisation must never stop the user's model from training
            reason = f"could not take over ({type(e).__name__}: {e})"
        if reason is not None:
            self._leave(ddp, reason)
            return
        self.reducers[ddp] = reducer
        entry = {"model": type(ddp.module).__name__, "reducer": reducer}
        self.history.append(entry)
        weakref.finalize(ddp, self._retire, entry, "the model was freed")   # the report outlives it

    def _retire(self, entry, why):
        """Stop reducing for this model; keep only its description, not its buffers."""
        reducer = entry.pop("reducer", None)
        if reducer is not None:
            reducer.remove()
            entry.update(reducer.describe(), ended=why)

    def _options_for(self, ddp):
        """Hierarchical reduce groups ranks by node across the whole world, so it needs the world."""
        spans_world = dist.get_world_size(ddp.process_group) == dist.get_world_size()
        return dict(self.options, hierarchical=self.options["hierarchical"] and spans_world)

    def _leave(self, ddp, reason):
        self.left_to_ddp.append({"model": type(ddp.module).__name__, "reason": reason})
        if self.warn and dist.get_rank() == 0:
            warnings.warn(f"autopatch: {type(ddp.module).__name__} keeps DDP's own gradient sync: {reason}",
                          RuntimeWarning, stacklevel=3)

    def hand_back(self, ddp, reason):
        reducer = self.reducers.pop(ddp, None)
        if reducer is not None:
            entry = next(e for e in self.history if e.get("reducer") is reducer)
            self._retire(entry, f"handed back to DDP: {reason}")
            self._leave(ddp, reason)

    # -- the wrappers ---------------------------------------------------------------------------
    def _after_init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        self.adopt(instance)

    def _forward(self, wrapped, instance, args, kwargs):
        reducer = self.reducers.get(instance)
        if reducer is None:
            return wrapped(*args, **kwargs)
        wanted = instance.require_backward_grad_sync
        instance.require_backward_grad_sync = False
        try:
            out = wrapped(*args, **kwargs)
        finally:
            instance.require_backward_grad_sync = wanted
        grad_enabled = torch.is_grad_enabled()
        instance.require_forward_param_sync = grad_enabled and wanted
        if grad_enabled:
            reducer.arm(wanted)
        return out

    def _handing_back(self, reason):
        def wrapper(wrapped, instance, args, kwargs):
            self.hand_back(instance, reason)
            return wrapped(*args, **kwargs)
        return wrapper

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def bucket_bytes(self):
        return self.options["bucket_bytes"]

    @property
    def compression(self):
        return self.options["compression"]

    @property
    def hierarchical(self):
        return self.options["hierarchical"]

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
        models = [dict(model=e["model"], **e["reducer"].describe()) if "reducer" in e else dict(e)
                  for e in self.history]
        in_charge = [m for m in models if not m.get("ended", "").startswith("handed back")]
        if any("ended" not in m for m in models):
            reason = f"averages the gradients of {sum('ended' not in m for m in models)} DDP model(s)"
        elif in_charge:
            reason = f"averaged the gradients of {len(in_charge)} DDP model(s) until {in_charge[-1]['ended']}"
        elif self.left_to_ddp:
            reason = f"DDP keeps its own gradient sync: {self.left_to_ddp[-1]['reason']}"
        else:
            reason = "no DistributedDataParallel model has been built"
        return {
            "active": bool(in_charge),
            "reason": reason,
            "bucket_bytes": self.bucket_bytes,
            "buckets": sum(m["buckets"] for m in in_charge),
            "compression": self.compression,
            "hierarchical": self.hierarchical,
            "bytes_sent_per_step": sum(m["bytes_sent_per_step"] for m in in_charge),
            "wait_seconds": round(sum(m["wait_seconds"] for m in models), 6),
            "models": models,
            "left_to_ddp": list(self.left_to_ddp),
        }

    def remove(self):
        """Give every model back to DDP's own reducer and restore the DDP class."""
        for entry in self.history:
            self._retire(entry, "autopatch was disabled")
        self.reducers.clear()
        self.ledger.uninstall()
