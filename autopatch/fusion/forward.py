"""Mode forward: step() records the update; each module applies it just before it next runs.

At ``step()`` each fused chunk takes hold of its gradient (a chunk of one parameter keeps that
grad, one of several moves theirs into one buffer and their ``.grad`` become views of it, so nothing
is copied twice) and its update is left pending, with a snapshot of the group's hyperparameters (a
scheduler stepping in between must not change it). ``zero_grad()`` then drops the parameters'
references as usual and each chunk's gradient memory is freed once its update has run. A global module forward pre-hook applies the pending chunks holding a module's own
parameters right before that module's forward, while its weights are about to be read anyway.
Whatever is still pending is applied before anything could observe stale weights: the next
``step()``, ``state_dict()`` of the optimizer or of any module, ``torch.save``, ``flush()`` and
``disable()``.

Reading the optimizer's own ``state`` applies everything pending first (``pending_state.py``).
Parameters read outside their own module's forward before it runs (a weight shared by a functional
call, an EMA update right after ``step()``) would be stale: mode ``auto`` checks for that first.
A pending gradient written in place before its update runs (``zero_grad(set_to_none=False)`` is
flushed first by the runtime; anything else) would change the update: that is caught by the
tensor's version counter and is an error, never a silently different result.
"""


import weakref

from ..steps_in_flight import IN_FLIGHT
from ..torch_internals import own_parameters, version_counter
from .chunk_step import hyperparameters
from .multi_layer import split_by_grads
from .param_swap import ParamSwap
from .pending_state import apply_on_read, plain_reads
from .planner import FlatPlanner
from .routes import Route
from .strategy import PlannedStrategy, WeakOptimizer


class ForwardFusion(PlannedStrategy):
    opt = WeakOptimizer()

    def __init__(self, optimizer, chunk_bytes, owned_storages=None, route=None):
        self.opt = optimizer
        self.route = route or Route(optimizer)     # how a chunk is stepped (routes.py)
        self.planner = FlatPlanner(optimizer, chunk_bytes, align=True, owned_storages=owned_storages)
        self.pending = {}      # (id(run), ci) -> (group index, run, ci, version of its grad)
        self.by_param = {}     # id(param) -> (id(run), ci) while its chunk is pending
        self.hparams = {}      # group index -> hyperparameters of the step that recorded
        self.lists = ParamSwap()   # the user's params lists while step() runs the rest
        self.applying = False  # inside _apply: reads of the optimizer's state apply nothing more
        self.holding = None    # the optimizer, held strongly while its updates wait (see _hold)
        self.modules = weakref.WeakSet()   # the modules whose forward applied this optimizer's updates
        self.module_finalizers = []        # one per such module: its death may end the holding
        self.deferred = 0
        self.applied_in_forward = 0
        self.fallback_steps = 0

    # -- the strategy -------------------------------------------------------------------------
    def before_step(self, closure):
        if closure is not None:
            raise RuntimeError("autopatch mode 'forward' cannot run a closure-based step(); "
                               "use mode 'multi_layer' or 'auto'")
        self.flush()
        if self.planner.needs_plan():
            self.planner.plan()
        for gi, (plan, group) in enumerate(zip(self.planner.plans, self.opt.param_groups)):
            deferred, now, partial = split_by_grads(plan.runs)
            if partial:
                self.planner.mark_stale()
                self.fallback_steps += partial
            if not deferred:
                continue
            self.hparams[gi] = hyperparameters(group)
            for run in deferred:
                run.grads.bind(range(len(run.chunks)))
                for ci, (i0, i1) in enumerate(run.chunk_spans):
                    key = (id(run), ci)
                    self.pending[key] = (gi, run, ci, version_counter(run.chunks[ci].grad))
                    for p in run.params[i0:i1]:
                        self.by_param[id(p)] = key
            self.lists.put(group, now + plan.rest)
        if self.lists:
            self.deferred += 1
            apply_on_read(self.opt, self._apply_unless_applying)
        self._hold()
        return None

    def _hold(self):
        """An optimizer dropped right after ``step()`` (a script's last step, a loop that builds
        one per phase) has already made its update as far as the user can tell: while any of its
        updates waits for a forward, the strategy holds it, so that a read, the next forward or
        ``disable()`` still applies them. Let go as soon as nothing waits, or once every module
        that ever applied its updates is gone (the model was dropped too: nothing can run them,
        and holding on would keep the optimizer for the rest of the process)."""
        self.holding = self.opt if self.pending else None

    def _met(self, module):
        if module not in self.modules:
            self.modules.add(module)
            self.module_finalizers.append(weakref.finalize(module, _module_gone, weakref.ref(self)))

    def after_step(self):
        self.lists.restore()

    def apply_for(self, module):
        """Module forward pre-hook: apply the pending chunks holding this module's parameters."""
        keys = {self.by_param.get(id(p)) for p in own_parameters(module)}
        keys.discard(None)
        if keys:
            self._met(module)
            self._apply(keys)
            self.applied_in_forward += len(keys)

    def flush(self):
        """Apply every pending update now."""
        if self.pending:
            self._apply(list(self.pending))

    def _apply_unless_applying(self):
        if not self.applying:
            self.flush()

    @IN_FLIGHT.region
    def _apply(self, keys):
        """Apply those of ``keys`` still pending. A region (steps_in_flight.py): disable() from
        another thread, which applies everything pending, never runs beside it."""
        keys = [k for k in keys if k in self.pending]
        if not keys:
            return
        self.applying = True
        try:
            self._apply_now(keys)
        finally:
            self.applying = False

    def _apply_now(self, keys):
        items = [self.pending.pop(k) for k in keys]
        for _, run, ci, version in items:
            if version_counter(run.chunks[ci].grad) != version:
                raise RuntimeError(
                    f"autopatch mode 'forward': {type(self.opt).__qualname__}: a gradient was "
                    "changed in place after optimizer.step() and before its deferred update ran; "
                    "use mode 'multi_layer' or 'auto', or call autopatch.flush() before changing it")
        hp = {gi: self.hparams[gi] for gi, _, _, _ in items}
        try:
            self.route.step_chunks(self.opt, [(gi, run.chunks[ci], run.chunk_states[ci])
                                                  for gi, run, ci, _ in items], hp)
        finally:
            for _, run, ci, _ in items:
                run.grads.release((ci,))
        for gi, run, ci, _ in items:
            i0, i1 = run.chunk_spans[ci]
            for p in run.params[i0:i1]:
                self.by_param.pop(id(p), None)
            why = run.sync(self.opt.state.__getitem__, [ci])
            if why:
                raise RuntimeError(f"autopatch: {type(self.opt).__qualname__}: {why}")
        self._hold()

    def has_pending(self):
        return bool(self.pending)

    def holds_pending(self, param):
        return id(param) in self.by_param

    def deactivate(self):
        self.after_step()
        self.flush()
        plain_reads(self.opt)
        self.planner.mark_stale()
        for finalizer in self.module_finalizers:     # nothing is held once the mode is left
            finalizer.detach()
        self.module_finalizers = []

    def describe(self):
        return dict(self.planner.layout(), deferred_steps=self.deferred,
                    chunks_applied_in_forward=self.applied_in_forward,
                    fallback_group_steps=self.fallback_steps)

    def apply_param(self, param):
        """Apply the pending chunk holding ``param``, if any: it is being read outside its
        module's forward (an attribute read, a deepcopy, parameters())."""
        key = self.by_param.get(id(param))
        if key is not None:
            self._apply([key])


def _module_gone(strategy_ref):
    """A module that ran this strategy's updates was freed: with none left, stop holding."""
    strategy = strategy_ref()
    if strategy is not None and next(iter(strategy.modules), None) is None:   # skips the dying one
        strategy.holding = None
