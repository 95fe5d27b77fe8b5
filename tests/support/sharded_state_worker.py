"""One rank of the sharded-state tests: ``python sharded_state_worker.py SUITE RANK INIT_FILE OUT WORLD``.

A user's DDP script (6 steps, data drawn from (rank, step)) runs unpatched, then with
``fusion.shard: true`` under mode multi_layer and auto; checkpoints move from a sharded run to an
unpatched one and back, ``disable()`` mid-run hands the whole state back, a new chunk size mid-run
shards it again, a Join context ends sharding, and ``torch.distributed.checkpoint`` saves and loads
sharded state both ways. Each rank saves
whether losses, weights and ``state_dict()`` equal the unpatched run's bit for bit, and what the
report said.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import autopatch
from spawn import run_rank

RANK, WORLD = int(sys.argv[2]), int(sys.argv[5])     # of SUITE RANK INIT_FILE OUT WORLD (spawn.run_rank)
STEPS, HALF = 6, 3
SHARD = {"chunk_bytes": "64KiB", "fusion": {"shard": True}}
OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
              "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)}


class TrustRatioSGD(torch.optim.Optimizer):
    """A per-tensor update (LARS-like: scaled by the parameter's and its gradient's norms)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-6)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))


def batch(step):
    g = torch.Generator().manual_seed(10_000 * RANK + step)
    return torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)


def net():
    """About 1.2 MB of parameters in tensors large and small: with 64 KiB chunks every share
    holds parts of several runs and the cuts fall inside parameters and between them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 768), nn.ReLU(), nn.LayerNorm(768),
                         nn.Linear(768, 4))


def train(make_opt, steps, start=None, ddp=True):
    """Losses, weights and (every rank asks for it) the optimizer's state_dict after ``steps``;
    ``start``: (weights, state_dict) to begin from."""
    model = net()
    if start is not None:
        with torch.no_grad():
            for p, w in zip(model.parameters(), start[0]):
                p.copy_(w)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = make_opt(model.parameters())
    if start is not None:
        opt.load_state_dict(copy.deepcopy(start[1]))     # an optimizer steps the state it loads in place
    losses = [train_step(model, opt, step) for step in steps]
    held = sum(1 for p in model.parameters() if opt.state.get(p))
    return losses, [p.detach().clone() for p in model.parameters()], opt.state_dict(), held


def train_step(model, opt, step):
    """One step of the user's loop on ``step``'s batch; its loss."""
    x, y = batch(step)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def differs(got, ref):
    (losses, weights, sd), (ref_losses, ref_weights, ref_sd) = got[:3], ref[:3]
    if losses != ref_losses:
        return f"losses differ: {losses} vs {ref_losses}"
    for i, (w, r) in enumerate(zip(weights, ref_weights)):
        if not torch.equal(w, r):
            return f"weight {i} differs by {(w.double() - r.double()).abs().max().item():.3g}"
    if sd["state"].keys() != ref_sd["state"].keys() or sd["param_groups"] != ref_sd["param_groups"]:
        return f"state_dict keys differ: {list(sd['state'])} vs {list(ref_sd['state'])}"
    for i, st in ref_sd["state"].items():
        mine = sd["state"][i]
        if mine.keys() != st.keys():
            return f"state of param {i}: keys {list(mine)} vs {list(st)}"
        for key, v in st.items():
            w = mine[key]
            same = torch.equal(w, v) and w.stride() == v.stride() if isinstance(v, torch.Tensor) else w == v
            if not same:
                return f"state {key!r} of param {i} differs"
    return None


def sharded(**kw):
    autopatch.enable(**dict(SHARD, **kw))


def report_of(opt_index=0):
    o = autopatch.report()["optimizers"][opt_index]
    return {"mode": o["mode"], "reason": o["reason"], "shard": o.get("shard")}


def suite():
    res = {}
    for name, make in OPTIMIZERS.items():
        ref = train(make, range(STEPS))
        for mode in ("multi_layer", "auto"):
            sharded(mode=mode)
            try:
                got = train(make, range(STEPS))
                res["parity", name, mode] = dict(report_of(), differs=differs(got, ref), held=got[3],
                                                 params=len(ref[1]))
            finally:
                autopatch.disable()
            dist.barrier()

    # A resumed job builds a new DDP model, whose first buckets are not the rebuilt ones a running
    # job has: over more than two ranks gloo then sums some gradients in another order, so a
    # resumed run is compared with an unpatched run resumed from the unpatched checkpoint.
    adamw = OPTIMIZERS["adamw"]
    ref_first = train(adamw, range(HALF))
    ref_second = train(adamw, range(HALF, STEPS), start=(ref_first[1], ref_first[2]))
    sharded(mode="multi_layer")                     # sharded -> unpatched
    try:
        first = train(adamw, range(HALF))
    finally:
        autopatch.disable()
    second = train(adamw, range(HALF, STEPS), start=(first[1], first[2]))
    res["sharded_to_unpatched"] = differs(first, ref_first) or differs(second, ref_second)

    sharded(mode="multi_layer")                     # unpatched -> sharded
    try:
        second = train(adamw, range(HALF, STEPS), start=(ref_first[1], ref_first[2]))
        res["unpatched_to_sharded"] = dict(report_of(), differs=differs(second, ref_second))
    finally:
        autopatch.disable()

    ref = train(adamw, range(STEPS))
    res["disable_mid_run"] = mid_run(adamw, ref, lambda opt: autopatch.disable())
    res["replan_mid_run"] = mid_run(adamw, ref, new_chunk_size)
    res["join"] = join_uneven(adamw)
    res["backward_named"] = backward_named(adamw)
    res["backward_sharded"] = backward_sharded()
    res["refused"] = refused()
    res["distributed_checkpoint"] = distributed_checkpoint(adamw)
    res["state_dict_on_one_rank"] = state_dict_on_one_rank(adamw)
    res["store_growth"] = store_growth(adamw)
    return res


def mid_run(make, ref, change):
    """``change(opt)`` after 3 sharded steps (every rank alike), then 3 more: as unpatched."""
    sharded(mode="multi_layer")
    model = nn.parallel.DistributedDataParallel(net())
    opt = make(model.parameters())
    losses = []
    for step in range(STEPS):
        if step == HALF:
            change(opt)
        losses.append(train_step(model, opt, step))
    got = differs((losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()), ref)
    shard = report_of()["shard"] if autopatch.session() is not None else None
    autopatch.disable()
    return {"differs": got, "shard": shard}


def new_chunk_size(opt):
    """A new plan: the state is gathered whole, then cut again at the new chunks' shares."""
    autopatch.session().optimizer(opt).set_chunk_bytes("16KiB")


def join_uneven(make):
    """Sharded for 2 steps, then inside DDP's join() rank r takes 2 + r % 3 more: the state goes
    back whole at the first step inside it, and the rest runs as unpatched DDP's join()."""
    def run():
        model = nn.parallel.DistributedDataParallel(net())
        opt = make(model.parameters())
        losses = [train_step(model, opt, i) for i in range(2)]
        with Join([model]):
            losses += [train_step(model, opt, i) for i in range(2, 4 + RANK % 3)]
        return losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()
    ref = run()
    sharded(mode="multi_layer")
    try:
        got = run()
        return dict(report_of(), differs=differs(got, ref))
    finally:
        autopatch.disable()


def backward_named(make):
    """Mode backward over DDP's own reducer (the default) cannot update shares inside backward:
    multi_layer runs sharded, and the reason says so."""
    ref = train(make, range(HALF))
    sharded(mode="backward")
    try:
        got = train(make, range(HALF))
        return dict(report_of(), differs=differs(got, ref))
    finally:
        autopatch.disable()


OURS = {"allreduce": {"enabled": True}}     # autopatch's allreduce runs DDP's gradient sync
BACKWARD_SHARDED = dict(OURS, mode="backward", fusion={"shard": True, "observe_steps": 2})


def backward_sharded():
    """Mode backward with autopatch's allreduce running the sync: after the watch, each rank's
    share is updated inside backward. Compared with the sharded multi_layer run under the same
    allreduce, and at two ranks (where that allreduce sums as DDP does) with unpatched DDP; then
    rank 0 alone asks for the state mid-run, while the others have it served."""
    out, steps, ours = {}, range(8), OURS
    for name, make in OPTIMIZERS.items():
        ddp = train(make, steps)
        sharded(mode="multi_layer", **ours)
        try:
            ref = train(make, steps)
        finally:
            autopatch.disable()
        dist.barrier()
        sharded(**BACKWARD_SHARDED)
        try:
            got = train(make, steps)
            fusion = autopatch.report()["optimizers"][0]["fusion"]
            out[name] = dict(report_of(), differs=differs(got, ref), differs_from_ddp=differs(got, ddp),
                             in_backward=fusion.get("chunk_updates_in_backward"), held=got[3])
        finally:
            autopatch.disable()
        dist.barrier()
    out["ruled_out"] = backward_ruled_out(OPTIMIZERS["adamw"])
    out["state_dict_on_one_rank"] = state_dict_on_one_rank(
        OPTIMIZERS["adamw"], policy=BACKWARD_SHARDED, ref_policy=dict(SHARD, mode="multi_layer", **OURS),
        steps=8, saves=(4, 7))
    return out


def refused():
    """A per-tensor optimizer, and parameters outside any DDP model, stay unsharded and say why;
    training goes on as unpatched."""
    out = {}
    for name, make, ddp in (("per_tensor", TrustRatioSGD, True), ("outside_ddp", OPTIMIZERS["adamw"], False)):
        ref = train(make, range(HALF), ddp=ddp)
        sharded(mode="multi_layer")
        try:
            got = train(make, range(HALF), ddp=ddp)
            out[name] = dict(report_of(), differs=differs(got, ref))
        finally:
            autopatch.disable()
    return out


def distributed_checkpoint(make):
    """``torch.distributed.checkpoint`` as its docs use it with DDP (``get_state_dict``,
    ``dcp.save``; ``dcp.load``, ``set_state_dict``, every rank), half a run saved and the other
    half resumed, with the sharded run on either side: {side: None or how it differs from the
    same resume unpatched on both}."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def half(sharded_here, steps, folder, load):
        """Train ``steps`` (after loading the checkpoint in ``folder`` when ``load``, else saving
        one there after them); returns the run and whether its state was sharded."""
        if sharded_here:
            sharded(mode="multi_layer")
        try:
            model = nn.parallel.DistributedDataParallel(net())
            opt = make(model.parameters())
            if load:
                model_sd, opt_sd = get_state_dict(model, opt)
                dcp.load({"model": model_sd, "optim": opt_sd}, checkpoint_id=folder)
                set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
            losses = [train_step(model, opt, step) for step in steps]
            if not load:
                model_sd, opt_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=folder)
            active = report_of()["shard"]["active"] if sharded_here else False
            return (losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()), active
        finally:
            autopatch.disable()

    def resume(side):
        folder = [tempfile.mkdtemp(prefix="dcp-") if RANK == 0 else None]
        dist.broadcast_object_list(folder)
        try:
            first, saved_sharded = half(side == "save", range(HALF), folder[0], load=False)
            second, loaded_sharded = half(side == "load", range(HALF, STEPS), folder[0], load=True)
        finally:
            dist.barrier()
            if RANK == 0:
                shutil.rmtree(folder[0], ignore_errors=True)
        return (first[0] + second[0], *second[1:]), (saved_sharded, loaded_sharded)

    ref, _ = resume(None)
    out = {}
    for side in ("save", "load"):
        got, sharded_sides = resume(side)
        out[side] = differs(got, ref)
        if sharded_sides != (side == "save", side == "load"):
            out[side] = f"sharding was not active where asked: (save, load) {sharded_sides}"
    return out


def backward_ruled_out(make):
    """Sharded backward asked where it must not run: rank 0 alone reads the gradients between
    backward and step() (its watch rules backward out, so no rank may leave multi_layer), and a
    DDP model finding unused parameters. {case: the report's mode, reason and shard entry}"""
    out = {}
    for case in ("rank_0_reads_grads", "find_unused"):
        sharded(**BACKWARD_SHARDED)
        try:
            model = nn.parallel.DistributedDataParallel(net(), find_unused_parameters=case == "find_unused")
            opt = make(model.parameters())
            for step in range(6):
                x, y = batch(step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                if case == "rank_0_reads_grads" and RANK == 0:
                    torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                opt.step()
            out[case] = report_of()
        finally:
            autopatch.disable()
        dist.barrier()
    return out


def state_dict_on_one_rank(make, policy=None, ref_policy=None, steps=STEPS, saves=(HALF - 1, STEPS - 1)):
    """The checkpoint of most DDP scripts: rank 0 alone asks for ``opt.state_dict()`` mid-run and
    at the end (``if rank == 0: torch.save(...)``) while the other ranks train on; under
    ``ref_policy`` (None: unpatched), then sharded under ``policy`` (None: multi_layer).
    {"differs": None or how the sharded run's losses, weights or any state dict rank 0 saved
    differ from the first run's, "served": state_dict() calls rank 0 had served}"""
    def run(shard, policy):
        if shard:
            sharded(**(policy or {"mode": "multi_layer"}))
        elif policy:
            autopatch.enable(**policy)
        try:
            model = nn.parallel.DistributedDataParallel(net())
            opt = make(model.parameters())
            losses, saved = [], {}
            for step in range(steps):
                losses.append(train_step(model, opt, step))
                if RANK == 0 and step in saves:
                    saved[step] = copy.deepcopy(opt.state_dict())
            served = report_of()["shard"]["state_dicts_served"] if shard else 0
            return losses, [p.detach().clone() for p in model.parameters()], saved, served
        finally:
            autopatch.disable()
            dist.barrier()

    ref, got = run(False, ref_policy), run(True, policy)
    why = None
    for step in ref[2]:
        why = why or differs((got[0], got[1], got[2][step]), (ref[0], ref[1], ref[2][step]))
    return {"differs": why or (None if got[2].keys() == ref[2].keys() else "other saves"), "served": got[3]}


def store_growth(make, calls=5):
    """What ``state_dict()`` leaves in the job's store: keys added by ``calls`` calls on every
    rank at once, then by ``calls`` calls on rank 0 alone (the others wait at a barrier, served
    by their service threads). Each count is read between two barriers, while no rank is doing
    anything else. {"every_rank": added, "rank_0": added}"""
    from autopatch.job_store import job_store
    store = job_store()

    def keys():
        dist.barrier()
        n = store.num_keys()
        dist.barrier()
        return n
    sharded(mode="multi_layer")
    try:
        model = nn.parallel.DistributedDataParallel(net())
        opt = make(model.parameters())
        for step in range(2):
            train_step(model, opt, step)
        before = keys()
        for _ in range(calls):
            opt.state_dict()
        every = keys()
        for _ in range(calls):
            if RANK == 0:
                opt.state_dict()
        return {"every_rank": every - before, "rank_0": keys() - every}
    finally:
        autopatch.disable()
        dist.barrier()


if __name__ == "__main__":
    run_rank({"sharded": suite})
