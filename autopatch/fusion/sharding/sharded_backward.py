"""Mode backward with the optimizer state sharded across the ranks of a DDP job (ZeRO-1's state,
with the update overlapped with backward as ZeRO-2 overlaps it).

The plan, the shares, the broadcasts after ``step()`` and everything that gathers the state are
the sharded multi_layer step's (sharded_step.py). What changes is when a rank's own chunks are
updated: autopatch's allreduce (``averaged_by``) says when a bucket's averaged gradients are
final, and each chunk of this rank's share is updated as soon as the last of its parameters has
been averaged, while backward goes on with the next buckets. ``step()`` then updates only the
own chunks backward did not reach (the first step of a plan, a parameter moved), and the
broadcasts bring every rank the other shares. The gradients are DDP's averages either way and
the update elementwise, so the weights are those of the multi_layer sharded step bit for bit.

Gradients stay in place (each ``.grad`` is what it is after an unpatched backward): what is
saved is the optimizer state, as in the multi_layer sharded step. As for unsharded backward
fusion, only correct when nothing reads or changes the gradients between backward and
``step()``: the watch over the first steps checks that before this mode is chosen, and a second
gradient before ``step()`` (accumulation) raises, or, not strict, stops the in-backward updates
with the reason (``unsafe``).
"""

from ...steps_in_flight import IN_FLIGHT
from ..backward import ACCUMULATION, AccumulationError, refuse_closure
from ..routes import Route
from .sharded_step import ShardedStep


class ShardedBackward(ShardedStep):
    def __init__(self, optimizer, chunk_bytes, exchange, averaged_by, owned_storages=None, strict=True,
                 shards=None):
        super().__init__(optimizer, chunk_bytes, exchange, owned_storages=owned_storages, shards=shards)
        self.averaged_by = averaged_by
        self.strict = strict
        self.unsafe = None
        self.chunk_route = Route(optimizer)    # a chunk stepped alone, through the user's own step
        self.units = []          # (group index, run, chunk index) of every own chunk of a sharded run
        self.units_of = {}       # id(param) -> the units it has elements in
        self.sizes = []          # unit -> how many parameters it waits for
        self.left = []           # this step: unit -> parameters still to be averaged
        self.arrived = set()     # this step: ids of the parameters averaged
        self.done = set()        # this step: (id(run), chunk index) updated inside backward
        self.in_backward = 0     # chunk updates done inside backward
        self.hook = None
        self._armed_runs = None  # the sharded runs ``units`` were built for (``sharded`` of a plan)

    def _arm(self):
        """Count down the own chunks of the plan's sharded runs on the allreduce's events: built
        once per plan, and only the counts start again at each step. A plan that went stale
        since is caught at its first update (``_step_unit``)."""
        if self.sharded is not self._armed_runs:
            self._unhook()
            if not self.sharded:
                return
            group_of = {id(run): gi for gi, plan in enumerate(self.planner.plans) for run in plan.runs}
            for run in self.sharded:
                for ci in run.own:
                    i0, i1 = run.chunk_spans[ci]
                    unit = len(self.units)
                    self.units.append((group_of[id(run)], run, ci))
                    self.sizes.append(i1 - i0)
                    for p in run.params[i0:i1]:
                        self.units_of.setdefault(id(p), []).append(unit)
            self._armed_runs = self.sharded
            self.hook = self.averaged_by.on_averaged(self._on_averaged)
        self.left = list(self.sizes)
        self.arrived, self.done = set(), set()

    def _unhook(self):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self.units, self.units_of, self.sizes, self.left = [], {}, [], []
        self.arrived, self.done = set(), set()
        self._armed_runs = None

    def _on_averaged(self, params):
        """A region (steps_in_flight.py): enable() and disable() land between two buckets."""
        if IN_FLIGHT.pending:
            IN_FLIGHT.entering()
        try:
            for p in params:
                units = self.units_of.get(id(p))
                if not units or self.unsafe:
                    continue
                if id(p) in self.arrived:
                    if self.strict:
                        raise AccumulationError(f"autopatch mode 'backward' (sharded): {ACCUMULATION}; use "
                                                "mode 'multi_layer' or 'auto' for this optimizer")
                    self.unsafe = ACCUMULATION
                    return
                self.arrived.add(id(p))
                for unit in units:
                    self.left[unit] -= 1
                    if not self.left[unit]:
                        self._step_unit(unit)
        finally:
            if IN_FLIGHT.pending:
                IN_FLIGHT.left()

    def _step_unit(self, unit):
        gi, run, ci = self.units[unit]
        i0, i1 = run.chunk_spans[ci]
        params = run.params[i0:i1]
        if any(p.data_ptr() != ptr or p.grad is None or p.grad.is_sparse
               for p, ptr in zip(params, run.param_ptrs[i0:i1])):
            return      # step() sees it: a moved parameter re-plans, a missing grad stops sharding
        if not self.done:
            if self.planner.needs_plan():
                return  # step() re-plans first, and updates every own chunk
            self._changes += 1 - self._changes % 2      # odd: this rank's state is changing
        run.grads.bind((ci,))
        try:
            self.chunk_route.step_chunks(self.opt, [(gi, run.chunks[ci], run.chunk_states[ci])])
        finally:
            run.grads.release((ci,))
        self.done.add((id(run), ci))
        self.in_backward += 1

    def swap_in(self):
        if self.done and not self.lists and self.planner.needs_plan():
            raise RuntimeError(
                "autopatch mode 'backward' (sharded): the parameters or param groups changed between "
                "backward and step(), after part of the update ran inside backward; use mode "
                "'multi_layer' for this optimizer")
        super().swap_in()

    def chunks_to_step(self, run):
        done = self.done
        return [ci for ci in run.own if (id(run), ci) not in done] if done else run.own

    def updated_before_step(self):
        return bool(self.done)

    def before_step(self, closure):
        refuse_closure(closure)
        return super().before_step(None)

    def after_step(self):
        super().after_step()
        self._arm()

    def activated(self):
        """Shards handed over arm at once: the very next backward updates them."""
        self._arm()

    def deactivate(self):
        self._unhook()
        super().deactivate()

    def invalidate(self):
        self._unhook()
        super().invalidate()

    def set_chunk_bytes(self, chunk_bytes):
        self._unhook()
        super().set_chunk_bytes(chunk_bytes)

    def describe(self):
        return dict(super().describe(), chunk_updates_in_backward=self.in_backward)
