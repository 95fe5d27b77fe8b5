"""The plan of flat buffers for one optimizer: which parameters share a run, and its chunks.

Every fused mode steps the same kind of plan: per param group, flat runs of parameters that share
dtype, device and the shape of their optimizer state (fusion/flat.py), and the parameters left
out, with the reason. Multi-layer fusion cuts runs into chunks of up to ``chunk_bytes``;
backward and forward fusion keep each parameter whole in one chunk (``align``), as they update
chunks as their parameters' gradients become final. The planner only plans: the strategies that
compose it decide when a plan is stale (``mark_stale``) and step the runs.

By default a parameter moves into a buffer of autopatch's (its ``.data`` becomes a view of it).
``adopt_back_to_back`` also takes runs of parameters already lying back to back in a storage
that is not autopatch's (a buffer the user, or Bagua-style code, built) as flat buffers where they
lie; ``moves_params=False`` fuses only such runs and never moves a parameter
(``autopatch.contrib.fuse_optimizer``'s ``do_flatten`` and ``check_flatten``).
"""

from .back_to_back import runs_in_place
from .chunking import bounded_chunk_bytes, smallest_share
from .flattenable import unfusable_param
from .flat_run import FlatRun, state_signature, unflattenable_state
from .strategy import WeakOptimizer


class GroupPlan:
    """One param group's flat runs, and its parameters left out of them."""

    def __init__(self, group):
        self.original = group["params"]
        self.length = len(group["params"])
        self.runs = []
        self.rest = []


class FlatPlanner:
    opt = WeakOptimizer()

    def __init__(self, optimizer, chunk_bytes, align=False, owned_storages=None,
                 adopt_back_to_back=False, moves_params=True, share=None):
        self.opt = optimizer
        self.chunk_bytes = int(chunk_bytes)     # as asked for; ``chunk_bytes_used`` after the cap
        self.chunk_bytes_used = None
        self.align = align
        self.adopt_back_to_back = adopt_back_to_back
        self.moves_params = moves_params
        self.share = share          # (rank, world): runs' optimizer state sharded (flat_run.py)
        # Storages of flat buffers built for this optimizer (by any mode): params living there
        # may be re-flattened, while params sharing a foreign buffer are left alone.
        self.owned = set() if owned_storages is None else owned_storages
        self.plans = None
        self.stale = True
        self.excluded = {}          # reason -> count of parameters left out of fusion
        self.replans = 0

    def set_chunk_bytes(self, chunk_bytes):
        self.chunk_bytes = int(chunk_bytes)
        self.stale = True

    @property
    def chunk_bytes_in_use(self):
        """The chunk size of the current plan (after the memory bound), else the one asked for."""
        return self.chunk_bytes_used or self.chunk_bytes

    def mark_stale(self):
        """The optimizer's params or state changed from outside: plan again before the next use."""
        self.stale = True

    def stop_sharding(self):
        """From the next plan on, every run holds its whole optimizer state."""
        self.share = None
        self.stale = True

    def stop_moving(self):
        """From now on fuse only runs already back to back; never move a parameter again."""
        self.moves_params = False

    def needs_plan(self):
        if self.plans is None or self.stale or len(self.plans) != len(self.opt.param_groups):
            return True
        for plan, group in zip(self.plans, self.opt.param_groups):
            if group["params"] is not plan.original or len(group["params"]) != plan.length:
                return True
            if not all(run.is_intact() for run in plan.runs):
                return True
        return False

    def plan(self):
        """(Re)build flat runs for every group from the current params and state. Call it only
        while the user's params are in place (nothing swapped in)."""
        if self.adopt_back_to_back or not self.moves_params:
            runs, why_not = runs_in_place(self.opt)
            if not self.moves_params:
                self._plan_in_place(runs, why_not)
                return
            self.owned.update(ptr for ptr, _, _ in runs)
        self._plan_moving()

    def _plan_moving(self):
        storage_users = {}
        for g in self.opt.param_groups:
            for p in g["params"]:
                if unfusable_param(p) is None:
                    k = p.untyped_storage().data_ptr()
                    storage_users[k] = storage_users.get(k, 0) + 1
        self.excluded = {}
        groups = []
        for group in self.opt.param_groups:
            plan = GroupPlan(group)
            by_kind = {}     # (dtype, device, state signature) -> its parameters, in order
            for p in group["params"]:
                why = self._eligible_with(p, storage_users)
                sig = None if why else state_signature(p, self.opt.state.get(p, {}))
                if why is None and sig is None:
                    why = unflattenable_state(p, self.opt.state.get(p, {}))
                if why:
                    self._exclude(plan, p, why)
                    continue
                by_kind.setdefault((p.dtype, p.device, sig), []).append(p)
            groups.append((plan, by_kind))
        fused = [p for _, by_kind in groups for params in by_kind.values() for p in params]
        fused_bytes = sum(p.numel() * p.element_size() for p in fused)
        self.chunk_bytes_used = bounded_chunk_bytes(self.chunk_bytes, fused_bytes)
        kept = smallest_share(fused, fused_bytes)
        for plan, by_kind in groups:
            for (_, _, sig), params in by_kind.items():
                for keep in (True, False):
                    share = [p for p in params if (id(p) in kept) == keep]
                    if share:
                        plan.runs.append(self._run(share, bool(sig), keep_grads=keep))
        self._done([plan for plan, _ in groups])

    def _plan_in_place(self, runs, why_not):
        """Only runs already back to back, each a flat buffer where it lies."""
        self.excluded = {}
        plans = [GroupPlan(g) for g in self.opt.param_groups]
        self.chunk_bytes_used = self.chunk_bytes
        for _, gi, run in runs:
            plans[gi].runs.append(self._run([p for p, _ in run], bool(run[0][1]), keep_grads=False))
        fused = {id(p) for _, _, run in runs for p, _ in run}
        for plan, group in zip(plans, self.opt.param_groups):
            for p in group["params"]:
                if id(p) not in fused:
                    self._exclude(plan, p, why_not.get(
                        id(p), "not back to back with another parameter (do_flatten=False)"))
        self._done(plans)

    def _run(self, params, has_state, keep_grads):
        states = [self.opt.state[p] for p in params] if has_state else None
        elems = max(1, self.chunk_bytes_used // params[0].element_size())
        run = FlatRun(params, states, elems, align=self.align, keep_grads=keep_grads, share=self.share)
        for p in params if self.share is not None else ():
            if p in self.opt.state and not self.opt.state[p]:
                del self.opt.state[p]      # its state is another rank's: absent here, as never stepped
        return run

    def _exclude(self, plan, p, why):
        self.excluded[why] = self.excluded.get(why, 0) + 1
        plan.rest.append(p)

    def _done(self, plans):
        self.plans = plans
        self.owned.update(run.flat.untyped_storage().data_ptr() for plan in plans for run in plan.runs)
        self.stale = False
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

    def runs(self):
        return [run for plan in (self.plans or []) for run in plan.runs]

    def layout(self):
        """The flat runs as planned: the report's keys, the same for every mode."""
        runs = self.runs()
        return {
            "runs": len(runs),
            "chunks": sum(len(r.chunks) for r in runs),
            "fused_params": sum(len(r.params) for r in runs),
            "flat_bytes": sum(r.numel * r.flat.element_size() for r in runs),
            "gathered_params": sum(r.grads.gathered_params for r in runs),
            "kept_grad_bytes": sum(r.grads.kept_bytes for r in runs),
            "chunk_bytes": self.chunk_bytes_used,
            "chunk_bytes_requested": self.chunk_bytes,
            "replans": self.replans,
            "excluded_params": dict(self.excluded),
        }
