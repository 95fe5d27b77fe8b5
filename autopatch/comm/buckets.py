"""The bucket layout over flat gradient buffers.

Gradients live in one flat buffer per (dtype, device), laid out in the order they become ready in
backward, so each bucket is one contiguous slice: reducing it is one collective on a view, with no
gather or scatter copy. Changing the bucket size only moves slice boundaries; the buffers and every
parameter's gradient view stay where they are.
"""

import zlib
from dataclasses import dataclass

import torch


class FlatGradients:
    """One zeroed flat buffer per (dtype, device); ``views[i]`` is parameter ``i``'s gradient in it."""

    def __init__(self, params, order):
        self.order = list(order)
        self.span = [None] * len(params)     # i -> (key, start, end) in elements
        sizes = {}
        for i in self.order:
            p = params[i]
            key = (p.dtype, p.device)
            start = sizes.get(key, 0)
            sizes[key] = start + p.numel()
            self.span[i] = (key, start, sizes[key])
        self.buffers = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
        self.views = [self.buffers[key][s:e].view(params[i].shape) for i, (key, s, e) in enumerate(self.span)]


@dataclass
class Bucket:
    index: int
    params: list          # parameter indices, in ready order
    tensor: torch.Tensor  # the contiguous slice of a flat buffer holding their gradients

    @property
    def nbytes(self):
        return self.tensor.numel() * self.tensor.element_size()


def plan_buckets(flat, bucket_bytes):
    """Cut the flat buffers into buckets of about ``bucket_bytes``, in ready order.

    A bucket closes once it reaches ``bucket_bytes`` (a larger parameter gets a bucket of its own).
    Buckets are numbered in the order they close, which is the order their last gradient arrives,
    so launching them in index order never waits on a later bucket.
    """
    open_runs = {}     # key -> ([param indices], bytes so far)
    closed = []
    for i in flat.order:
        key, start, end = flat.span[i]
        run, nbytes = open_runs.get(key, ([], 0))
        run.append(i)
        nbytes += (end - start) * key[0].itemsize
        if nbytes >= bucket_bytes:
            closed.append(run)
            open_runs.pop(key, None)
        else:
            open_runs[key] = (run, nbytes)
    position = {i: n for n, i in enumerate(flat.order)}
    closed += sorted((run for run, _ in open_runs.values()), key=lambda run: position[run[-1]])
    buckets = []
    for index, run in enumerate(closed):
        key, start, _ = flat.span[run[0]]
        end = flat.span[run[-1]][2]
        buckets.append(Bucket(index, run, flat.buffers[key][start:end]))
    return buckets


def layout_checksum(params, buckets, *settings):
    """A checksum of what every rank must agree on: bucket contents, shapes, dtypes and settings.

    crc32 of a canonical text, so equal layouts give equal numbers in every process (Python's
    ``hash`` is salted per process).
    """
    parts = [repr(settings)]
    for b in buckets:
        parts.append(";".join(f"{tuple(params[i].shape)}:{params[i].dtype}" for i in b.params))
    return zlib.crc32("|".join(parts).encode())
