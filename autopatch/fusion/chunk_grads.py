"""How each chunk of a flat run gets its gradient for an update, without holding a second copy.

A chunk lying in one parameter reads that parameter's ``.grad`` in place. A chunk of several
parameters gets one buffer their grads are *moved* into (``bind``): each ``.grad`` becomes its
view of that buffer, so the original is freed at once and no gradient is ever held twice. Nothing
but those views (and the chunk, during an update) keeps such a buffer alive: ``zero_grad()`` frees
it as it frees ordinary grads.

Moving costs a view per parameter per step, which on a run of tiny parameters (biases, norms) is
most of the work. ``keep_grads=True`` (for runs of the smallest parameters, whose grads are a
bounded share of the optimizer's) copies their grads into one buffer of the run's, made once, and
leaves each ``.grad`` as it is. Backward fusion ``borrow``s instead: it copies into a scratch
buffer shared by every chunk in turn, and frees the grads itself once the chunk is updated.

A chunk is a slice of storage, so a gradient is read in its parameter's memory order (a transposed
or channels_last weight's grad as it lies, which is how autograd makes it); one whose strides
differ from its parameter's (set by user code) is copied into that order first, never read as
if it lay like the parameter.
"""

import weakref

import torch

from ..torch_internals import foreach_copy_, view_base


class ChunkGrads:
    def __init__(self, run, keep_grads=False):
        self.run = run
        # chunk index -> the one parameter it lies in, whose own .grad it reads
        self.direct = {ci: i0 for ci, (i0, i1) in enumerate(run.chunk_spans) if i1 - i0 == 1}
        # chunk of several parameters -> [(shape, stride, offset in the chunk)] of each of them
        self._layout = {ci: [(run.shapes[i], run.strides[i], run.offsets[i] - s)
                             for i in range(i0, i1)]
                        for ci, ((s, _), (i0, i1)) in enumerate(zip(run.chunk_bounds, run.chunk_spans))
                        if ci not in self.direct}
        self._moved = {}     # chunk index -> weakref to the buffer its grads were last moved into
        self._kept = None    # keep_grads: (the run's gradient buffer, chunk index -> its views)
        if keep_grads and self._layout:
            kept = torch.zeros(run.numel, dtype=run.flat.dtype, device=run.flat.device)
            self._kept = (kept, {ci: self._views_of(kept, ci, at=s)
                                 for ci, (s, _) in enumerate(run.chunk_bounds) if ci in self._layout})
        self._scratch = {}   # chunk index -> (scratch buffer, its chunk-long slice, views)

    @property
    def gathered_params(self):
        """How many parameters have their grads gathered into a chunk's buffer (the rest are read in place)."""
        return sum(i1 - i0 for ci, (i0, i1) in enumerate(self.run.chunk_spans) if ci not in self.direct)

    @property
    def kept_bytes(self):
        """Bytes of the buffer small parameters' grads are copied into (``keep_grads``)."""
        return 0 if self._kept is None else self._kept[0].numel() * self._kept[0].element_size()

    def gathered_lengths(self):
        """Elements of each chunk whose grads are gathered (a scratch buffer must hold the longest)."""
        return [e - s for ci, (s, e) in enumerate(self.run.chunk_bounds) if ci not in self.direct]

    def bind(self, chunk_ids):
        """Set ``.grad`` of each chunk in ``chunk_ids`` from its parameters' grads.

        A chunk in one parameter gets a slice of that parameter's grad. A chunk of several gets a
        new buffer their grads are copied into, and each parameter's ``.grad`` becomes its view of
        that buffer: the grads stay visible and the originals are freed at once. Buffers are made
        one chunk at a time, so gathering costs at most one chunk of memory beyond the grads,
        never a second copy of them. A buffer whose views are still every parameter's ``.grad``
        (``zero_grad(set_to_none=False)`` and the next backward wrote into them in place) is used
        again without a copy.
        """
        for ci in chunk_ids:
            if self._bind_direct(ci):
                continue
            if self._kept is None:
                self.run.chunks[ci].grad = self._moved_grads(ci)
                continue
            i0, i1 = self.run.chunk_spans[ci]
            with torch.no_grad():
                foreach_copy_(self._kept[1][ci], [p.grad for p in self.run.params[i0:i1]])
            s, e = self.run.chunk_bounds[ci]
            self.run.chunks[ci].grad = self._kept[0][s:e]

    def borrow(self, ci, scratch):
        """Set chunk ``ci``'s ``.grad`` for one update, leaving the parameters' ``.grad`` as they
        are: a chunk of several parameters copies theirs into ``scratch`` (at least a chunk long,
        and used for every chunk in turn), whose views are made once."""
        if self._bind_direct(ci):
            return
        cached = self._scratch.get(ci)
        if cached is None or cached[0] is not scratch:
            s, e = self.run.chunk_bounds[ci]
            cached = self._scratch[ci] = (scratch, scratch[:e - s], self._views_of(scratch, ci))
        i0, i1 = self.run.chunk_spans[ci]
        with torch.no_grad():
            foreach_copy_(cached[2], [p.grad for p in self.run.params[i0:i1]])
        self.run.chunks[ci].grad = cached[1]

    def _bind_direct(self, ci):
        i = self.direct.get(ci)
        if i is None:
            return False
        p = self.run.params[i]
        g = p.grad
        if g.stride() != p.stride():
            g = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
        flat = g.as_strided((g.numel(),), (1,))      # its storage, in the parameter's order
        s, e = self.run.chunk_bounds[ci]
        self.run.chunks[ci].grad = flat[s - self.run.offsets[i]:e - self.run.offsets[i]]
        return True

    def _views_of(self, buf, ci, at=0):
        """Each parameter of chunk ``ci`` as a view of ``buf`` (a tensor at the start of its
        storage), laid out like the chunk from element ``at`` on (one ``as_strided`` per
        parameter: the cheapest view torch makes)."""
        return [buf.as_strided(shape, stride, at + offset) for shape, stride, offset in self._layout[ci]]

    def _moved_grads(self, ci):
        i0, i1 = self.run.chunk_spans[ci]
        params = self.run.params[i0:i1]
        held = self._moved.get(ci)
        buf = held() if held is not None else None
        if buf is not None and all(p.grad is not None and view_base(p.grad) is buf
                                   and p.grad.storage_offset() == offset
                                   for p, (_, _, offset) in zip(params, self._layout[ci])):
            return buf
        s, e = self.run.chunk_bounds[ci]
        grads = [p.grad for p in params]
        buf = torch.empty(e - s, dtype=grads[0].dtype, device=grads[0].device)
        views = self._views_of(buf, ci)
        with torch.no_grad():
            foreach_copy_(views, grads)
        del grads
        for p, v in zip(params, views):
            p.grad = v
        self._moved[ci] = weakref.ref(buf)
        return buf

    def release(self, chunk_ids=None):
        """Drop the chunks' grads, so only the parameters' ``.grad`` keep gradient memory alive."""
        for ci in range(len(self.run.chunks)) if chunk_ids is None else chunk_ids:
            self.run.chunks[ci].grad = None
