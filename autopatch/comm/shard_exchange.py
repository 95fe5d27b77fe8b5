"""The collectives of sharded optimizer state, over the process group of the DDP models it serves.

After each step every rank has updated its own share of each sharded flat run; the shares travel
by one broadcast per share from its owner, straight into every other rank's flat buffer (shares
may differ in length, and gloo's all-gather wants equal ones: padding would cost a copy of the
run). Gathering the whole state (``state_dict()``, leaving sharding) takes the same broadcasts
into a buffer of the run's length, plus one exchange of small per-parameter values.

Every rank of the group must reach each of these at the same point, as it reaches DDP's
allreduce: the steps that call them run on every rank alike. ``state_dict()`` is the exception a
user's script can break (a rank-0-only save): ``check_everyone`` asks the group through the job's
store, bounded in time, before the first collective, so such a call raises a clear error instead
of waiting forever. A DDP model that enters a Join context (``join()`` with uneven inputs) may
step unevenly from then on: ``uneven()`` says so, and the sharded step gives its state back at
the next step, which every rank still takes, and adds no collective after it.
"""

import torch.distributed as dist

from .. import agreement
from .waiting import Waiter

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


class ShardedStateError(RuntimeError):
    """A sharded optimizer's whole state was asked for on some ranks only."""


class ShardExchange:
    def __init__(self, group, models=()):
        """``models``: the takeover's records of the DDP models whose parameters are sharded."""
        self.group = group
        self.models = list(models)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.waiter = Waiter(None, "sharded optimizer state")   # the group's timeout; counted as comm

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

    def check_everyone(self, what):
        """Raise ShardedStateError unless every rank of the group asks for ``what`` too (waiting
        at most ``agreement.WAIT_SECONDS`` for the others)."""
        try:
            agreement.gather(what, True, self.group)
        except agreement.AgreementLost as e:
            raise ShardedStateError(
                f"{what} gathers the optimizer state sharded over {self.world} ranks, a collective that "
                f"every rank must call at the same point, but another rank did not ({e}). Call it on "
                "every rank (then save on one), or run without fusion.shard") from None

    def uneven(self):
        """Why the ranks may step unevenly from now on (a Join context), or None."""
        return f"{JOINED} from now on" if any(model.uneven for model in self.models) else None

    def describe(self):
        return {"ranks": self.world, "rank": self.rank}
