"""What sharded parameters change for autopatch: DTensors (FSDP2, tensor parallel) and FSDP1's
flat parameters. Which fusion modes may run, what steps them, and what the report says about
their collectives, which stay FSDP's and DTensor's own.
"""

from .fusion.eligibility import is_dtensor
from .fusion.local_shards import LocalShardStep

BACKWARD_REFUSED = (
    "DTensor parameters (FSDP2, tensor parallel): their gradients are reduced after autograd "
    "delivers them (FSDP2 reduce-scatters in its own post-backward, DTensor redistributes), so "
    "an update inside backward would read an unreduced gradient")
FORWARD_REFUSED = (
    "DTensor parameters (FSDP2, tensor parallel): FSDP2 may all-gather a module's shards (its "
    "prefetch) before the forward pre-hook where this mode applies deferred updates, and "
    "DTensors cannot live in the flat buffers this mode updates")
NOT_BITWISE = (
    "the probe found fused updates equal to per-tensor updates only within float rounding, so "
    "the update is not purely elementwise and stays on the DTensors")
COLLECTIVES = (
    "FSDP and DTensor parameters keep their own collectives (FSDP's all-gather and "
    "reduce-scatter, DTensor's redistributions): autopatch's allreduce takes over "
    "DistributedDataParallel only")


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def holds_dtensors(opt):
    return any(is_dtensor(p) for p in _params(opt))


def mode_refusal(opt, mode):
    """Why ``mode`` must not run this optimizer because of its DTensors, or None."""
    if mode not in ("backward", "forward") or not holds_dtensors(opt):
        return None
    return BACKWARD_REFUSED if mode == "backward" else FORWARD_REFUSED


def probe_refusal(opt, bitwise):
    """Local shards run the optimizer's own per-tensor code on slices: only a probe that found
    chunked updates bit-for-bit equal shows the update cannot see where a tensor was cut."""
    return NOT_BITWISE if bitwise is False and holds_dtensors(opt) else None


def strategy_for(opt, mode, chunk_bytes):
    """The strategy for an optimizer over DTensors in ``mode``, or None for the usual one."""
    if mode == "multi_layer" and holds_dtensors(opt):
        return LocalShardStep(opt, chunk_bytes)
    return None


def _sharded_count(runtime):
    n = 0
    for ctrl in runtime.controllers:
        opt = ctrl.ref()
        if opt is not None:
            n += sum(is_dtensor(p) or bool(getattr(p, "_fsdp_flattened", False)) for p in _params(opt))
    return n


def note_collectives(runtime, section):
    """The allreduce section, saying for a run with sharded parameters that their collectives
    are not autopatch's."""
    n = _sharded_count(runtime)
    if not n:
        return section
    out = dict(section, sharded_params=n, sharded_collectives=COLLECTIVES)
    if not section.get("active"):
        out["reason"] = f"{COLLECTIVES} ({section.get('reason')})"
    return out
