"""The report's word on sharded parameters: their collectives are FSDP's and DTensor's own."""

from ..torch_internals import fsdp1_flat, is_dtensor

COLLECTIVES = (
    "FSDP and DTensor parameters keep their own collectives (FSDP's all-gather and "
    "reduce-scatter, DTensor's redistributions): autopatch's allreduce takes over "
    "DistributedDataParallel only")


def sharded_count(optimizers):
    """How many parameters of these optimizers are DTensors or FSDP1's flattened views."""
    return sum(is_dtensor(p) or fsdp1_flat(p) is not None
               for opt in optimizers for g in opt.param_groups for p in g["params"])


def note_collectives(section, optimizers):
    """The allreduce section, saying for a run with sharded parameters that their collectives
    are not autopatch's."""
    n = sharded_count(optimizers)
    if not n:
        return section
    out = dict(section, sharded_params=n, sharded_collectives=COLLECTIVES)
    if not section.get("active"):
        out["reason"] = f"{COLLECTIVES} ({section.get('reason')})"
    return out
