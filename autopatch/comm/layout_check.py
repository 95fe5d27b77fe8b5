"""Every rank must lay its buckets out alike before any bucket is reduced, at no collective of its
own in the steady state.

gloo aborts the whole process on collectives whose sizes differ between ranks, so a rank whose
layout differs (another model, another policy, a knob switched on one rank only) must be caught
before any collective whose size follows from its layout. So each synchronised backward's first
collective is a *lead*: an allreduce whose shape (elements and dtype) every rank agreed on at the
last check, ending in a header where each rank writes the fingerprint of its layout and settings
into its own slot and zeros into the others'. The sum is every rank's fingerprint, exactly (a byte
plus zeros is exact in any float dtype); the header is compared before any other bucket launches.
Ranks that disagree all see the same sums, so they all gather a description of every rank's layout
(one more collective, the same on every rank) and raise ``LayoutMismatch``.

Where this rank's layout is the one agreed on, the lead is the step's first bucket itself. Over
two ranks its buffer ends in the header: the check costs no collective of its own, and a model of
one bucket makes one collective per step, as under DDP. Over more ranks a longer buffer would sum
some gradients in another order than DDP's (bucket_group.py), so the header follows the first
bucket in a small allreduce of its own, issued right behind it so the two travel together rather
than one after the other. Otherwise (the first step, a knob just applied, a first bucket that is
compressed or reduced node by node, so it cannot carry bytes exactly) the header goes alone,
zero-padded to the agreed shape (and, where the header follows the lead, behind a zero lead of
the agreed shape), at the step's first gradient, overlapping the computation of the first
bucket's gradients. A knob applied on every rank thus costs one padded lead, once.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..vocabulary import COMPRESSIONS
from ..torch_internals import all_gather_into

DIGITS = 8     # a fingerprint's bytes, one float each: exact in every float dtype


class LayoutMismatch(RuntimeError):
    """Ranks disagree on the bucket layout, so their buckets cannot be averaged together."""


@dataclass(frozen=True)
class Lead:
    """What every rank agreed on at the last check: the lead's shape, and whose layout it is;
    ``apart``: the header follows the lead in an allreduce of its own."""
    numel: int
    dtype: torch.dtype
    checksum: int
    apart: bool = False


class LayoutCheck:
    def __init__(self, group, world, rank, device):
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self.header_numel = DIGITS * world
        self.agreed = None      # the Lead of the last check every rank passed; None before the first
        self.passed = True      # this step's check is passed (or there is none)
        self.carried = False    # this step's lead is the first bucket
        self._pending = None    # ([works], header, bucket group) of this step's lead, once issued
        self._stamps = {}       # (checksum, dtype) -> (this rank's header, every rank's header)
        self.alone = 0          # checks whose header took a collective of its own

    # -- a step -----------------------------------------------------------------------------------
    def begin(self, buckets):
        """A synchronised backward starts with ``buckets``. When its first bucket cannot carry the
        header this step, the header goes alone now; else ``carry`` sends it with that bucket."""
        self.passed, self._pending = False, None
        agreed = self.agreed
        self.carried = agreed is not None and agreed.checksum == buckets.checksum and buckets.plain_lead
        if not self.carried:
            self.alone += 1
            works = []
            numel, dtype = (agreed.numel, agreed.dtype) if agreed else (self.header_numel, torch.float32)
            if agreed is not None and agreed.apart:    # a zero lead of the agreed shape, the header behind
                zeros = torch.zeros(numel, dtype=dtype, device=self.device)
                works.append(dist.all_reduce(zeros, group=self.group, async_op=True))
                numel, dtype = self.header_numel, torch.float32
            lead = torch.zeros(numel, dtype=dtype, device=self.device)
            header = lead[numel - self.header_numel:]
            self._stamp(header, buckets)
            works.append(dist.all_reduce(lead, group=self.group, async_op=True))
            self._pending = (works, header, buckets)

    @property
    def due(self):
        """The first bucket is to carry the header and has not been launched yet."""
        return self.carried and self._pending is None

    def carry(self, buckets):
        """Launch the first bucket with the header: in its tail, or right behind it."""
        if buckets.carrier:
            header = buckets.lead_header()
            self._stamp(header, buckets)
            self._pending = ([buckets.start_lead()], header, buckets)
            return
        buckets.start_lead()
        header = torch.empty(self.header_numel, dtype=torch.float32, device=self.device)
        self._stamp(header, buckets)
        self._pending = ([dist.all_reduce(header, group=self.group, async_op=True)], header, buckets)

    def completed(self):
        """The lead has arrived (``finish`` would not wait)."""
        return self._pending is not None and all(w.is_completed() for w in self._pending[0])

    def finish(self, wait):
        """Compare the headers (``wait(work, what)`` waits for the lead), before any other bucket
        launches: agreed from now on, or ``LayoutMismatch`` on every rank alike."""
        (works, header, buckets), self._pending = self._pending, None
        wait(works, "the bucket layout check")
        if not torch.equal(header, self._stamps[(buckets.checksum, header.dtype)][1]):
            self._mismatch(buckets.row, wait)
        if not self.carried:      # a carried step's layout is the one agreed on already
            self.agreed = self._lead(buckets)
        self.passed = True

    def cancel(self):
        """The step ended or was abandoned: nothing is pending."""
        self.passed, self.carried, self._pending = True, False, None

    # -- the header -------------------------------------------------------------------------------
    def _lead(self, buckets):
        """The lead of later steps of this layout: its first bucket, with the header in its tail
        or right behind it, where it can lead; else the header alone."""
        first = buckets.buckets[0]
        if buckets.carrier:
            return Lead(first.numel + self.header_numel, first.dtype, buckets.checksum)
        if buckets.plain_lead:
            return Lead(first.numel, first.dtype, buckets.checksum, apart=True)
        return Lead(self.header_numel, torch.float32, buckets.checksum)

    def _stamp(self, header, buckets):
        key = (buckets.checksum, header.dtype)
        if key not in self._stamps:
            digits = torch.tensor(list(buckets.checksum.to_bytes(DIGITS, "little")), dtype=header.dtype,
                                  device=self.device)
            mine = torch.zeros(self.header_numel, dtype=header.dtype, device=self.device)
            mine[self.rank * DIGITS:(self.rank + 1) * DIGITS] = digits
            self._stamps = {key: (mine, digits.repeat(self.world))}     # one layout at a time
        header.copy_(self._stamps[key][0])

    def _mismatch(self, row, wait):
        """Every rank saw the disagreement: gather each one's layout, and say how they differ."""
        mine = torch.tensor([row], dtype=torch.int64, device=self.device)
        rows = torch.empty(self.world, len(row), dtype=torch.int64, device=self.device)
        wait(all_gather_into(rows, mine, group=self.group, async_op=True), "the bucket layout description")
        described = "; ".join(
            f"rank {r}: {n} buckets of {size} bytes over {params} params, compression "
            f"{COMPRESSIONS[comp]}, hierarchical {'on' if hier else 'off'}, checksum {ck:#018x}"
            for r, (ck, size, n, comp, hier, params) in enumerate(rows.tolist()))
        raise LayoutMismatch(
            f"autopatch allreduce: ranks disagree on the bucket layout ({described}). Every rank "
            "must train the same model under the same policy, and set_bucket_bytes / "
            "set_compression / set_hierarchical must be called on every rank before the same step.")
