"""Every rank must lay its buckets out alike before any bucket is reduced.

gloo aborts the whole process on collectives whose sizes differ between ranks, so a rank whose
layout differs (another model, another policy, a knob switched on one rank only) must be caught
before the first bucket's collective. Each synchronised backward all-gathers a small row (layout
checksum and settings) at its first gradient hook (``start``); the round trip overlaps the
computation of the first bucket's gradients, and ``finish`` compares the rows before the first
launch, raising ``LayoutMismatch`` on every rank alike.
"""

import torch

from ..vocabulary import COMPRESSIONS
from ..torch_internals import all_gather_into


class LayoutMismatch(RuntimeError):
    """Ranks disagree on the bucket layout, so their buckets cannot be averaged together."""


class LayoutCheck:
    def __init__(self, group, world, device):
        self.group, self.world, self.device = group, world, device
        self._pending = None

    def start(self, checksum, settings, buckets, params):
        row = [checksum, settings["bucket_bytes"], buckets, COMPRESSIONS.index(settings["compression"]),
               int(settings["hierarchical"]), params]
        mine = torch.tensor([row], dtype=torch.int64, device=self.device)
        rows = torch.empty(self.world, len(row), dtype=torch.int64, device=self.device)
        self._pending = (all_gather_into(rows, mine, group=self.group, async_op=True), rows)

    def cancel(self):
        self._pending = None

    def finish(self, wait):
        """Before this step's first bucket (a no-op once done): ``wait(work, what)`` waits."""
        if self._pending is None:
            return
        (work, rows), self._pending = self._pending, None
        wait(work, "the bucket layout check")
        rows = rows.tolist()
        if all(r == rows[0] for r in rows):
            return
        described = "; ".join(
            f"rank {r}: {n} buckets of {size} bytes over {params} params, compression "
            f"{COMPRESSIONS[comp]}, hierarchical {'on' if hier else 'off'}, checksum {ck:#010x}"
            for r, (ck, size, n, comp, hier, params) in enumerate(rows))
        raise LayoutMismatch(
            f"autopatch allreduce: ranks disagree on the bucket layout ({described}). Every rank "
            "must train the same model under the same policy, and set_bucket_bytes / "
            "set_compression / set_hierarchical must be called on every rank before the same step.")
