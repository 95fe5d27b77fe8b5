"""Running the gradient sync of DistributedDataParallel models, one record per model, and handing
it back.

Every DDP model built (patches/ddp.py offers each) gets one ``TakenModel`` record: its process
group, and either the ``BucketedAllreduce`` and communication algorithm autopatch runs it with, or
why DDP's own reducer keeps it (``left``). While autopatch runs it, DDP still builds the model
(shapes checked across ranks, parameters and buffers broadcast from rank 0) and still runs its
forward (buffer broadcast, ``state_dict`` keys, ``no_sync()``). Only the backward changes: during
each forward ``require_backward_grad_sync`` is held False, which is what ``no_sync()`` itself does,
so DDP's reducer stays idle. The user's own setting (True, or False inside ``no_sync()``) arms
autopatch's allreduce instead, and ``require_forward_param_sync`` is set as DDP would have set it.

DDP keeps its reducer, with the reason in the report: where the policy asks for nothing only
autopatch's allreduce does (sync_owner.py: the default), world size 1, ``static_graph``, a
registered comm hook, DDP ``mixed_precision``, delayed-allreduce parameters, compiled DDP (python
reducer), sparse gradients, complex parameters, optimizers applied in backward. A model is handed
back when a comm hook or static graph is set on it later, or when it enters a ``Join`` context
(DDP's join hook shadows DDP's own collectives, which autopatch does not issue; its ranks may step
unevenly from then on).

Settings (bucket size, compression, hierarchical reduce) are one frozen ``SyncSettings``: a knob
replaces it whole, and each model's allreduce swaps it in at its next synchronised backward.
The policy's communication algorithm (``algorithm_choice.py``) decides what travels: the gradient
algorithms are settings of the allreduce; the others are an object per model
(``comm/algorithms/``) that ``forward`` drives (``before_forward``, and the allreduce is armed only
while ``gradient_sync()`` says so) and the runtime drives around each optimizer step
(``before_step`` / ``after_step`` / ``step_of``, dispatched by ``model_algorithms.py``). Retiring a
model, handing it back and ``remove()`` close its algorithm; the report's entries
(``takeover_log.py``) outlive the models.
"""

import dataclasses
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..listeners import Listeners
from ..patches.ddp import DDPPatch
from ..policy import PolicyError, check_setting
from ..topology import topology, why_not_hierarchical
from ..torch_internals import applied_in_backward, ddp_reducer_params, ddp_unsupported
from .algorithm_choice import AlgorithmChoice
from .allreduce import BucketedAllreduce
from .compression import checked
from .sync_settings import SyncSettings
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


@dataclass
class TakenModel:
    """One DDP model as the takeover knows it: its group, and either the allreduce autopatch runs
    its sync with (and the report entry of it), or why DDP's reducer keeps it."""
    group: object
    reducer: object = None        # BucketedAllreduce while autopatch runs the sync
    entry: dict = None            # its report entry (takeover_log.py)
    left: str = None              # why DDP keeps the sync, while it does
    kept_by_policy: bool = False  # kept only because nothing asked for autopatch's (use_algorithm may)
    uneven: bool = False          # its ranks may step unevenly (it entered a Join context)


class DDPTakeover:
    """A record of every DDP model seen, and the allreduce of those whose sync autopatch runs.

    ``set_bucket_bytes``, ``set_compression`` and ``set_hierarchical`` replace the settings whole
    for every model it runs (and for models built later) from the next synchronised backward on;
    call them on every rank between the same two steps.
    """

    def __init__(self, *, bucket_bytes, compression="none", hierarchical=False,
                 timeout_seconds=None, warn=False, algorithm=None, keeps=None,
                 stands_for=None):
        """``algorithm``: an ``AlgorithmChoice`` for the models built from now on (default:
        gradient_allreduce); ``keeps(world)``: why DDP's own reducer keeps a model of ``world``
        ranks unless asked otherwise (``use_algorithm``), or None to take it over
        (sync_owner.py); ``stands_for``: which parameters a stepped tensor updates
        (``stand_ins.stands_for``, which the fusion side fills; model_algorithms.py)."""
        self.choice = algorithm or AlgorithmChoice()
        self.keeps = keeps or (lambda world: None)
        self.settings = SyncSettings(int(bucket_bytes), self.choice.compression(compression), bool(hierarchical))
        self.timeout_seconds = timeout_seconds
        self.patch = DDPPatch(self)
        self.models = weakref.WeakKeyDictionary()       # every DDP model seen -> its TakenModel
        self.reducers = []       # the allreduce of every model autopatch runs: read every step, kept plain
        self.algorithms = ModelAlgorithms(self._dropped, stands_for)
        self.log = TakeoverLog(warn)
        self.topology = None     # the job's nodes, once a model over the whole world was built
        self.averaged = Listeners()      # fn(params) of every on_averaged() subscriber

    # -- backward fusion's view ------------------------------------------------------------------
    def _running(self):
        """(model, record) of every model whose sync autopatch runs."""
        return [(ddp, m) for ddp, m in list(self.models.items()) if m.reducer is not None]

    def averages(self, params):
        """True when autopatch averages the gradient of every parameter in ``params``."""
        mine = {id(p) for reducer in self.reducers for p in reducer.params}
        return all(id(p) in mine for p in params)

    def on_averaged(self, fn):
        """Call ``fn(params)`` whenever the averaged gradients of ``params`` are final, inside
        backward. Returns a handle whose ``remove()`` stops it."""
        return self.averaged.subscribe(fn)

    def install(self, distributed_module):
        self.patch.install(distributed_module)

    def adopt(self, ddp, asked=False):
        """Take ``ddp``'s gradient sync over, or record why DDP keeps it; ``asked``: a
        communication algorithm was asked for this model (``use_algorithm``), whatever ``keeps``
        says."""
        model = self.models.get(ddp)
        if model is not None and (model.reducer is not None or not (asked and model.kept_by_policy)):
            return
        if model is None:
            model = self.models[ddp] = TakenModel(ddp.process_group)
        if self.topology is None and why_not_hierarchical(ddp.process_group) is None:
            self.topology = topology()       # every rank builds the model: a good moment to ask
        reducer = algorithm = None
        try:
            reason = _unsupported(ddp)
            if reason is None and not asked:
                reason = self.keeps(dist.get_world_size(ddp.process_group))
                model.kept_by_policy = reason is not None
            if reason is None:
                params, _ = ddp_reducer_params(ddp)
                name_of = {id(p): n for n, p in ddp.module.named_parameters()}
                settings = self.choice.allreduce_settings(self._settings_for(ddp), ddp.process_group)
                reducer = BucketedAllreduce(
                    params, [name_of.get(id(p), "?") for p in params], ddp.process_group, settings,
                    timeout_seconds=self.timeout_seconds, find_unused=ddp.find_unused_parameters,
                    on_averaged=self.averaged)
                algorithm = self.choice.build(params, ddp.process_group, self.timeout_seconds)
        except PolicyError:      # settings this world cannot run: every rank raises here alike
            if reducer is not None:
                reducer.remove()
            raise
        except Exception as e:   # an optimisation must never stop the user's model from training
            if reducer is not None:
                reducer.remove()
            reason = f"could not take over ({type(e).__name__}: {e})"
        if reason is not None:
            model.left = reason
            self.log.leave(ddp, reason)
            return
        if model.left is not None:       # kept until now, asked for now
            self.log.rejoin(ddp, model.left)
        model.left, model.kept_by_policy, model.reducer = None, False, reducer
        self.reducers.append(reducer)
        if algorithm is not None:
            self.algorithms.add(ddp, algorithm)
        model.entry = self.log.add(ddp, reducer, algorithm)
        weakref.finalize(ddp, self._freed, reducer, model.entry)   # the report outlives the model

    def _freed(self, reducer, entry):
        self._stop(reducer)
        self.log.retire(entry, "the model was freed")

    def _stop(self, reducer):
        if reducer in self.reducers:
            self.reducers.remove(reducer)

    def _dropped(self, ddp, algorithm, why):
        """An algorithm cannot go on for this model (qadam over an optimizer it cannot continue):
        it is closed, and the bucketed allreduce averages the gradients from now on."""
        self.log.close_algorithm(self.models[ddp].entry, why)
        if dist.get_rank() == 0:
            warnings.warn(f"autopatch: {type(ddp.module).__name__}: {algorithm.name} is not used: {why}",
                          RuntimeWarning, stacklevel=2)

    def _settings_for(self, ddp):
        """The settings for ``ddp``: hierarchical only where its group allows it."""
        allowed = why_not_hierarchical(ddp.process_group) is None
        return dataclasses.replace(self.settings, hierarchical=self.settings.hierarchical and allowed)

    def hand_back(self, ddp, reason, uneven=False):
        """DDP's reducer runs ``ddp``'s sync from now on; ``uneven``: its ranks may step unevenly."""
        model = self.models.get(ddp)
        if model is None:
            return
        model.uneven = model.uneven or uneven
        if model.reducer is not None:
            self.algorithms.pop(ddp)
            self.log.retire(model.entry, f"handed back to DDP: {reason}")
            self._stop(model.reducer)
            model.reducer, model.entry, model.left = None, None, reason
            self.log.leave(ddp, reason)

    def forward(self, ddp, wrapped, args, kwargs):
        """DDP's forward of ``ddp``; where autopatch runs its sync, DDP's reducer is kept idle and
        autopatch's allreduce armed as DDP would have armed its own."""
        model = self.models.get(ddp)
        reducer = model.reducer if model is not None else None
        if reducer is None:
            return wrapped(*args, **kwargs)
        algorithm = self.algorithms.get(ddp)
        wanted = ddp.require_backward_grad_sync
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and algorithm is not None:
            algorithm.before_forward(wanted)
        ddp.require_backward_grad_sync = False
        try:
            out = wrapped(*args, **kwargs)
        finally:
            ddp.require_backward_grad_sync = wanted
        ddp.require_forward_param_sync = grad_enabled and wanted and (
            algorithm is None or algorithm.syncs_buffers)
        if grad_enabled:
            reducer.arm(wanted and (algorithm is None or algorithm.gradient_sync()))
        return out

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def in_charge(self):
        """True while autopatch averages the gradients of some DDP model."""
        return bool(self.reducers)

    @property
    def wait_seconds(self):
        """Seconds spent waiting for gradient communication so far, over the models in charge."""
        return float(sum(reducer.wait_seconds for reducer in self.reducers))

    def set_bucket_bytes(self, nbytes):
        self._swap(bucket_bytes=check_setting("allreduce.bucket_bytes", nbytes))

    def set_compression(self, compression):
        self._swap(compression=checked(compression))

    def set_hierarchical(self, flag):
        self._swap(hierarchical=check_setting("allreduce.hierarchical", flag))

    def _swap(self, **change):
        """New settings, whole, for every model from its next synchronised backward on (and for
        models built later); a model's algorithm keeps what it sets itself."""
        self.settings = dataclasses.replace(self.settings, **change)
        for ddp, model in self._running():
            ours = self._settings_for(ddp)
            model.reducer.use(dataclasses.replace(model.reducer.next_settings, **{
                k: getattr(ours, k) for k in change}))

    # -- report and removal -------------------------------------------------------------------
    def describe(self):
        return self.log.describe(self.choice, dataclasses.asdict(self.settings), self.topology)

    def remove(self):
        """Give every model back to DDP's own reducer, close every algorithm, and restore the
        DDP class."""
        self.log.retire_all("autopatch was disabled")
        for model in self.models.values():
            model.reducer = model.entry = None
        self.models.clear()
        self.reducers.clear()
        self.algorithms.clear()
        self.patch.uninstall()

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
        self.adopt(ddp, asked=True)      # a model kept because nothing asked for it is asked for now
        model = self.models.get(ddp)
        if model is None or model.reducer is None:
            return (model.left if model is not None else None) or \
                "it is not a DistributedDataParallel model autopatch took over"
        self.algorithms.pop(ddp)
        self.log.close_algorithm(model.entry, f"replaced by {choice.name}")
        settings = choice.allreduce_settings(self._settings_for(ddp), ddp.process_group)
        model.reducer.use(dataclasses.replace(model.reducer.next_settings, compression=settings.compression,
                                              hierarchical=settings.hierarchical))
        algorithm = choice.build(model.reducer.params, ddp.process_group, self.timeout_seconds)
        self.log.set_algorithm(model.entry, algorithm)
        if algorithm is not None:
            self.algorithms.add(ddp, algorithm)
        return None

    def group_of(self, params):
        """The process group of the DDP model (taken over or left to DDP) holding any of
        ``params``, whose ranks step together; None when none does, or when its ranks may step
        unevenly (an algorithm such as async, a Join context): then each rank decides alone."""
        ids = {id(p) for p in params}
        for ddp, model in list(self.models.items()):
            if any(id(p) in ids for p in ddp.module.parameters()):
                algorithm = self.algorithms.get(ddp)
                if model.uneven or (algorithm is not None and algorithm.steps_unevenly):
                    return None
                return model.group
        return None

    def algorithm_of(self, params):
        """The algorithm exchanging the weights or optimizer state of any of ``params``, or None."""
        return self.algorithms.of_params(params)

    def before_step(self, opt):
        """``opt`` is about to step: the algorithms of the models it updates prepare."""
        if self.algorithms.live and opt is not None:
            self.algorithms.before_step(opt)

    def after_step(self, opt):
        if self.algorithms.live and opt is not None:
            self.algorithms.after_step(opt)

    def step_of(self, opt):
        """What takes ``opt``'s step over (an object with ``name`` and ``step(opt)``), or None."""
        return self.algorithms.step_of(opt) if self.algorithms.live else None
