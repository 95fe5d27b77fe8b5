"""The bucket layout: which gradients share a bucket, and the buffer each bucket gets per step.

Gradients are laid out per (dtype, device) in the order they become ready in backward, and each
bucket is a contiguous range of that layout: reducing it is one collective on one buffer, with no
gather or scatter copy. A bucket's buffer is made when its first gradient of a step arrives and
is held afterwards only by the parameters' ``.grad`` (their views of it): ``zero_grad()`` frees it
as it frees ordinary grads, and backward fusion frees it once its chunks are updated, so between
steps no gradient memory is kept, and during backward only the buckets in flight. Changing the
bucket size only moves range boundaries.
"""

import hashlib
from dataclasses import dataclass, field

import torch


class GradientLayout:
    """``span[i]``: parameter ``i``'s (dtype, device) and [start, end) elements in ready order."""

    def __init__(self, params, order):
        self.order = list(order)
        self.span = [None] * len(params)
        sizes = {}
        for i in self.order:
            p = params[i]
            key = (p.dtype, p.device)
            start = sizes.get(key, 0)
            sizes[key] = start + p.numel()
            self.span[i] = (key, start, sizes[key])


@dataclass
class Bucket:
    index: int
    params: list          # parameter indices, in ready order
    dtype: torch.dtype
    device: torch.device
    numel: int
    views: list = field(default_factory=list)   # per parameter: (shape, stride, offset) in the buffer

    @property
    def nbytes(self):
        return self.numel * self.dtype.itemsize

    def new_buffer(self):
        """A buffer for one step, and each parameter's view of it (in ``params`` order)."""
        buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return buf, [buf.as_strided(*v) for v in self.views]


def plan_buckets(layout, params, bucket_bytes):
    """Cut the layout into buckets of about ``bucket_bytes``, in ready order.

    A bucket closes once it reaches ``bucket_bytes`` (a larger parameter gets a bucket of its own).
    Buckets are numbered in the order they close, which is the order their last gradient arrives,
    so launching them in index order never waits on a later bucket.
    """
    open_runs = {}     # key -> ([param indices], bytes so far)
    closed = []
    for i in layout.order:
        key, start, end = layout.span[i]
        run, nbytes = open_runs.get(key, ([], 0))
        run.append(i)
        nbytes += (end - start) * key[0].itemsize
        if nbytes >= bucket_bytes:
            closed.append(run)
            open_runs.pop(key, None)
        else:
            open_runs[key] = (run, nbytes)
    position = {i: n for n, i in enumerate(layout.order)}
    closed += sorted((run for run, _ in open_runs.values()), key=lambda run: position[run[-1]])
    buckets = []
    for index, run in enumerate(closed):
        (dtype, device), first, _ = layout.span[run[0]]
        # in the parameter's own memory order where it is dense (as DDP lays its bucket views)
        views = [(params[i].shape, torch.empty_like(params[i], device="meta").stride(),
                  layout.span[i][1] - first) for i in run]
        buckets.append(Bucket(index, run, dtype, device, layout.span[run[-1]][2] - first, views))
    return buckets


def layout_checksum(params, buckets, *settings):
    """A checksum of what every rank must agree on: bucket contents, shapes, dtypes and settings.

    63 bits of a BLAKE2 digest of a canonical text, so equal layouts give equal numbers in every
    process (Python's ``hash`` is salted per process), two layouts the same number about once in
    10**19, and the number fits an int64.
    """
    parts = [repr(settings)]
    for b in buckets:
        parts.append(";".join(f"{tuple(params[i].shape)}:{params[i].dtype}" for i in b.params))
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
