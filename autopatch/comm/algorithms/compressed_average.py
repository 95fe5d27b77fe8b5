"""Averaging a list of tensors in place across ranks, compressed, with the allreduce's machinery.

The tensors are packed into one flat buffer per dtype, cut into buckets of ``bucket_elements``,
and every bucket goes through ``collectives.Averager``: for ``minmax_uint8`` that is ByteGrad's
scatter-gather, with a min and max per ``chunk`` values (``chunk_codes.DEFAULT_CHUNK``), so few
values share one code step however large the buckets. Buckets are large: every bucket costs two
collectives, whose latency, not their bytes, dominated with small ones on a fast link.
"""

import torch.distributed as dist

from ..collectives import Averager
from ..compression import checked
from ..hierarchy import build_topology
from .base import start
from .chunk_codes import DEFAULT_CHUNK
from .flat import FlatTensors

DEFAULT_BUCKET_ELEMENTS = 2**24


class CompressedAverage:
    def __init__(self, group, device, waiter, *, compression="minmax_uint8", hierarchical=False,
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, chunk=DEFAULT_CHUNK):
        if hierarchical and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("hierarchical=True groups ranks by node across the whole world, so the "
                             "process group must be the world")
        self.world = dist.get_world_size(group)
        self.averager = Averager(group, checked(compression), build_topology(device) if hierarchical else None, chunk)
        self.waiter = waiter
        self.bucket_elements = bucket_elements
        self.bytes_sent = 0

    def __call__(self, tensors, what="the average"):
        """Average ``tensors`` in place. Flat ones (1-D, contiguous: QAdam's) are averaged as they
        are; others through a flat copy per dtype."""
        flat = None if all(t.dim() == 1 and t.is_contiguous() for t in tensors) else FlatTensors(tensors)
        flats = tensors if flat is None else flat.gather()
        started = []
        for f in flats:
            f.mul_(1.0 / self.world)     # the Averager sums: pre-scaled, the sum is the average
            for bucket in f.split(self.bucket_elements):
                self.bytes_sent += self.averager.bytes_sent(bucket)
                started.append(start(self.averager.phases(bucket)))
        self.waiter.drain(started, what)
        if flat is not None:
            flat.scatter(flats)
