"""One rank of the FSDP2 and tensor-parallel tests: ``python fsdp_worker.py SUITE RANK INIT_FILE OUT``.

Every scenario trains the same seeded job unpatched and under autopatch in this process group and
saves what the tests compare: losses, full weights, the optimizer's state as ``state_dict()`` and
``get_optimizer_state_dict`` give it (layout and values), the report. Each rank feeds different
data under FSDP2, so the reduce-scatter matters; tensor parallelism needs the same input on every
rank.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import autopatch
from training import BertAdam

WIDTH = 64
SUITE, RANK, INIT_FILE, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
SHARED = os.path.dirname(OUT)     # both ranks' directory: checkpoints go there
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "bert": lambda params: BertAdam(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def fsdp_toy():
    """6 x (Linear, LayerNorm, GELU) + Linear, each Linear and the root sharded by FSDP2."""
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 4))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def tp_toy():
    """An MLP whose first two Linears are split across the ranks (column-wise, then row-wise);
    the head stays a plain module, so one optimizer holds DTensors and plain tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def fsdp1_toy(use_orig_params):
    """FSDP1: a FlatParameter per wrapped module (or, with use_orig_params, views into it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))
    return FullyShardedDataParallel(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def batch(step, width=WIDTH, same_on_every_rank=False):
    g = torch.Generator().manual_seed(10 * step + (0 if same_on_every_rank else 1000 * RANK))
    return torch.randn(8, width, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(model, opt, steps, start=0, tp=False):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, 16 if tp else WIDTH, same_on_every_rank=tp)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def layout(value):
    """What a state or parameter value is, for comparison: type, DTensor layout, local values."""
    if isinstance(value, DTensor):
        return {"type": "DTensor", "placements": str(value.placements), "shape": tuple(value.shape),
                "stride": value.stride(), "mesh": value.device_mesh.mesh.tolist(),
                "local": value.to_local().detach().clone()}
    if isinstance(value, torch.Tensor):
        return {"type": "Tensor", "shape": tuple(value.shape), "value": value.detach().clone()}
    return {"type": type(value).__name__, "value": value}


def state_layout(state):
    return {k: {key: layout(v) for key, v in entry.items()} for k, entry in state.items()}


def outcome(model, opt, losses, enabled, dcp_view=True):
    """``dcp_view``: also the state as get_optimizer_state_dict gives it (every parameter must
    belong to ``model``)."""
    out = {"losses": losses, "weights": [full(p).detach().clone() for p in model.parameters()],
           "state": state_layout(opt.state_dict()["state"]),
           "report": autopatch.report() if enabled else None}
    if dcp_view:
        out["dcp_state"] = state_layout(get_optimizer_state_dict(model, opt)["state"])
    return out


def job(enable=None, optimizer="adamw", steps=5, model=fsdp_toy, dcp_view=True):
    """Train, with autopatch enabled by ``enable(**enable)`` before anything is built when given."""
    if enable is not None:
        autopatch.enable(**enable)
    try:
        net = model()
        opt = OPTIMIZERS[optimizer](net.parameters())
        losses = train(net, opt, steps, tp=model is tp_toy)
        return outcome(net, opt, losses, enable is not None, dcp_view)
    finally:
        autopatch.disable()


def checkpoint_round_trip(save_patched, name):
    """Train 3 steps, save with DCP, then train 2 more steps in a fresh job that loads it; the
    saving side patched or not as asked, the loading side the other way."""
    path = os.path.join(SHARED, name)
    autopatch.enable(mode="multi_layer") if save_patched else None
    try:
        net = fsdp_toy()
        opt = OPTIMIZERS["adamw"](net.parameters())
        first = train(net, opt, 3)
        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    finally:
        autopatch.disable()
    dist.barrier()
    autopatch.enable(mode="multi_layer") if not save_patched else None
    try:
        net = fsdp_toy()
        opt = OPTIMIZERS["adamw"](net.parameters())
        model_sd, optim_sd = get_state_dict(net, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        loaded = state_layout(opt.state_dict()["state"])
        rest = train(net, opt, 2, start=3)
        return dict(outcome(net, opt, first + rest, not save_patched), loaded=loaded)
    finally:
        autopatch.disable()


def optimizer_state_dict_round_trip():
    """get_optimizer_state_dict of a patched run, set into an unpatched one, and the other way."""
    out = {}
    for source_patched in (True, False):
        autopatch.enable(mode="multi_layer") if source_patched else None
        try:
            net = fsdp_toy()
            opt = OPTIMIZERS["adamw"](net.parameters())
            train(net, opt, 3)
            osd = get_optimizer_state_dict(net, opt)
            weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
        finally:
            autopatch.disable()
        autopatch.enable(mode="multi_layer") if not source_patched else None
        try:
            net = fsdp_toy()
            net.load_state_dict(weights)
            opt = OPTIMIZERS["adamw"](net.parameters())
            set_optimizer_state_dict(net, opt, osd)
            losses = train(net, opt, 2, start=3)
            out["patched_to_unpatched" if source_patched else "unpatched_to_patched"] = outcome(
                net, opt, losses, not source_patched)
        finally:
            autopatch.disable()
    return out


def fsdp():
    res = {"ref": job(), "default": job({}), "multi_layer": job({"mode": "multi_layer"}),
           "backward": job({"mode": "backward", "fusion": {"observe_steps": 2}}),
           "ref_22": job(steps=22),
           "auto": job({"mode": "auto", "fusion": {"observe_steps": 2, "measure_steps": 16}}, steps=22)}
    for name in ("bert", "sgd"):
        res[f"ref_{name}"] = job(optimizer=name)
        res[name] = job({"mode": "multi_layer"}, optimizer=name)
    res["ckpt_patched_to_unpatched"] = checkpoint_round_trip(True, "ckpt_patched")
    res["ckpt_unpatched_to_patched"] = checkpoint_round_trip(False, "ckpt_unpatched")
    res.update(optimizer_state_dict_round_trip())
    for orig in (False, True):
        fsdp1 = lambda: fsdp1_toy(orig)
        res[f"ref_fsdp1_{orig}"] = job(model=fsdp1, dcp_view=False)
        res[f"fsdp1_{orig}"] = job({"mode": "multi_layer"}, model=fsdp1, dcp_view=False)
    return res


def partial_param_group(patched):
    """A second param group holding a Partial DTensor (each rank holds an addend of the value):
    it must step as unpatched, on its DTensor, while the first group steps as local shards.
    SGD, as AdamW's in-place division has no sharding rule for a Partial tensor."""
    autopatch.enable(mode="multi_layer") if patched else None
    try:
        net = tp_toy()
        mesh = next(p for p in net.parameters() if isinstance(p, DTensor)).device_mesh
        torch.manual_seed(1)
        addend = nn.Parameter(DTensor.from_local(torch.randn(6), mesh, [Partial()], run_check=False))
        opt = torch.optim.SGD([{"params": list(net.parameters())}, {"params": [addend]}], lr=0.1, momentum=0.9)
        losses = []
        for step in range(4):
            x, y = batch(step, 16, same_on_every_rank=True)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            g = torch.Generator().manual_seed(step + 100 * RANK)
            addend.grad = DTensor.from_local(torch.randn(6, generator=g), mesh, [Partial()], run_check=False)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out = outcome(net, opt, losses, patched, dcp_view=False)
        out["partial"] = addend.to_local().detach().clone()
        return out
    finally:
        autopatch.disable()


def tp():
    return {"ref": job(model=tp_toy), "adamw": job({"mode": "multi_layer"}, model=tp_toy),
            "ref_bert": job(optimizer="bert", model=tp_toy), "bert": job({"mode": "multi_layer"}, optimizer="bert", model=tp_toy),
            "ref_partial": partial_param_group(False), "partial": partial_param_group(True)}


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"file://{INIT_FILE}", rank=RANK, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {"fsdp": fsdp, "tp": tp}[SUITE]()
    torch.save(results, OUT)
    dist.barrier()
    dist.destroy_process_group()
