"""The multi-layer fused update: the user's own optimizer steps over a few flat chunks.

Around each ``step()`` the fused groups' ``params`` lists are swapped for chunk parameters (views
into flat buffers; of a sharded run, the chunks this process owns: ``run.own``) and the chunks' state is put into ``optimizer.state``; afterwards everything is
swapped back, so outside ``step()`` the optimizer looks exactly as unpatched: same param groups,
per-parameter state (views into the flat state), same ``state_dict()``.
"""

from .flattenable import unfusable_param
from .param_swap import ParamSwap, fuse_when_grads_exist
from .planner import FlatPlanner
from .strategy import NotFusable, PlannedStrategy, WeakOptimizer


def split_by_grads(runs):
    """This step's runs whose params all have dense grads (they fuse), the params of the other
    runs (they step per tensor, as unpatched: the optimizer skips those without a grad), and how
    many of those had only some grads (their state now moves apart: re-plan)."""
    ready, unfused, partial = [], [], 0
    for run in runs:
        grads = [p.grad for p in run.params]
        present = sum(g is not None for g in grads)
        if present == len(grads) and not any(g.is_sparse for g in grads):
            ready.append(run)
        else:
            unfused += run.params
            partial += present > 0
    return ready, unfused, partial


class MultiLayerStep(PlannedStrategy):
    """Swaps flat chunks into an optimizer around each step. Not thread-safe per optimizer."""
    opt = WeakOptimizer()


    def __init__(self, optimizer, chunk_bytes, owned_storages=None, route=None, planner=None):
        self.opt = optimizer
        # route (routes.py): a rounding route steps the chunks itself; None or bitwise: the
        # user's step() steps them
        self.route = route
        self.planner = planner or FlatPlanner(optimizer, chunk_bytes, owned_storages=owned_storages)
        self.lists = ParamSwap()    # the user's params lists while chunks (or a route) stand in
        self.swapped = []           # (group index, runs fused this step)
        self.fused_steps = 0
        self.fallback_steps = 0
        self.last_fallback = None

    # -- the step -----------------------------------------------------------------------------
    def swap_in(self):
        """Give the chunks their grads and put them in place of the fused params.

        A run fuses when every one of its params has a dense grad. A run where none has one
        (an unused head) is simply skipped, as the optimizer would skip it. A run where only some
        have one steps per tensor, exactly as unpatched, and is re-planned afterwards so params
        whose state moved differently stop sharing a run.
        """
        if self.lists:
            return
        if self.planner.needs_plan():
            self.planner.plan()
        for gi, (plan, group) in enumerate(zip(self.planner.plans, self.opt.param_groups)):
            if not plan.runs:
                continue
            fused, unfused, partial = split_by_grads(plan.runs)
            if partial:
                self.planner.mark_stale()
                self.fallback_steps += partial
                self.last_fallback = "some parameters of a run had no gradient, or a sparse one"
            if not fused:
                continue
            for run in fused:
                run.grads.bind(self.chunks_to_step(run))
            self.lists.put(group, [run.chunks[ci] for run in fused for ci in self.chunks_to_step(run)]
                           + unfused + plan.rest)
            for run in fused:
                for ci in self.chunks_to_step(run):
                    self.opt.state[run.chunks[ci]] = run.chunk_states[ci]
            self.swapped.append((gi, fused))
        if self.swapped:
            self.fused_steps += 1

    def chunks_to_step(self, run):
        """The chunks of ``run`` that ``step()`` updates: those this process owns (all, unsharded)."""
        return run.own

    def restore(self):
        """Put the user's params back and keep per-parameter state in step with the flat state."""
        self.lists.restore()
        swapped, self.swapped = self.swapped, []
        for _, fused in swapped:
            for run in fused:
                run.grads.release(run.own)
                for ci in run.own:
                    self.opt.state.pop(run.chunks[ci], None)
                why = run.sync(self.opt.state.__getitem__, run.own)
                if why:
                    raise NotFusable(f"{type(self.opt).__qualname__} cannot be fused: {why}")

    # -- the strategy -------------------------------------------------------------------------
    def before_step(self, closure):
        """Swap chunks in; with a closure, only once the closure has computed the grads."""
        fuse = self._step_params if self.route is not None and self.route.takes_params else self._step_chunks
        return fuse_when_grads_exist(closure, fuse)

    def _step_chunks(self):
        self.swap_in()
        self._route_step()

    def _step_params(self):
        """A route whose kernel takes a list of tensors in one call (torch's fused kernels) gains
        nothing from chunks: it steps the parameters as they are, each reading its own grad (no
        gathering), and the user's step() gets only the params it steps per tensor, and those
        the kernel may not take (torch's fused kernels round strided tensors differently)."""
        if self.lists:
            return
        items, fresh = [], []
        state = self.opt.state
        for gi, group in enumerate(self.opt.param_groups):
            ready = [p for p in group["params"] if p.grad is not None and not p.grad.is_sparse
                     and unfusable_param(p) is None and p.is_contiguous() and p.grad.is_contiguous()]
            if ready:
                fresh += [p for p in ready if p not in state]
                items += [(gi, p, state[p]) for p in ready]
                taken = {id(p) for p in ready}
                self.lists.put(group, [p for p in group["params"] if id(p) not in taken])
        if items:
            self.route.step_chunks(self.opt, items)
            self.fused_steps += 1
        for p in fresh:        # an optimizer that keeps no state for it (SGD without momentum)
            if not state[p]:
                del state[p]

    def _route_step(self):
        """Under a rounding route: step the swapped-in chunks through it, and leave the user's
        step() only the params it steps per tensor."""
        if self.route is None or self.route.kind == "bitwise" or not self.swapped:
            return
        groups = self.opt.param_groups
        items = [(gi, run.chunks[ci], run.chunk_states[ci]) for gi, fused in self.swapped
                 for run in fused for ci in run.own]
        self.route.step_chunks(self.opt, items)
        for gi, fused in self.swapped:
            groups[gi]["params"] = groups[gi]["params"][sum(len(run.own) for run in fused):]

    # Every way out of a step puts the user's params back and mirrors the state per parameter.
    after_step = flush = deactivate = restore

    def describe(self):
        return dict(self.planner.layout(), fused_steps=self.fused_steps,
                    fallback_group_steps=self.fallback_steps, last_fallback=self.last_fallback)
