"""The buckets of one layout, and their reductions in one synchronised backward.

A bucket group is built whenever the layout or a setting changes (bucket size, compression,
hierarchical reduce). In a step it hands out each bucket's buffer (``views``), counts its
gradients in (``arrived``), launches reductions strictly in bucket order (``start_full``,
``start_rest``: every rank issues the same collectives in the same order), and waits for them
(``poll`` hands over the ones already complete while backward goes on, ``drain`` waits for all);
``take`` gives a finished bucket's views to whoever sets the parameters' ``.grad``.
"""

import weakref

import torch

from ..vocabulary import COMPRESSIONS
from .buckets import layout_checksum, plan_buckets
from .averager import Averager
from .waiting import start


class BucketGroup:
    def __init__(self, params, layout, settings, group, world, nodes):
        self.params = params
        self.buckets = plan_buckets(layout, params, settings.bucket_bytes)
        self.bucket_of = [0] * len(params)
        self.position = [0] * len(params)     # i -> its place in its bucket
        for b in self.buckets:
            for n, i in enumerate(b.params):
                self.bucket_of[i], self.position[i] = b.index, n
        self.averager = Averager(group, settings.compression, nodes if settings.hierarchical else None)
        self.checksum = layout_checksum(params, self.buckets, world, settings.bucket_bytes,
                                        settings.compression, settings.hierarchical)
        # the layout's description: what the layout check compares (the checksum), and shows when
        # ranks disagree
        self.description = [self.checksum, settings.bucket_bytes, len(self.buckets),
                    COMPRESSIONS.index(settings.compression), int(settings.hierarchical), len(params)]
        self.bytes_per_step = sum(self.averager.bytes_sent(torch.empty(b.numel, dtype=b.dtype, device="meta"))
                                  for b in self.buckets)
        self._held = {}        # bucket -> (weakref to its last buffer, weakrefs to its views)
        self.reset()

    def __len__(self):
        return len(self.buckets)

    def reset(self):
        """A new step: nothing arrived, nothing launched."""
        self.missing = [len(b.params) for b in self.buckets]
        self.next = 0              # the next bucket to launch
        self.inflight = []         # (stages, the work waited for next, bucket)
        self.finished = [False] * len(self.buckets)
        self.buffers = {}          # bucket -> (buffer, views) of this step, until it is taken

    def views(self, b):
        """Bucket ``b``'s views for this step: last step's when every one of its parameters still
        holds its view as ``.grad`` (``zero_grad(set_to_none=False)``), else a new buffer's."""
        got = self.buffers.get(b)
        if got is not None:
            return got[1]
        held = self._held.get(b)
        if held is not None:
            buf, views = held[0](), [v() for v in held[1]]
            if buf is not None and all(v is not None and self.params[i].grad is v
                                       for i, v in zip(self.buckets[b].params, views)):
                self.buffers[b] = (buf, views)
                return views
        buf, views = self.buckets[b].new_buffer()
        self.buffers[b] = (buf, views)
        self._held[b] = (weakref.ref(buf), [weakref.ref(v) for v in views])
        return views

    def full(self, b):
        return self.missing[b] == 0

    def arrived(self, i):
        """Parameter ``i``'s gradient is in its bucket; True when the next bucket to launch is
        now full (``start_full`` has something to launch)."""
        b = self.bucket_of[i]
        self.missing[b] -= 1
        return self.missing[b] == 0 and b == self.next

    def start_full(self):
        """Launch the full buckets from the next one on, in order, up to the first not full."""
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._start(self.next)

    def start_rest(self):
        while self.next < len(self.buckets):
            self._start(self.next)

    def _start(self, b):
        buf = self.buffers[b][0]
        self.inflight.append(start(self.averager.stages(buf), b))
        self.next = b + 1

    def poll(self, waiter, finish):
        """Hand over (``finish(b)``) the buckets whose reduction has completed, without waiting for
        the others; only for single-collective reductions. Returns how many were handed over."""
        still, done = [], 0
        for stages, work, b in self.inflight:
            if work.is_completed():
                waiter.wait(work, self._what(b))
                next(stages, None)     # the rest of a single-collective bucket issues nothing
                finish(b)
                done += 1
            else:
                still.append((stages, work, b))
        self.inflight = still
        return done

    def drain(self, waiter, finish=None):
        """Wait for every bucket, stage by stage, in bucket order; with ``finish``, hand each
        bucket over as soon as its last stage is done."""
        inflight, self.inflight = self.inflight, []
        waiter.drain(inflight, self._what, finish)

    def _what(self, b):
        return f"bucket {b} of {len(self.buckets)}"

    def take(self, b):
        """Bucket ``b`` is averaged: its views, and the buffer is the parameters' alone from now on."""
        self.finished[b] = True
        return self.buffers.pop(b)[1]
