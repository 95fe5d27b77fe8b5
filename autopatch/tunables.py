"""The knobs autotune may turn: one record each, read by the policy (names, default bounds) and by
autotune (reading and setting them in the run).

A knob lives on a kind of handle the session hands out: every fused optimizer's
(``session.optimizers``) or the gradient sync's (``session.allreduce``), and sets one policy
setting there (``setting``), whose check alone says what values it may take: a knob's bounds,
in a policy or here, are checked by it (``policy.knob_value``), as are the handles' setters. ``handle.<attribute>`` is
the value in effect (what the handle really uses: a chunk size after backward's cap and the
memory bound, not the policy's), ``handle.set_<attribute>(value)`` changes it between steps.
Exponent knobs (Bagua's ``*_2p``) search powers of two: knob value ``v`` is ``2**v`` bytes.

Free of heavy imports: the policy reads it before torch is loaded.
"""

import math
from dataclasses import dataclass

from .vocabulary import COMPRESSIONS, SWITCHABLE_MODES

OPTIMIZERS, ALLREDUCE = "optimizers", "allreduce"


@dataclass(frozen=True)
class Knob:
    name: str
    target: str            # OPTIMIZERS or ALLREDUCE: which handles carry it
    attribute: str         # handle.<attribute> reads it; handle.set_<attribute>(value) sets it
    setting: str           # the policy key it sets, whose check it obeys
    bounds: tuple          # default search bounds: (lo, hi) exponents, or every choice
    exponent: bool = False
    doc: str = ""

    def read(self, handle):
        """The knob's value on ``handle`` now, as the search writes it."""
        value = getattr(handle, self.attribute)
        return exponent_of(value) if self.exponent else value

    def apply(self, handle, value):
        getattr(handle, f"set_{self.attribute}")(self.handle_value(value))

    def handle_value(self, value):
        """What the handle takes for knob value ``value`` (bytes for an exponent)."""
        return int(round(2 ** value)) if self.exponent else value


def exponent_of(nbytes):
    """log2 of a byte count: an int for powers of two, else the exact float (so it re-applies)."""
    e = math.log2(nbytes)
    return int(e) if e.is_integer() else e


# Switched in this order when several change at once: the chunk size before the mode, so a new
# mode plans its buffers once.
KNOBS = {k.name: k for k in (
    Knob("chunk_size_2p", OPTIMIZERS, "chunk_bytes", "fusion.chunk_bytes", (14, 26), exponent=True,
         doc="flat chunks of 2^n bytes"),
    Knob("mode", OPTIMIZERS, "mode", "fusion.mode", SWITCHABLE_MODES, doc="the fusion mode of every fused optimizer"),
    Knob("bucket_size_2p", ALLREDUCE, "bucket_bytes", "allreduce.bucket_bytes", (10, 31), exponent=True,
         doc="allreduce buckets of 2^n bytes (Bagua's knob)"),
    Knob("hierarchical", ALLREDUCE, "hierarchical", "allreduce.hierarchical", (False, True),
         doc="reduce within nodes first (Bagua's is_hierarchical_reduce)"),
    Knob("compression", ALLREDUCE, "compression", "allreduce.compression", COMPRESSIONS, doc="gradients on the wire"),
)}
