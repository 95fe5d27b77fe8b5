"""Mode backward: update each chunk inside backward, as soon as all of its gradients are final.

Chunks are cut at parameter boundaries and hold at most ``BACKWARD_WINDOW`` bytes (a larger
parameter is a chunk of its own). A post-accumulate-grad hook on every fused parameter counts down
its chunk; the last one runs the user's optimizer over that chunk and frees the chunk's grads at
once. So the gradients alive during backward are those of the chunks still filling, a few MiB,
whatever the chunk size asked for; a chunk of one parameter reads its grad in place, a chunk of
several copies theirs into a scratch buffer of one chunk, made once and used by every chunk in
turn. The user's ``step()`` then only updates what
backward could not: parameters left out of fusion and chunks where some parameter had no gradient
(those step per tensor, as unpatched, and the runs are re-planned).

The hooks run once per parameter per backward, so each does constant work on preallocated
bookkeeping: a flag per parameter (a second gradient before ``step()`` is accumulation) and a
counter per chunk.

Across processes the gradients are hooked differently: autopatch's allreduce (``averaged_by``)
says when a bucket's averaged gradients are final, and those are what chunks count down on; once
updated they are freed as well, and with them each bucket's buffer, so the gradients alive are
those of the buckets in flight and the chunks still filling.

Only correct when the gradient at the end of one backward is the one ``step()`` would use: no
gradient accumulation, clipping, GradScaler, or other reads of grads or params between backward and
``step()``. Mode ``auto`` checks that before choosing it; a second backward before ``step()`` is an
error here rather than a silently different result (not strict: fusion stops and ``unsafe`` says so).
"""

import functools
import weakref

import torch

from ..steps_in_flight import IN_FLIGHT
from .chunking import BACKWARD_WINDOW
from .param_swap import ParamSwap
from .planner import FlatPlanner
from .routes import Route
from .strategy import Strategy, WeakOptimizer


class AccumulationError(RuntimeError):
    """A parameter's gradient arrived twice before step(): backward fusion would be wrong."""


ACCUMULATION = "a parameter received a second gradient before step() (gradient accumulation)"


def refuse_closure(closure):
    """Mode backward updates inside backward: a step() that runs backward itself cannot be one."""
    if closure is not None:
        raise RuntimeError("autopatch mode 'backward' cannot run a closure-based step(); "
                           "use mode 'multi_layer' or 'auto'")


class BackwardFusion(Strategy):
    opt = WeakOptimizer()

    def __init__(self, optimizer, chunk_bytes, owned_storages=None, averaged_by=None, strict=True,
                 route=None):
        self.opt = optimizer
        # Not strict: where it would raise, it stops fusing instead, ``unsafe`` says why, and
        # step() updates what backward did not (the caller then leaves this mode).
        self.strict = strict
        self.unsafe = None
        self.route = route or Route(optimizer)     # how a chunk is stepped (routes.py)
        self.planner = FlatPlanner(optimizer, min(int(chunk_bytes), BACKWARD_WINDOW), align=True,
                                   owned_storages=owned_storages)
        self.averaged_by = averaged_by
        self.hooks = []        # the handles of the hooks armed now (one list, emptied in place)
        # A freed optimizer's hooks go with it: the parameters it updated live on in the model.
        # Only the handles are held there, never this strategy: one whose mode was left (mode
        # auto's race leaves several) goes with its plan, flat gradient buffers and views, and
        # does not live as long as the optimizer.
        self._freed = weakref.finalize(optimizer, _remove_all, self.hooks)
        self.scratch = {}      # (dtype, device) -> a buffer of the longest gathered chunk
        self.units = []        # chunk index -> (group index, run, chunk index in run)
        self.unit_of = []      # slot (a fused parameter) -> its chunk's index in units
        self.slot_of = {}      # id(param) -> slot, for the allreduce's per-bucket events
        self.sizes = []        # chunk index -> how many parameters it waits for
        self.left = []         # this step: chunk index -> parameters still without a final grad
        self.arrived = bytearray()   # this step: slot -> 1 once its gradient is final
        self.stepped = []      # (run, chunk index) updated since the last step()
        self.lists = ParamSwap()   # the user's params lists while step() runs the leftovers
        self.armed = False
        self.in_backward = 0   # chunk updates done inside backward
        self.leftover_steps = 0

    def _arm(self):
        """(Re)plan the flat runs and hook every fused parameter's gradient."""
        self._unhook()
        self.planner.plan()
        longest = {}
        for plan in self.planner.plans:
            for run in plan.runs:
                key = (run.flat.dtype, run.flat.device)
                longest[key] = max([longest.get(key, 0), *run.grads.gathered_lengths()])
        self.scratch = {(dtype, device): torch.empty(n, dtype=dtype, device=device)
                        for (dtype, device), n in longest.items() if n}
        for gi, plan in enumerate(self.planner.plans):
            for run in plan.runs:
                for ci, (i0, i1) in enumerate(run.chunk_spans):
                    unit = len(self.units)
                    self.units.append((gi, run, ci))
                    self.sizes.append(i1 - i0)
                    for p in run.params[i0:i1]:
                        slot = len(self.unit_of)
                        self.unit_of.append(unit)
                        self.slot_of[id(p)] = slot
                        if self.averaged_by is None:
                            self.hooks.append(p.register_post_accumulate_grad_hook(
                                functools.partial(self._arrive, slot)))
        if self.averaged_by is not None:
            self.hooks.append(self.averaged_by.on_averaged(self._on_averaged))
        self._new_step()
        self.armed = True

    def _unhook(self):
        _remove_all(self.hooks)
        self.units, self.unit_of, self.slot_of, self.sizes = [], [], {}, []
        self.scratch = {}
        self.armed = False

    def _new_step(self):
        self.arrived = bytearray(len(self.unit_of))
        self.left = list(self.sizes)
        self.stepped = []

    def _on_averaged(self, params):
        for p in params:
            slot = self.slot_of.get(id(p))
            if slot is not None:
                self._arrive(slot, p)

    def _arrive(self, slot, p):
        """A region (steps_in_flight.py): enable() and disable() land between two gradients,
        never in a chunk's update. Disabled between two, the chunks updated so far keep their
        update (their grads are gone: ``step()`` skips them) and ``step()`` updates the rest per
        tensor, as unpatched."""
        if IN_FLIGHT.pending:
            IN_FLIGHT.entering()
        try:
            if self.unsafe or not self.armed:
                return
            if self.arrived[slot]:
                if not self.strict:
                    self.unsafe = ACCUMULATION
                    return
                raise AccumulationError(
                    "autopatch mode 'backward': a parameter received a second gradient before "
                    "optimizer.step() (gradient accumulation, or a step skipped by GradScaler); "
                    "use mode 'forward', 'multi_layer' or 'auto' for this optimizer")
            if self.averaged_by is None and torch.is_grad_enabled():
                if not self.strict:
                    self.unsafe = "backward with create_graph=True (double backward)"
                    return
                raise AccumulationError("autopatch mode 'backward' cannot run under create_graph=True "
                                        "(double backward); use mode 'multi_layer' or 'auto'")
            self.arrived[slot] = 1
            unit = self.unit_of[slot]
            left = self.left[unit] - 1
            self.left[unit] = left
            if not left:
                self._step_unit(unit)
        finally:
            if IN_FLIGHT.pending:
                IN_FLIGHT.left()

    IN_FLIGHT.count_frames_of(_arrive.__code__)   # inline: it runs once per parameter per backward

    def _step_unit(self, unit):
        gi, run, ci = self.units[unit]
        i0, i1 = run.chunk_spans[ci]
        params = run.params[i0:i1]
        if any(p.data_ptr() != ptr for p, ptr in zip(params, run.param_ptrs[i0:i1])):
            return          # moved by user code: step() handles it and re-plans
        if any(p.grad.is_sparse for p in params):
            return
        run.grads.borrow(ci, self.scratch.get((run.flat.dtype, run.flat.device)))
        try:
            self.route.step_chunks(self.opt, [(gi, run.chunks[ci], run.chunk_states[ci])])
        finally:
            run.grads.release((ci,))
        for p in params:
            p.grad = None
        self.stepped.append((run, ci))
        self.in_backward += 1

    # -- the strategy -------------------------------------------------------------------------
    def updated_before_step(self):
        return bool(self.stepped)

    def before_step(self, closure):
        refuse_closure(closure)
        if not self.armed:
            return None         # first step in this mode runs as unpatched; hooks arm after it
        done = {(id(run), ci) for run, ci in self.stepped}
        for plan, group in zip(self.planner.plans, self.opt.param_groups):
            leftovers = [p for run in plan.runs for ci, (i0, i1) in enumerate(run.chunk_spans)
                         if (id(run), ci) not in done for p in run.params[i0:i1] if p.grad is not None]
            if leftovers:
                self.planner.mark_stale()     # their state moves apart from their run's
                self.leftover_steps += 1
            self.lists.put(group, plan.rest + leftovers)
        return None

    def after_step(self):
        self.lists.restore()
        self.flush()
        if not self.armed or self.planner.needs_plan():
            self._arm()
        else:
            self._new_step()

    def flush(self):
        """Mirror the state of chunks updated so far into per-parameter state."""
        for run, ci in self.stepped:
            why = run.sync(self.opt.state.__getitem__, [ci])
            if why:
                raise RuntimeError(f"autopatch: {type(self.opt).__qualname__}: {why}")

    def deactivate(self):
        self.flush()
        self.lists.restore()
        self._unhook()
        self._freed.detach()
        self.planner.mark_stale()

    def invalidate(self):
        """Activation, a loaded checkpoint or a new chunk size: re-plan and hook right away,
        so the very next backward already fuses."""
        self.flush()
        self._arm()

    activated = invalidate

    def set_chunk_bytes(self, chunk_bytes):
        self.planner.set_chunk_bytes(min(int(chunk_bytes), BACKWARD_WINDOW))
        if self.armed:          # an inactive mode keeps no hooks: it re-plans when activated
            self.invalidate()

    def chunk_bytes_in_use(self):
        return self.planner.chunk_bytes_in_use

    def describe(self):
        return dict(self.planner.layout(), chunk_updates_in_backward=self.in_backward,
                    leftover_steps=self.leftover_steps)


def _remove_all(hooks):
    for h in hooks:
        h.remove()
    hooks.clear()
