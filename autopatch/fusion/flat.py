"""Flat buffers: one contiguous run of parameters, its gradients and its optimizer state.

A run holds parameters of one group that share dtype, device and the shape of their optimizer
state. Each parameter's ``.data`` becomes a view into the run's flat buffer, so an update of the
flat buffer (or of any chunk of it) is an update of the parameters. Chunks are plain slices of the
flat buffer, cut at parameter boundaries except inside parameters larger than a chunk.
"""

import bisect
import weakref

import torch

FULL, SCALAR, PYTHON = "full", "scalar", "python"


def state_signature(param, state):
    """How a parameter's optimizer state looks, or None when it cannot live in flat buffers.

    Parameters may share a run only when their signatures are equal: same keys, full-size
    tensors in the same dtypes, and equal scalar values (so one update step fits all).
    """
    sig = []
    for key in sorted(state, key=str):
        v = state[key]
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                sig.append((key, SCALAR, v.dtype, v.item()))
            elif v.shape == param.shape and v.device == param.device and not v.is_sparse:
                sig.append((key, FULL, v.dtype))
            else:
                return None
        else:
            try:
                hash(v)
            except TypeError:
                return None
            sig.append((key, PYTHON, v))
    return tuple(sig)


class FlatRun:
    """Parameters flattened into one buffer, with chunk views and per-chunk optimizer state.

    By default (multi_layer) a parameter of at least a chunk's size gets chunks of its own;
    ``align=True`` keeps every parameter whole in one chunk (backward and forward fusion update
    chunks as their parameters' gradients become final). Either way a chunk lying in one
    parameter reads that parameter's ``.grad`` in place, and a chunk of several parameters gets
    one buffer their grads are *moved* into (``bind_grads``): each ``.grad`` becomes its view of
    that buffer, so the original is freed at once and no gradient is ever held twice. Nothing but
    those views (and the chunk, during an update) keeps such a buffer alive: ``zero_grad()``
    frees it as it frees ordinary grads.

    Moving costs a view per parameter per step, which on a run of tiny parameters (biases,
    norms) is most of the work. ``keep_grads=True`` (for runs of the smallest parameters, whose
    grads are a bounded share of the optimizer's) copies their grads into one buffer of the run's,
    made once, and leaves each ``.grad`` as it is.
    """

    def __init__(self, params, states, chunk_elems, align=False, keep_grads=False):
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        p0 = self.params[0]
        self.flat = self._flatten_params(p0.dtype, p0.device)
        self.param_ptrs = [p.data_ptr() for p in self.params]
        chunk_elems = max(1, chunk_elems)
        bounds = self._aligned_bounds(chunk_elems) if align else self._own_chunks_for_large(chunk_elems)
        self.chunk_bounds = list(zip(bounds[:-1], bounds[1:]))
        self.chunk_spans = [self._span(s, e) for s, e in self.chunk_bounds]
        # chunk index -> the one parameter it lies in, whose own .grad it reads
        self.direct = {ci: i0 for ci, (i0, i1) in enumerate(self.chunk_spans) if i1 - i0 == 1}
        # chunk of several parameters -> [(shape, stride, offset in the chunk)] of each of them
        self._layout = {ci: [(self.shapes[i], torch.empty(self.shapes[i], device="meta").stride(),
                              self.offsets[i] - s)
                             for i in range(i0, i1)]
                        for ci, ((s, _), (i0, i1)) in enumerate(zip(self.chunk_bounds, self.chunk_spans))
                        if ci not in self.direct}
        self._moved = {}     # chunk index -> weakref to the buffer its grads were last moved into
        self._kept = None    # keep_grads: (the run's gradient buffer, chunk index -> its views)
        if keep_grads and self._layout:
            kept = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)
            self._kept = (kept, {ci: self._views_of(kept, ci, at=s)
                                 for ci, (s, _) in enumerate(self.chunk_bounds) if ci in self._layout})
        self._scratch = {}   # chunk index -> (scratch buffer, its chunk-long slice, views)
        self.chunks = [torch.nn.Parameter(self.flat[s:e], requires_grad=True) for s, e in self.chunk_bounds]
        self.chunk_states = [dict() for _ in self.chunks]
        self.chunk_keys = [set() for _ in self.chunks]   # state keys already mirrored per param
        self.flat_state = {}       # key -> flat tensor (full-size state)
        self.scalar_state = {}     # key -> 1-D buffer, element i is parameter i's 0-dim value
        self._adopt_state(states)

    @property
    def gathered_params(self):
        """How many parameters have their grads gathered into a chunk's buffer (the rest are read in place)."""
        return sum(i1 - i0 for ci, (i0, i1) in enumerate(self.chunk_spans) if ci not in self.direct)

    @property
    def kept_grad_bytes(self):
        """Bytes of the buffer small parameters' grads are copied into (``keep_grads``)."""
        return 0 if self._kept is None else self._kept[0].numel() * self._kept[0].element_size()

    def bind_grads(self, chunk_ids):
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
                self.chunks[ci].grad = self._moved_grads(ci)
                continue
            i0, i1 = self.chunk_spans[ci]
            with torch.no_grad():
                torch._foreach_copy_(self._kept[1][ci], [p.grad for p in self.params[i0:i1]])
            s, e = self.chunk_bounds[ci]
            self.chunks[ci].grad = self._kept[0][s:e]

    def borrow_grads(self, ci, scratch):
        """Set chunk ``ci``'s ``.grad`` for one update, leaving the parameters' ``.grad`` as they
        are: a chunk of several parameters copies theirs into ``scratch`` (at least a chunk long,
        and used for every chunk in turn), whose views are made once."""
        if self._bind_direct(ci):
            return
        cached = self._scratch.get(ci)
        if cached is None or cached[0] is not scratch:
            s, e = self.chunk_bounds[ci]
            cached = self._scratch[ci] = (scratch, scratch[:e - s], self._views_of(scratch, ci))
        i0, i1 = self.chunk_spans[ci]
        with torch.no_grad():
            torch._foreach_copy_(cached[2], [p.grad for p in self.params[i0:i1]])
        self.chunks[ci].grad = cached[1]

    def _bind_direct(self, ci):
        i = self.direct.get(ci)
        if i is None:
            return False
        g = self.params[i].grad
        s, e = self.chunk_bounds[ci]
        flat = (g if g.is_contiguous() else g.contiguous()).view(-1)
        self.chunks[ci].grad = flat[s - self.offsets[i]:e - self.offsets[i]]
        return True

    def _views_of(self, buf, ci, at=0):
        """Each parameter of chunk ``ci`` as a view of ``buf`` (a tensor at the start of its
        storage), laid out like the chunk from element ``at`` on (one ``as_strided`` per
        parameter: the cheapest view torch makes)."""
        return [buf.as_strided(shape, stride, at + offset) for shape, stride, offset in self._layout[ci]]

    def _moved_grads(self, ci):
        i0, i1 = self.chunk_spans[ci]
        params = self.params[i0:i1]
        held = self._moved.get(ci)
        buf = held() if held is not None else None
        if buf is not None and all(p.grad is not None and p.grad._base is buf
                                   and p.grad.storage_offset() == offset
                                   for p, (_, _, offset) in zip(params, self._layout[ci])):
            return buf
        s, e = self.chunk_bounds[ci]
        grads = [p.grad for p in params]
        buf = torch.empty(e - s, dtype=grads[0].dtype, device=grads[0].device)
        views = self._views_of(buf, ci)
        with torch.no_grad():
            torch._foreach_copy_(views, grads)
        del grads
        for p, v in zip(params, views):
            p.grad = v
        self._moved[ci] = weakref.ref(buf)
        return buf

    def release_grads(self, chunk_ids=None):
        """Drop the chunks' grads, so only the parameters' ``.grad`` keep gradient memory alive."""
        for ci in range(len(self.chunks)) if chunk_ids is None else chunk_ids:
            self.chunks[ci].grad = None

    def _aligned_bounds(self, chunk_elems):
        bounds, filled = [0], 0
        for o, p in zip(self.offsets, self.params):
            if filled and filled + p.numel() > chunk_elems:
                bounds.append(o)
                filled = 0
            filled += p.numel()
        return bounds + [self.numel]

    def _own_chunks_for_large(self, chunk_elems):
        """Chunk bounds where a parameter of ``chunk_elems`` or more is cut into equal chunks of
        its own and smaller neighbours are grouped up to ``chunk_elems``."""
        bounds, filled = [0], 0
        for o, p in zip(self.offsets, self.params):
            n = p.numel()
            if n >= chunk_elems:
                if filled:
                    bounds.append(o)
                    filled = 0
                pieces = -(-n // chunk_elems)
                bounds += [o + n * k // pieces for k in range(1, pieces + 1)]
                continue
            if filled and filled + n > chunk_elems:
                bounds.append(o)
                filled = 0
            filled += n
        if bounds[-1] != self.numel:
            bounds.append(self.numel)
        return bounds

    def _span(self, s, e):
        """Indices [i0, i1) of the parameters overlapping flat range [s, e)."""
        i0 = bisect.bisect_right(self.offsets, s) - 1
        i1 = bisect.bisect_left(self.offsets, e)
        return i0, i1

    def _view(self, flat, i):
        o = self.offsets[i]
        return flat[o:o + self.params[i].numel()].view(self.shapes[i])

    def _back_to_back(self, tensors):
        """A flat view over ``tensors`` when they already lie in order in one storage, else None."""
        first = tensors[0]
        base, start = first.untyped_storage(), first.storage_offset()
        if all(t.untyped_storage().data_ptr() == base.data_ptr() and t.is_contiguous()
               and t.storage_offset() == start + o for t, o in zip(tensors, self.offsets)):
            return first.new_empty(0).set_(base, start, (self.numel,), (1,))
        return None

    def _flatten_params(self, dtype, device):
        """Reuse the storage when the params already lie back to back (an earlier plan's)."""
        flat = self._back_to_back([p.data for p in self.params])
        if flat is not None:
            return flat
        flat = torch.empty(self.numel, dtype=dtype, device=device)
        for i, p in enumerate(self.params):
            self._view(flat, i).copy_(p.data)
        for i, p in enumerate(self.params):
            p.data = self._view(flat, i)
        return flat

    def _adopt_state(self, states):
        """Move existing per-parameter state (checkpoint, earlier steps) into flat buffers;
        state already back to back (an earlier plan's, another mode's) is used where it lies."""
        if not states:
            return
        for key, v in states[0].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                flat = self._back_to_back([st[key] for st in states])
                if flat is None:
                    flat = torch.empty(self.numel, dtype=v.dtype, device=v.device)
                    for i, st in enumerate(states):
                        self._view(flat, i).copy_(st[key])
                        st[key] = self._view(flat, i)
                self.flat_state[key] = flat
                for cs, (s, e) in zip(self.chunk_states, self.chunk_bounds):
                    cs[key] = flat[s:e]
            elif isinstance(v, torch.Tensor):
                buf = self.scalar_state[key] = torch.stack([st[key] for st in states])
                for i, st in enumerate(states):
                    st[key] = buf[i]
                for cs in self.chunk_states:
                    cs[key] = v.clone()
            else:
                for cs in self.chunk_states:
                    cs[key] = v
        for keys in self.chunk_keys:
            keys.update(states[0])

    def sync(self, state_of, chunk_ids=None):
        """After chunks stepped: make per-parameter state agree with those chunks' state.

        ``state_of(param)`` gives the optimizer's state dict of a parameter. Returns a reason
        string when a chunk's state cannot be expressed per parameter.
        """
        for ci in range(len(self.chunks)) if chunk_ids is None else chunk_ids:
            why = self._sync_chunk(ci, state_of)
            if why:
                return why
        return None

    def _sync_chunk(self, ci, state_of):
        cs, (s, e), (i0, i1) = self.chunk_states[ci], self.chunk_bounds[ci], self.chunk_spans[ci]
        c = self.chunks[ci]
        if c.data_ptr() != self.flat[s:e].data_ptr():   # the optimizer replaced p.data
            self.flat[s:e].copy_(c.data)
            c.data = self.flat[s:e]
        known = self.chunk_keys[ci]
        for key, v in cs.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.shape != (e - s,):
                    return f"state '{key}' is not elementwise (shape differs from the chunk)"
                flat = self.flat_state.get(key)
                if flat is None:
                    flat = self.flat_state[key] = torch.zeros(self.numel, dtype=v.dtype, device=v.device)
                if v.data_ptr() != flat[s:e].data_ptr():       # created lazily, or replaced
                    flat[s:e].copy_(v)
                    cs[key] = flat[s:e]
                if key not in known:
                    for i in range(i0, i1):
                        state_of(self.params[i])[key] = self._view(flat, i)
            elif isinstance(v, torch.Tensor):
                buf = self.scalar_state.get(key)
                if buf is None:
                    buf = self.scalar_state[key] = v.detach().reshape(1).repeat(len(self.params))
                buf[i0:i1].copy_(v.expand(i1 - i0))
                if key not in known:
                    for i in range(i0, i1):
                        state_of(self.params[i])[key] = buf[i]
            else:
                for i in range(i0, i1):
                    st = state_of(self.params[i])
                    if st.get(key, cs) is not v:
                        st[key] = v
            known.add(key)
        return None

    def is_intact(self):
        """False when user code moved a parameter (``param.data = ...``, ``model.to(...)``)."""
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.param_ptrs))
