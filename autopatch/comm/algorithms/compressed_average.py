"""Averaging a list of tensors in place across ranks, compressed, with the allreduce's machinery.

The tensors are packed into one flat buffer per dtype, cut into slices of ``slice_elements``,
and every slice goes through ``averager.Averager``: for ``minmax_uint8`` that is ByteGrad's
scatter-gather, with a min and max per ``row`` values (``row_codes.DEFAULT_ROW``), so few
values share one code step however large the slices. Slices are large: every slice costs two
collectives, whose latency, not their bytes, dominated with small ones on a fast link.
"""

import torch.distributed as dist

from ...topology import why_not_hierarchical
from ..averager import Averager
from ..compression import checked
from ..hierarchy import node_groups
from ..waiting import start
from .row_codes import DEFAULT_ROW
from .flat_tensors import FlatTensors

DEFAULT_SLICE_ELEMENTS = 2**24


class CompressedAverage:
    def __init__(self, group, device, waiter, *, compression="minmax_uint8", hierarchical=False,
                 slice_elements=DEFAULT_SLICE_ELEMENTS, row=DEFAULT_ROW):
        why = why_not_hierarchical(group) if hierarchical else None
        if why:
            raise ValueError(f"hierarchical=True: {why}")
        self.world = dist.get_world_size(group)
        self.averager = Averager(group, checked(compression), node_groups() if hierarchical else None, row)
        self.waiter = waiter
        self.slice_elements = slice_elements
        self.bytes_sent = 0

    def __call__(self, tensors, what="the average"):
        """Average ``tensors`` in place. Flat ones (1-D, contiguous: QAdam's) are averaged as they
        are; others through a flat copy per dtype."""
        flat = None if all(t.dim() == 1 and t.is_contiguous() for t in tensors) else FlatTensors(tensors)
        flats = tensors if flat is None else flat.gather()
        started = []
        for f in flats:
            f.mul_(1.0 / self.world)     # the Averager sums: pre-scaled, the sum is the average
            for piece in f.split(self.slice_elements):
                self.bytes_sent += self.averager.bytes_sent(piece)
                started.append(start(self.averager.stages(piece)))
        self.waiter.drain(started, what)
        if flat is not None:
            flat.scatter(flats)
