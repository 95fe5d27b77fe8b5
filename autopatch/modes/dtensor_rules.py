"""What DTensor parameters (FSDP2, tensor parallel) rule out: which fusion modes may run them.

The strategy that steps them (their plain local shards) is chosen in fusion/registry.py; what the
report says of their collectives is in reporting/sharded_params.py.
"""

from ..fusion.flattenable import holds_dtensors
from ..vocabulary import BACKWARD, FORWARD

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


def mode_refusal(opt, mode):
    """Why ``mode`` must not run this optimizer because of its DTensors, or None."""
    if mode not in (BACKWARD, FORWARD) or not holds_dtensors(opt):
        return None
    return BACKWARD_REFUSED if mode == BACKWARD else FORWARD_REFUSED


def probe_refusal(opt, bitwise):
    """Local shards run the optimizer's own per-tensor code on slices: only a probe that found
    chunked updates bit-for-bit equal shows the update cannot see where a tensor was cut."""
    return NOT_BITWISE if bitwise is False and holds_dtensors(opt) else None
