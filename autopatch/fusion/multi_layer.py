"""The multi-layer fused update: the user's own optimizer steps over a few flat chunks.

Around each ``step()`` the fused groups' ``params`` lists are swapped for chunk parameters (views
into flat buffers) and the chunks' state is put into ``optimizer.state``; afterwards everything is
swapped back, so outside ``step()`` the optimizer looks exactly as unpatched: same param groups,
per-parameter state (views into the flat state), same ``state_dict()``.
"""

from .chunking import bounded_chunk_bytes, smallest_share
from .eligibility import unfusable_param
from .flat import FlatRun, state_signature


class NotFusable(RuntimeError):
    """The optimizer's state after a fused step has no per-parameter form."""


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


class _GroupPlan:
    def __init__(self, group):
        self.original = group["params"]
        self.length = len(group["params"])
        self.runs = []
        self.rest = []



class MultiLayerStep:
    """Swaps flat chunks into an optimizer around each step. Not thread-safe per optimizer."""

    mode = "multi_layer"

    def __init__(self, optimizer, chunk_bytes, align=False, owned_storages=None, route=None):
        self.opt = optimizer
        # route (rounding.py): a rounding route steps the chunks itself; None or bitwise: the
        # user's step() steps them
        self.route = route
        self.chunk_bytes = int(chunk_bytes)     # as asked for; ``chunk_bytes_used`` after the cap
        self.chunk_bytes_used = None
        self.run_options = dict(align=align)
        # Storages of flat buffers built for this optimizer (by any mode): params living there
        # may be re-flattened, while params sharing a foreign buffer are left alone.
        self.owned = set() if owned_storages is None else owned_storages
        self.plans = None
        self.swapped = []
        self.held = []              # (group, its params) while the route stepped them in place
        self.dirty = True
        self.excluded = {}          # reason -> count of parameters left out of fusion
        self.fused_steps = 0
        self.fallback_steps = 0
        self.replans = 0
        self.last_fallback = None

    # -- planning ---------------------------------------------------------------------------
    def needs_plan(self):
        if self.plans is None or self.dirty or len(self.plans) != len(self.opt.param_groups):
            return True
        for plan, group in zip(self.plans, self.opt.param_groups):
            if group["params"] is not plan.original or len(group["params"]) != plan.length:
                return True
            if not all(run.is_intact() for run in plan.runs):
                return True
        return False

    def plan(self):
        """(Re)build flat runs for every group from the current params and state."""
        self.restore()
        storage_users = {}
        for g in self.opt.param_groups:
            for p in g["params"]:
                if unfusable_param(p) is None:
                    k = p.untyped_storage().data_ptr()
                    storage_users[k] = storage_users.get(k, 0) + 1
        self.excluded = {}
        groups = []
        for group in self.opt.param_groups:
            plan = _GroupPlan(group)
            buckets = {}
            for p in group["params"]:
                why = self._eligible_with(p, storage_users)
                sig = None if why else state_signature(p, self.opt.state.get(p, {}))
                if why is None and sig is None:
                    why = "optimizer state is not elementwise"
                if why:
                    self.excluded[why] = self.excluded.get(why, 0) + 1
                    plan.rest.append(p)
                    continue
                buckets.setdefault((p.dtype, p.device, sig), []).append(p)
            groups.append((plan, buckets))
        fused = [p for _, buckets in groups for params in buckets.values() for p in params]
        fused_bytes = sum(p.numel() * p.element_size() for p in fused)
        self.chunk_bytes_used = bounded_chunk_bytes(self.chunk_bytes, fused_bytes)
        kept = smallest_share(fused, fused_bytes)
        for plan, buckets in groups:
            for (dtype, _, sig), params in buckets.items():
                elems = max(1, self.chunk_bytes_used // params[0].element_size())
                for keep in (True, False):
                    share = [p for p in params if (id(p) in kept) == keep]
                    if share:
                        states = [self.opt.state[p] for p in share] if sig else None
                        plan.runs.append(FlatRun(share, states, elems, keep_grads=keep, **self.run_options))
        self.plans = [plan for plan, _ in groups]
        self.owned.update(run.flat.untyped_storage().data_ptr() for plan in self.plans for run in plan.runs)
        self.dirty = False
        self.replans += 1

    def _eligible_with(self, p, storage_users):
        why = unfusable_param(p)
        if why:
            return why
        st = p.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.owned:
            return None
        if storage_users[ptr] > 1:
            return "shares storage with another parameter"
        if st.nbytes() != p.numel() * p.element_size():
            return "is a view into a larger buffer"
        return None

    # -- the step -----------------------------------------------------------------------------
    def swap_in(self):
        """Give the chunks their grads and put them in place of the fused params.

        A run fuses when every one of its params has a dense grad. A run where none has one
        (an unused head) is simply skipped, as the optimizer would skip it. A run where only some
        have one steps per tensor, exactly as unpatched, and is re-planned afterwards so params
        whose state moved differently stop sharing a run.
        """
        if self.swapped:
            return
        if self.needs_plan():
            self.plan()
        for plan, group in zip(self.plans, self.opt.param_groups):
            if not plan.runs:
                continue
            fused, unfused, partial = split_by_grads(plan.runs)
            if partial:
                self.dirty = True
                self.fallback_steps += partial
                self.last_fallback = "some parameters of a run had no gradient, or a sparse one"
            if not fused:
                continue
            for run in fused:
                run.bind_grads(range(len(run.chunks)))
            group["params"] = [c for run in fused for c in run.chunks] + unfused + plan.rest
            for run in fused:
                for c, cs in zip(run.chunks, run.chunk_states):
                    self.opt.state[c] = cs
            self.swapped.append((group, plan, fused))
        if self.swapped:
            self.fused_steps += 1

    def restore(self):
        """Put the user's params back and keep per-parameter state in step with the flat state."""
        held, self.held = self.held, []
        for group, params in held:
            group["params"] = params
        swapped, self.swapped = self.swapped, []
        for group, plan, fused in swapped:
            group["params"] = plan.original
            for run in fused:
                run.release_grads()
                for c in run.chunks:
                    self.opt.state.pop(c, None)
                why = run.sync(self.opt.state.__getitem__)
                if why:
                    raise NotFusable(f"{type(self.opt).__qualname__} cannot be fused: {why}")

    def invalidate(self):
        """State or params were replaced from outside (load_state_dict, add_param_group)."""
        self.restore()
        self.dirty = True

    # -- the protocol every fusion mode follows (see controller.py) ----------------------------
    def before_step(self, closure):
        """Swap chunks in; with a closure, only once the closure has computed the grads.

        Returns the closure the optimizer should call instead, or None.
        """
        fuse = self._step_params if getattr(self.route, "takes_params", False) else self._step_chunks
        if closure is None:
            fuse()
            return None

        def closure_then_fuse():
            loss = closure()
            fuse()
            return loss
        return closure_then_fuse

    def _step_chunks(self):
        self.swap_in()
        self._route_step()

    def _step_params(self):
        """A route whose kernel takes a list of tensors in one call (torch's fused kernels) gains
        nothing from chunks: it steps the parameters as they are, each reading its own grad (no
        gathering), and the user's step() gets only the params it steps per tensor."""
        if self.held:
            return
        items = []
        for gi, group in enumerate(self.opt.param_groups):
            ready = [p for p in group["params"] if p.grad is not None and not p.grad.is_sparse
                     and unfusable_param(p) is None]
            if ready:
                items += [(gi, p, self.opt.state[p]) for p in ready]
                self.held.append((group, group["params"]))
                taken = {id(p) for p in ready}
                group["params"] = [p for p in group["params"] if id(p) not in taken]
        if items:
            self.route.step_chunks(self.opt, items)
            self.fused_steps += 1

    def _route_step(self):
        """Under a rounding route: step the swapped-in chunks through it, and leave the user's
        step() only the params it steps per tensor."""
        if self.route is None or self.route.kind == "bitwise" or not self.swapped:
            return
        index = {id(g): gi for gi, g in enumerate(self.opt.param_groups)}
        items = [(index[id(group)], c, cs) for group, _, fused in self.swapped
                 for run in fused for c, cs in zip(run.chunks, run.chunk_states)]
        self.route.step_chunks(self.opt, items)
        for group, _, fused in self.swapped:
            group["params"] = group["params"][sum(len(run.chunks) for run in fused):]

    def after_step(self):
        self.restore()

    def flush(self):
        self.restore()

    def deactivate(self):
        self.restore()

    def set_chunk_bytes(self, chunk_bytes):
        self.chunk_bytes = int(chunk_bytes)
        self.invalidate()

    def layout(self):
        """The flat runs as planned: what a report shows for any mode built on them."""
        runs = [run for plan in (self.plans or []) for run in plan.runs]
        return {
            "runs": len(runs),
            "chunks": sum(len(r.chunks) for r in runs),
            "fused_params": sum(len(r.params) for r in runs),
            "flat_bytes": sum(r.numel * r.flat.element_size() for r in runs),
            "gathered_params": sum(r.gathered_params for r in runs),
            "kept_grad_bytes": sum(r.kept_grad_bytes for r in runs),
            "chunk_bytes": self.chunk_bytes_used,
            "chunk_bytes_requested": self.chunk_bytes,
            "replans": self.replans,
            "excluded_params": dict(self.excluded),
        }

    def describe(self):
        return dict(self.layout(), fused_steps=self.fused_steps,
                    fallback_group_steps=self.fallback_steps, last_fallback=self.last_fallback)
