"""The collectives of sharded optimizer state, over the process group of the DDP models it serves.

After each step every rank has updated its own share of each sharded flat run; the shares travel
by one broadcast per share from its owner, straight into every other rank's flat buffer (shares
may differ in length, and gloo's all-gather wants equal ones: padding would cost a copy of the
run). Gathering the whole state (``state_dict()``, leaving sharding) takes the same broadcasts
into a buffer of the run's length, plus one exchange of small per-parameter values.

Every rank of the group must reach each of these at the same point, as it reaches DDP's
allreduce: the steps that call them run on every rank alike. ``state_dict()`` is the exception a
user's script can break (a rank-0-only save): ``asked_together`` finds out through the job's store
whether every rank asks, and when not, ``served_parts`` has the other ranks' service threads send
their parts through the store instead (shard_service.py), so such a call gets the whole state as
unpatched, with no rank waiting on another. A DDP model that enters a Join context (``join()`` with uneven inputs) may
step unevenly from then on: ``uneven()`` says so, and the sharded step gives its state back at
the next step, which every rank still takes, and adds no collective after it.
"""

import torch.distributed as dist

from .shard_service import SERVICE, ShardedStateError
from .waiting import Waiter

__all__ = ["exchange_for", "ShardExchange", "ShardedStateError"]

JOINED = "its DDP model entered a Join context: its ranks may step unevenly"


def exchange_for(takeover, params):
    """``(ShardExchange, None)`` when the optimizer state of ``params`` may be sharded: every one
    of them is in a DDP model ``takeover`` (takeover.py) knows, over one group of two or more
    ranks, whose ranks step together and whose gradients are averaged, alike on every rank, before
    the step (no algorithm exchanging weights); else ``(None, why not)``."""
    ids = {id(p) for p in params}
    held, groups, models = set(), [], []
    for ddp, model in list(takeover.models.items()):
        mine = ids & {id(p) for p in ddp.module.parameters()}
        if not mine:
            continue
        if model.uneven:
            return None, JOINED
        algorithm = takeover.algorithms.get(ddp)
        if algorithm is not None:
            return None, f"communication algorithm {algorithm.name} exchanges weights or state itself"
        held |= mine
        models.append(model)
        if all(g is not model.group for g in groups):
            groups.append(model.group)
    if held != ids:
        return None, (f"{len(ids - held)} of its {len(ids)} parameters are in no DistributedDataParallel "
                      "model: their gradients are each rank's own")
    if len(groups) != 1:
        return None, "its parameters are in DDP models over different process groups"
    if dist.get_world_size(groups[0]) < 2:
        return None, "its DDP model's process group has one rank"
    return ShardExchange(groups[0], models), None


class ShardExchange:
    def __init__(self, group, models=()):
        """``models``: the takeover's records of the DDP models whose parameters are sharded."""
        self.group = group
        self.models = list(models)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.waiter = Waiter(None, "sharded optimizer state")   # the group's timeout; counted as comm
        self.number = SERVICE.number(tuple(self.ranks))          # the same optimizer's on every rank

    def broadcast_shares(self, buffers):
        """For each ``(flat, cuts)``: rank r's ``flat[cuts[r]:cuts[r + 1]]`` to every rank, in place.
        Returns the bytes this rank received."""
        works, received = [], 0
        for flat, cuts in buffers:
            for r in range(self.world):
                s, e = cuts[r], cuts[r + 1]
                if e > s:
                    works.append(dist.broadcast(flat[s:e], src=self.ranks[r], group=self.group, async_op=True))
                    if r != self.rank:
                        received += (e - s) * flat.element_size()
        self.waiter.wait(works, "the updated shares of the weights")
        return received

    def gather_objects(self, obj):
        """Every rank's ``obj`` (picklable), in the group's rank order."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def serve(self, read):
        """``read(step)`` (a bound method): this rank's parts of the state as of the end of
        ``step``, for a rank that asks alone (None while this rank is not there yet)."""
        SERVICE.register(tuple(self.ranks), self.number, read)

    def keep_serving(self, step, parts):
        """The optimizer was freed: serve ``parts``, this rank's as of the end of ``step``, still."""
        SERVICE.keep(tuple(self.ranks), self.number, step, parts)

    def stop_serving(self, read):
        """``read`` serves no more (a newer reader of the same optimizer stays)."""
        SERVICE.unregister(tuple(self.ranks), self.number, read)

    def asked_together(self, what, step):
        """True when every rank of the group asks for ``what`` at ``step``: gather by the
        broadcasts; False: ``served_parts``. Every asker gets the same answer."""
        return SERVICE.together(tuple(self.ranks), self.number, step, what)

    def served_parts(self, what, step):
        """``{group rank: its parts}`` of every other rank, as of the end of ``step``."""
        parts = SERVICE.served(tuple(self.ranks), self.number, step, what)
        return {self.ranks.index(r): part for r, part in parts.items()}

    def uneven(self):
        """Why the ranks may step unevenly from now on (a Join context), or None."""
        return f"{JOINED} from now on" if any(model.uneven for model in self.models) else None

    def why_not_in_backward(self):
        """Why shares may not be updated inside backward, or None. With
        ``find_unused_parameters`` a run may miss a gradient in a later step, found only at
        ``step()``, after part of it was updated."""
        if any(model.reducer is not None and model.reducer.find_unused for model in self.models):
            return "a DDP model has find_unused_parameters=True: a run may miss a gradient after part of it is updated"
        return None

    def describe(self):
        return {"ranks": self.world, "rank": self.rank}
