"""Mode multi_layer with the optimizer state sharded across the ranks of a DDP job (ZeRO-1 over
DDP's own allreduce).

DDP averages every gradient on every rank alike, as unpatched. Each rank then steps, through the
user's own ``step()``, only the chunks of its share of each flat run (flat_run.py, shares.py), with
the optimizer state of that share only; an elementwise update gives each element the value it gets
unpatched, so the weights stay DDP's bit for bit. After the step each share is broadcast from its
owner into every rank's flat buffer, so every rank holds all the weights before the next forward.

Outside ``step()`` this rank's ``optimizer.state`` holds, as unpatched, the state of the parameters
wholly in its share (views of its shard); the others have no entry. ``state_dict()`` gathers the
whole state, as unpatched would return it (``packed_state``): by the broadcasts when every rank
asks at the same step, else (a rank-0-only save) from the parts the other ranks' service threads
serve (comm/shard_service.py), read by ``part_at`` once this rank has ended the asker's step.
``load_state_dict()`` puts a whole state back per parameter, and the next plan keeps this rank's
share of it.

Whenever the plan is about to change (params moved, a param group added, a new chunk size), the
mode is left, or sharding stops, the state is first gathered back per parameter (``unshard``), so
nothing of it is lost; all of these happen at the same step on every rank. Sharding stops, for
good, when some parameters of a run have no gradient while others have (an optimizer skips a
parameter without a gradient, which a share of a run cannot do), or when its DDP model entered a
Join context (its ranks may step unevenly, and a rank that ran out of inputs would not join the
broadcasts): that optimizer goes on unsharded.
"""

import time
from dataclasses import dataclass

import torch

from ..multi_layer import MultiLayerStep, split_by_grads
from ..planner import FlatPlanner
from .whole_state import gather_state, local_part, served_state

PARTIAL = "some parameters of a run had no gradient while others had (they are skipped, unsharded)"


@dataclass
class Shards:
    """What one sharded mode hands the next as it is (multi_layer and backward cut the runs
    alike), so that a switch between them gathers nothing: the plan with its runs and their
    state, the runs sharded, and the counts the report and the service go on from."""
    planner: FlatPlanner
    sharded: list
    ended_runs: list
    counts: dict


COUNTS = ("received_bytes", "gathered_steps", "gather_seconds", "unshards", "served")


class ShardedStep(MultiLayerStep):
    def __init__(self, optimizer, chunk_bytes, exchange, owned_storages=None, shards=None):
        """``exchange``: the collectives over the ranks that share the state (comm/shard_exchange.py);
        ``shards``: what the last sharded mode handed over (``hand_over``), or None."""
        planner = shards.planner if shards is not None else \
            FlatPlanner(optimizer, chunk_bytes, owned_storages=owned_storages, share=(exchange.rank, exchange.world))
        super().__init__(optimizer, chunk_bytes, planner=planner)
        self.exchange = exchange
        self.sharded = []            # the runs whose state is sharded now
        self.stopped = None          # why sharding stopped
        self.received_bytes = 0      # over every step: the weights of other ranks' shares
        self.gathered_steps = 0
        self.gather_seconds = 0.0    # spent in those broadcasts (waiting for the slowest rank included)
        self.unshards = 0
        self.layout = {}             # the report's figures of the plan last sharded (_layout)
        self.served = 0              # state_dict() calls answered from parts other ranks served
        # What part_at serves another rank, read by the service thread: the runs sharded when the
        # last step ended (None: this rank's state changed since, by a load), and a count that is
        # odd while a step is under way and moves past each, so a read that overlapped one is
        # told apart.
        self._ended_runs = []
        self._changes = 0
        if shards is not None:
            self.sharded, self._ended_runs = shards.sharded, shards.ended_runs
            for name, value in shards.counts.items():
                setattr(self, name, value)
        exchange.serve(self.part_at)

    def hand_over(self, exchange):
        """The shards as they are, for the next mode sharding over the same ``exchange``; this
        strategy then holds nothing sharded (its ``deactivate()`` gathers nothing)."""
        if exchange is not self.exchange or not self.sharded or self.lists or self.planner.needs_plan():
            return None
        shards = Shards(self.planner, self.sharded, self._ended_runs,
                        {name: getattr(self, name) for name in COUNTS})
        self.layout = self._layout()
        self.sharded = []
        return shards

    def swap_in(self):
        if self.lists:
            return
        self._changes += 1 - self._changes % 2      # odd: under way (the step, a new plan)
        if self.planner.needs_plan():
            self.unshard()
            self.planner.plan()
            self.sharded = [run for run in self.planner.runs() if run.cuts is not None]
        if self.sharded:
            why = self.exchange.uneven() or (PARTIAL if split_by_grads(self.sharded)[2] else None)
            if why:
                self.stop(why)
                self.planner.plan()
        super().swap_in()

    def after_step(self):
        """The user's params and state are back; every rank gets the other shares' new weights."""
        stepped = [run for _, fused in self.swapped for run in fused if run.cuts is not None]
        self.restore()
        if stepped:
            t0 = time.perf_counter()
            self.received_bytes += self.exchange.broadcast_shares([(run.flat, run.cuts) for run in stepped])
            self.gather_seconds += time.perf_counter() - t0
            self.gathered_steps += 1
        self._ended_runs = list(self.sharded)
        self._changes += 2        # the state of the step just ended is what part_at may read now

    def restore(self):
        super().restore()
        if self._changes % 2 and not self.lists:    # even: the step is over (one that raised too)
            self._changes += 1

    def part_at(self, step):
        """This rank's parts of every sharded run as of the end of sharded step ``step`` (another
        rank asked alone); None while this rank is not there yet, or is inside a step. Called
        from the service thread: the parts are copied, then kept only if nothing changed meanwhile."""
        before, runs = self._changes, self._ended_runs
        if before % 2 or self.gathered_steps < step or self.lists:
            return None
        if self.gathered_steps > step:
            raise RuntimeError(f"this rank is at sharded step {self.gathered_steps}, past {step}")
        if runs is None:
            raise RuntimeError("a state was loaded on this rank since that step")
        parts = [local_part(run) for run in runs]
        return parts if self._changes == before else None

    def outlived(self):
        """The optimizer was freed (a script's ``main()`` returned): this rank's parts as of the
        last step stay servable, for a rank that saves alone after it (the usual last checkpoint)."""
        if self._ended_runs and not self._changes % 2 and not self.lists:
            self.exchange.keep_serving(self.gathered_steps, [local_part(run) for run in self._ended_runs])

    def deactivate(self):
        """Gather the state back (a collective); a rank that asked alone meanwhile is still served:
        the other ranks' unshard waits for it."""
        self.restore()
        self.unshard()
        self.exchange.stop_serving(self.part_at)

    def invalidate(self):
        """A state was loaded: it is whole per parameter now, and the shards are stale."""
        self._changes += 2
        self._ended_runs = None
        self.flush()
        self.sharded = []
        self.planner.mark_stale()

    def unshard(self):
        """Every sharded run's state back in ``optimizer.state``, whole (a collective)."""
        if self.sharded:
            self.layout = self._layout()        # the report keeps what was sharded
        runs, self.sharded = self.sharded, []
        for run in runs:
            for p, state in zip(run.params, gather_state(run, self.exchange)):
                if state:
                    self.opt.state[p] = state
        self.unshards += bool(runs)

    def stop(self, why):
        """Go on unsharded from the next plan on (the state is gathered now)."""
        self.unshard()
        self.planner.stop_sharding()
        self.stopped = why

    def packed_state(self, state_dict):
        """``state_dict`` (torch's, of this optimizer) with the whole state of the sharded
        parameters, gathered from every rank, in parameter order as unpatched packs it; None
        while nothing is sharded (then nothing is gathered, and no other rank is asked)."""
        if not self.sharded:
            return None
        what, step = f"state_dict() of {type(self.opt).__qualname__}", self.gathered_steps
        if self.exchange.asked_together(what, step):
            wholes = [gather_state(run, self.exchange) for run in self.sharded]
        else:
            parts = self.exchange.served_parts(what, step)
            wholes = [served_state(run, {r: runs[j] for r, runs in parts.items()})
                      for j, run in enumerate(self.sharded)]
            self.served += 1
        index = {id(p): i for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"])}
        state = dict(state_dict["state"])
        for run, run_wholes in zip(self.sharded, wholes):
            for p, whole in zip(run.params, run_wholes):
                if whole:
                    state[index[id(p)]] = whole
        order = sorted(k for k in state if isinstance(k, int)) + [k for k in state if not isinstance(k, int)]
        state_dict["state"] = {k: state[k] for k in order}
        return state_dict

    def describe(self):
        if self.sharded:
            self.layout = self._layout()
        out = dict(self.exchange.describe(), active=self.stopped is None, **self.layout,
                   received_bytes=self.received_bytes, gathered_steps=self.gathered_steps,
                   gather_seconds=round(self.gather_seconds, 6), unshards=self.unshards,
                   state_dicts_served=self.served)
        if self.stopped:
            out["stopped"] = self.stopped
        return dict(super().describe(), shard=out)

    def _layout(self):
        """Per rank, of the plan last sharded: the optimizer state held against what an
        unsharded run holds, and the weights received after each step."""
        held = whole = per_step = 0
        for run in self.sharded:
            for buf in run.flat_state.values():
                held += buf.numel() * buf.element_size()
                whole += run.numel * buf.element_size()
            per_step += (run.numel - (run.hi - run.lo)) * run.flat.element_size()
        rest = sum(v.numel() * v.element_size() for plan in (self.planner.plans or []) for p in plan.rest
                   for v in self.opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim())
        return {"state_bytes_unsharded": whole + rest, "state_bytes": held + rest,
                "unsharded_params": sum(len(plan.rest) for plan in (self.planner.plans or [])),
                "gather_bytes_per_step": per_step,
                "broadcasts_per_step": sum(sum(e > s for s, e in zip(run.cuts, run.cuts[1:])) for run in self.sharded)}
