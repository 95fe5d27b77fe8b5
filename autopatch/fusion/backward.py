"""Mode backward: update each chunk inside backward, as soon as all of its gradients are final.

Chunks are cut at parameter boundaries. A post-accumulate-grad hook on every fused parameter
counts down its chunk; the last one gathers the chunk's grads, runs the user's optimizer over that
chunk and (when allowed) frees the grads at once, so at no time do all gradients exist together.
The user's ``step()`` then only updates what backward could not: parameters left out of fusion and
chunks where some parameter had no gradient (those step per tensor, as unpatched, and the runs are
re-planned).

Across processes the gradients are hooked differently: autopatch's allreduce (``averaged_by``)
says when a bucket's averaged gradients are final, and those are what chunks count down on. The
grads then stay where they are (views of the allreduce's flat buffer, as after DDP's backward).

Only correct when the gradient at the end of one backward is the one ``step()`` would use: no
gradient accumulation, clipping, GradScaler, or other reads of grads or params between backward and
``step()``. Mode ``auto`` checks that before choosing it; a second backward before ``step()`` is an
error here rather than a silently different result (not strict: fusion stops and ``unsafe`` says so).
"""

import torch

from .chunk_step import raw_step_of, step_chunks
from .multi_layer import MultiLayerStep


class AccumulationError(RuntimeError):
    """A parameter's gradient arrived twice before step(): backward fusion would be wrong."""


class BackwardFusion:
    mode = "backward"

    def __init__(self, optimizer, chunk_bytes, owned_storages=None, averaged_by=None, strict=True):
        self.opt = optimizer
        # Not strict: where it would raise, it stops fusing instead, ``unsafe`` says why, and
        # step() updates what backward did not (the caller then leaves this mode).
        self.strict = strict
        self.unsafe = None
        self.raw_step = raw_step_of(optimizer)
        self.planner = MultiLayerStep(optimizer, chunk_bytes, align=True, grad_buffer=False,
                                      owned_storages=owned_storages)
        self.averaged_by = averaged_by
        self.free_grads = averaged_by is None    # an allreduce's flat buffer stays allocated anyway
        self.hooks = []
        self.where = {}        # id(param) -> (group index, run, chunk index)
        self.waiting = {}      # (id(run), chunk index) -> params whose grad is not final yet
        self.ready = set()     # ids of params whose grad became final since the last step()
        self.stepped = []      # (run, chunk index) updated since the last step()
        self.swapped = []
        self.armed = False
        self.in_backward = 0   # chunk updates done inside backward
        self.leftover_steps = 0

    def _arm(self):
        """(Re)plan the flat runs and hook every fused parameter's gradient."""
        self._unhook()
        self.planner.plan()
        for gi, plan in enumerate(self.planner.plans):
            for run in plan.runs:
                for ci, (i0, i1) in enumerate(run.chunk_spans):
                    for p in run.params[i0:i1]:
                        self.where[id(p)] = (gi, run, ci)
                        if self.averaged_by is None:
                            self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.averaged_by is not None:
            self.hooks.append(self.averaged_by.on_averaged(self._on_averaged))
        self._new_step()
        self.armed = True

    def _unhook(self):
        for h in self.hooks:
            h.remove()
        self.hooks, self.where, self.armed = [], {}, False

    def _new_step(self):
        self.ready.clear()
        self.stepped = []
        self.waiting = {(id(run), ci): i1 - i0 for plan in self.planner.plans for run in plan.runs
                        for ci, (i0, i1) in enumerate(run.chunk_spans)}

    def _on_averaged(self, params):
        for p in params:
            self._on_grad(p)

    def _on_grad(self, p):
        where = self.where.get(id(p))
        if where is None or self.unsafe:
            return
        if id(p) in self.ready:
            if not self.strict:
                self.unsafe = "a parameter received a second gradient before step() (gradient accumulation)"
                return
            raise AccumulationError(
                "autopatch mode 'backward': a parameter received a second gradient before "
                "optimizer.step() (gradient accumulation, or a step skipped by GradScaler); "
                "use mode 'forward', 'multi_layer' or 'auto' for this optimizer")
        if torch.is_grad_enabled() and self.averaged_by is None:
            if not self.strict:
                self.unsafe = "backward with create_graph=True (double backward)"
                return
            raise AccumulationError("autopatch mode 'backward' cannot run under create_graph=True "
                                    "(double backward); use mode 'multi_layer' or 'auto'")
        self.ready.add(id(p))
        gi, run, ci = where
        key = (id(run), ci)
        self.waiting[key] -= 1
        if self.waiting[key] == 0:
            self._step_chunk(gi, run, ci)

    def _step_chunk(self, gi, run, ci):
        i0, i1 = run.chunk_spans[ci]
        params = run.params[i0:i1]
        if any(p.data_ptr() != ptr for p, ptr in zip(params, run.param_ptrs[i0:i1])):
            return          # moved by user code: step() handles it and re-plans
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            return
        chunk = run.chunks[ci]
        chunk.grad = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
        try:
            step_chunks(self.opt, self.raw_step, [(gi, chunk, run.chunk_states[ci])])
        finally:
            chunk.grad = None
        if self.free_grads:
            for p in params:
                p.grad = None
        self.stepped.append((run, ci))
        self.in_backward += 1

    # -- the fusion-mode protocol --------------------------------------------------------------
    def before_step(self, closure):
        if closure is not None:
            raise RuntimeError("autopatch mode 'backward' cannot run a closure-based step(); "
                               "use mode 'multi_layer' or 'auto'")
        if not self.armed:
            return None         # first step in this mode runs as unpatched; hooks arm after it
        done = {(id(run), ci) for run, ci in self.stepped}
        for plan, group in zip(self.planner.plans, self.opt.param_groups):
            leftovers = [p for run in plan.runs for ci, (i0, i1) in enumerate(run.chunk_spans)
                         if (id(run), ci) not in done for p in run.params[i0:i1] if p.grad is not None]
            if leftovers:
                self.planner.dirty = True     # their state moves apart from their run's
                self.leftover_steps += 1
            self.swapped.append((group, group["params"]))
            group["params"] = plan.rest + leftovers
        return None

    def after_step(self):
        for group, params in self.swapped:
            group["params"] = params
        self.swapped = []
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
        for group, params in self.swapped:
            group["params"] = params
        self.swapped = []
        self._unhook()
        self.planner.invalidate()

    def invalidate(self):
        """Activation, a loaded checkpoint or a new chunk size: re-plan and hook right away,
        so the very next backward already fuses."""
        self.flush()
        self._arm()

    def set_chunk_bytes(self, chunk_bytes):
        self.planner.chunk_bytes = int(chunk_bytes)
        if self.armed:          # an inactive mode keeps no hooks: it re-plans when activated
            self.invalidate()
        else:
            self.planner.dirty = True

    def describe(self):
        return dict(self.planner.layout(), chunk_updates_in_backward=self.in_backward,
                    leftover_steps=self.leftover_steps, grads_freed_in_backward=self.free_grads)
