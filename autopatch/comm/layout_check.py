"""Every rank lays its buckets out alike: checked when a layout is made, at no cost afterwards.

gloo aborts the whole process on collectives whose sizes differ between ranks, so a layout that
differs between ranks (another model, another policy, a knob switched on one rank only) must be
caught before any bucket whose size follows from it is reduced. What is promised, as DDP promises
for its own buckets (it checks the model's shapes across ranks once, when the model is built):

- a layout is checked on the synchronised backward that first uses it: the first one (after rank
  0's gradient order is broadcast) and the first after a knob (bucket size, compression,
  hierarchical reduce) is applied. That step's first collective is a small allreduce of a header
  where each rank writes the fingerprint of its layout and settings into its own slot and zeros
  into the others'; the sum is every rank's fingerprint, exactly (a byte plus zeros is exact in
  float32), and it is compared before any bucket launches. It travels at the step's first
  gradient, overlapping the computation of the first bucket's gradients.
- later steps of a layout every rank agreed on issue no collective of their own.
- knobs are applied on every rank between the same two steps: autotune's decisions are (every
  rank follows rank 0's at the same step), and ``session.allreduce``'s setters say so. A knob set
  on one rank only is not caught by the other ranks.

Ranks that disagree all see the same sums, so they all gather a description of every rank's
layout (one more collective, the same on every rank) and raise ``LayoutMismatch``.
"""

import torch
import torch.distributed as dist

from ..vocabulary import COMPRESSIONS
from ..torch_internals import all_gather_into

DIGITS = 8     # a fingerprint's bytes, one float each: exact in float32


class LayoutMismatch(RuntimeError):
    """Ranks disagree on the bucket layout, so their buckets cannot be averaged together."""


class LayoutCheck:
    def __init__(self, group, world, rank, device):
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self.header_numel = DIGITS * world
        self.agreed = None      # the checksum of the layout every rank passed the check with
        self.passed = True      # this step's check is passed (or there is none)
        self._pending = None    # (work, header, bucket group) of this step's check, once issued
        self.checks = 0         # layouts checked (each took one small collective)

    def begin(self, buckets):
        """A synchronised backward starts with ``buckets``: nothing to do for the layout agreed
        on; for a new one, the header goes now."""
        self._pending = None
        self.passed = self.agreed == buckets.checksum
        if self.passed:
            return
        self.checks += 1
        header = self._stamp(buckets.checksum)
        self._pending = (dist.all_reduce(header, group=self.group, async_op=True), header, buckets)

    def completed(self):
        """The header has arrived (``finish`` would not wait)."""
        return self._pending is not None and self._pending[0].is_completed()

    def finish(self, wait):
        """Compare the headers (``wait(work, what)`` waits for them), before any bucket launches:
        agreed from now on, or ``LayoutMismatch`` on every rank alike."""
        (work, header, buckets), self._pending = self._pending, None
        wait(work, "the bucket layout check")
        digits = self._digits(buckets.checksum)
        if not torch.equal(header, digits.repeat(self.world)):
            self._mismatch(buckets.description, wait)
        self.agreed = buckets.checksum
        self.passed = True

    def cancel(self):
        """The step ended or was abandoned: nothing is pending, and a check not finished will
        be made again."""
        self.passed, self._pending = True, None

    def _digits(self, checksum):
        return torch.tensor(list(checksum.to_bytes(DIGITS, "little")), dtype=torch.float32, device=self.device)

    def _stamp(self, checksum):
        """This rank's header: its fingerprint in its own slot, zeros elsewhere."""
        header = torch.zeros(self.header_numel, dtype=torch.float32, device=self.device)
        header[self.rank * DIGITS:(self.rank + 1) * DIGITS] = self._digits(checksum)
        return header

    def _mismatch(self, description, wait):
        """Every rank saw the disagreement: gather each one's layout description, and say how they
        differ."""
        mine = torch.tensor([description], dtype=torch.int64, device=self.device)
        descriptions = torch.empty(self.world, len(description), dtype=torch.int64, device=self.device)
        wait(all_gather_into(descriptions, mine, group=self.group, async_op=True), "the bucket layout description")
        described = "; ".join(
            f"rank {r}: {n} buckets of {size} bytes over {params} params, compression "
            f"{COMPRESSIONS[comp]}, hierarchical {'on' if hier else 'off'}, checksum {ck:#018x}"
            for r, (ck, size, n, comp, hier, params) in enumerate(descriptions.tolist()))
        raise LayoutMismatch(
            f"autopatch allreduce: ranks disagree on the bucket layout ({described}). Every rank "
            "must train the same model under the same policy, and set_bucket_bytes / "
            "set_compression / set_hierarchical must be called on every rank before the same step.")
