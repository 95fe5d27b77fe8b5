"""Every rank starts from one rank's optimizer state, as Bagua's ``with_bagua`` made it.

DDP broadcasts a model's parameters and buffers from the first rank of its process group when it
is built; the optimizers over that model are not DDP's business, so ranks that trained apart, or
loaded different checkpoints, would drift apart again at the first step. ``broadcast_states``
gives every rank of the group the first rank's: each param group's hyperparameters (everything
but ``params``) and every parameter's state entries (momenta, Adam's moments, step counts),
created where a rank has none yet. Tensors travel in collectives over the group where its
backend carries them (CUDA tensors on NCCL, the rest on gloo), anything else in one pickled
message per optimizer. Parameters are matched by their place in the param groups, as
``state_dict()`` numbers them.
"""

import torch
import torch.distributed as dist

from ..dist import first_rank


def broadcast_states(optimizers, group):
    """A collective over ``group``: every rank calls it with its optimizers in the same order."""
    src = first_rank(group)
    first = dist.get_rank(group) == 0
    nccl = dist.get_backend(group) == "nccl"
    for opt in optimizers:
        box = [_layout(opt, nccl) if first else None]
        dist.broadcast_object_list(box, src=src, group=group)
        layout = box[0]
        _check_same_shape(opt, layout)
        for group_settings, settings in zip(opt.param_groups, layout["groups"]):
            group_settings.update(settings)
        params = [p for g in opt.param_groups for p in g["params"]]
        for index, key, how, value in layout["state"]:
            state = opt.state[params[index]]
            if how == "value":
                state[key] = value
                continue
            shape, dtype, device = value
            tensor = state.get(key)
            if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or tensor.dtype != dtype:
                tensor = state[key] = torch.empty(shape, dtype=dtype, device=params[index].device if device else "cpu")
            dist.broadcast(tensor, src=src, group=group)


def _layout(opt, nccl):
    """What the first rank sends: hyperparameters, and per state entry either its value or the
    shape and dtype of a tensor that follows in a collective."""
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    entries = []
    for p, state in sorted(((p, s) for p, s in opt.state.items() if id(p) in index), key=lambda ps: index[id(ps[0])]):
        for key in sorted(state, key=str):
            v = state[key]
            if isinstance(v, torch.Tensor) and v.is_cuda == nccl:
                entries.append((index[id(p)], key, "tensor", (v.shape, v.dtype, v.device.type != "cpu")))
            else:
                entries.append((index[id(p)], key, "value", v))
    return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "sizes": [len(g["params"]) for g in opt.param_groups], "state": entries}


def _check_same_shape(opt, layout):
    sizes = [len(g["params"]) for g in opt.param_groups]
    if sizes != layout["sizes"]:
        raise ValueError(f"with_bagua: {type(opt).__name__} has param groups of {sizes} parameters here and "
                         f"{layout['sizes']} on the process group's first rank: every rank must build the "
                         "same optimizer")
