"""Flat buffers: one contiguous run of parameters, its gradients and its optimizer state.

A run holds parameters of one group that share dtype, device and the shape of their optimizer
state. Each parameter's ``.data`` becomes a view into the run's flat buffer, so an update of the
flat buffer (or of any chunk of it) is an update of the parameters. Chunks are plain slices of the
flat buffer, cut at parameter boundaries except inside parameters larger than a chunk.

A parameter's range of the buffer holds it in its own memory order, and the parameter and its
state tensors are views with its own strides (those torch gives state made with
``preserve_format``): a transposed or channels_last weight stays one, so every kernel reading it
takes the path it takes unpatched, and the chunks, being slices of storage, stay elementwise
aligned with the parameters' state and gradients (``ChunkGrads`` reads those in that order too).

A run may be sharded (``share=(rank, world)``, sharding/shares.py): it is cut into one contiguous range
per rank, and this process holds the optimizer state of its own range only (``lo`` to ``hi``;
the whole run otherwise), steps only the chunks in it (``own``), and mirrors per parameter only
the state of the parameters wholly inside it (``holds``); the rest of the run's state is other
ranks'.

Each chunk is registered with the parameters it spans (``stand_ins.cover``), so that what reads
an optimizer's param groups while a fused step runs (a communication algorithm's check of the
parameters it updates, QAdam's layout of its average) finds the user's parameters behind it.
"""

import bisect

import torch

from ..stand_ins import cover
from .chunk_grads import ChunkGrads
from .freed_heap import HeapRelease
from .sharding.shares import cut_shares

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
            elif (v.shape == param.shape and v.device == param.device and not v.is_sparse
                  and v.stride() == param.stride()):
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


def unflattenable_state(param, state):
    """Why ``state_signature(param, state)`` is None."""
    if any(isinstance(v, torch.Tensor) and v.dim() and v.shape == param.shape
           and v.stride() != param.stride() for v in state.values()):
        return "optimizer state is in another memory order than its parameter"
    return "optimizer state is not elementwise"


class FlatRun:
    """Parameters flattened into one buffer, with chunk views and per-chunk optimizer state.

    By default (multi_layer) a parameter of at least a chunk's size gets chunks of its own;
    ``align=True`` keeps every parameter whole in one chunk (backward and forward fusion update
    chunks as their parameters' gradients become final). How each chunk gets its gradient is
    ``grads`` (chunk_grads.py); ``keep_grads`` is passed on to it. ``share=(rank, world)``
    shards its optimizer state (see the module's docstring).
    """

    def __init__(self, params, states, chunk_elems, align=False, keep_grads=False, share=None):
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.strides = [p.stride() for p in self.params]
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
        self.cuts, self.lo, self.hi = None, 0, total    # the elements whose state this process holds
        if share is not None:
            rank, world = share
            bounds, self.cuts = cut_shares(bounds, self.offsets, world)
            self.lo, self.hi = self.cuts[rank], self.cuts[rank + 1]
        self.chunk_bounds = list(zip(bounds[:-1], bounds[1:]))
        self.own = [ci for ci, (s, e) in enumerate(self.chunk_bounds) if self.lo <= s and e <= self.hi]
        self.chunk_spans = [self._span(s, e) for s, e in self.chunk_bounds]
        self.chunks = [torch.nn.Parameter(self.flat[s:e], requires_grad=True) for s, e in self.chunk_bounds]
        for c, (i0, i1) in zip(self.chunks, self.chunk_spans):
            cover(c, self.params[i0:i1])
        self.grads = ChunkGrads(self, keep_grads)
        self.chunk_states = [dict() for _ in self.chunks]
        self.chunk_keys = [set() for _ in self.chunks]   # state keys already mirrored per param
        self.flat_state = {}       # key -> flat tensor (full-size state; elements lo to hi when sharded)
        self.scalar_state = {}     # key -> 1-D buffer, element i is parameter i's 0-dim value
        self.heap = HeapRelease()  # the chunk state moved into flat_state, to hand back to the system
        self._adopt_state(states)

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
        return flat[o:o + self.params[i].numel()].as_strided(self.shapes[i], self.strides[i])

    def param_view(self, flat, i):
        """Parameter ``i`` (shape, strides) in ``flat``, a tensor as long as the run."""
        return self._view(flat, i)

    def holds(self, i):
        """True when parameter ``i`` lies wholly in the elements whose state this process holds."""
        return self.lo <= self.offsets[i] and self.offsets[i] + self.params[i].numel() <= self.hi

    def _state_view(self, flat, i):
        """Parameter ``i`` in ``flat``, a state buffer of elements ``lo`` to ``hi`` (it ``holds`` i)."""
        o = self.offsets[i] - self.lo
        return flat[o:o + self.params[i].numel()].as_strided(self.shapes[i], self.strides[i])

    def _copy_held(self, flat, i, tensor):
        """Copy the part of parameter ``i``'s state ``tensor`` that lies in ``lo`` to ``hi`` into
        ``flat`` (a state buffer of those elements), in the parameter's memory order."""
        if self.holds(i):
            self._state_view(flat, i).copy_(tensor)
            return
        o, n = self.offsets[i], self.params[i].numel()
        a, b = max(o, self.lo), min(o + n, self.hi)
        if a < b:
            flat[a - self.lo:b - self.lo].copy_(tensor.as_strided((n,), (1,))[a - o:b - o])

    def _back_to_back(self, tensors):
        """A flat view over ``tensors`` when they already lie in order in one storage, each with
        its parameter's strides, else None."""
        first = tensors[0]
        base, start = first.untyped_storage(), first.storage_offset()
        if all(t.untyped_storage().data_ptr() == base.data_ptr() and t.stride() == stride
               and t.storage_offset() == start + o
               for t, o, stride in zip(tensors, self.offsets, self.strides)):
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
        owned = [(self.chunk_states[ci], self.chunk_bounds[ci]) for ci in self.own]
        for key, v in states[0].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                flat = None if self.cuts else self._back_to_back([st[key] for st in states])
                if flat is None:
                    flat = torch.empty(self.hi - self.lo, dtype=v.dtype, device=v.device)
                    for i, st in enumerate(states):
                        self._copy_held(flat, i, st[key])
                        if self.holds(i):
                            st[key] = self._state_view(flat, i)
                self.flat_state[key] = flat
                for cs, (s, e) in owned:
                    cs[key] = flat[s - self.lo:e - self.lo]
            elif isinstance(v, torch.Tensor):
                buf = self.scalar_state[key] = torch.stack([st[key] for st in states])
                for i, st in enumerate(states):
                    st[key] = buf[i]
                for cs, _ in owned:
                    cs[key] = v.clone()
            else:
                for cs, _ in owned:
                    cs[key] = v
        for ci in self.own:
            self.chunk_keys[ci].update(states[0])
        for i, st in enumerate(states):
            if not self.holds(i):
                st.clear()      # another rank holds (the rest of) it

    def sync(self, state_of, chunk_ids=None):
        """After chunks stepped: make per-parameter state agree with those chunks' state.

        ``state_of(param)`` gives the optimizer's state dict of a parameter. Returns a reason
        string when a chunk's state cannot be expressed per parameter. The first step's chunk
        state (made by the optimizer) moves into flat buffers, each chunk's let go as it is copied
        and the heap it lay on handed back (``freed_heap.py``): the state exists twice for no
        more than a batch.
        """
        ids = range(len(self.chunks)) if chunk_ids is None else chunk_ids
        for ci in ids:
            why = self._sync_chunk(ci, state_of, ids)
            if why:
                return why
        if self.heap.pending:
            self.heap.done()
        return None

    def _new_state_buffer(self, chunk_ids, like):
        """A flat buffer for a state key: unfilled when the chunks being synced cover it (each
        writes its part, so its pages are touched only as the chunks' state arrives), else zeros."""
        covered = sum(self.chunk_bounds[ci][1] - self.chunk_bounds[ci][0] for ci in chunk_ids) == self.hi - self.lo
        make = torch.empty if covered else torch.zeros
        return make(self.hi - self.lo, dtype=like.dtype, device=like.device)

    def _sync_chunk(self, ci, state_of, chunk_ids):
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
                    flat = self.flat_state[key] = self._new_state_buffer(chunk_ids, v)
                mine = flat[s - self.lo:e - self.lo]
                if v.data_ptr() != mine.data_ptr():       # created lazily, or replaced
                    mine.copy_(v)
                    cs[key] = mine
                    self.heap.moved(v.nbytes)
                if key not in known:
                    for i in filter(self.holds, range(i0, i1)):
                        state_of(self.params[i])[key] = self._state_view(flat, i)
            elif isinstance(v, torch.Tensor):
                buf = self.scalar_state.get(key)
                if buf is None:
                    buf = self.scalar_state[key] = v.detach().reshape(1).repeat(len(self.params))
                buf[i0:i1].copy_(v.expand(i1 - i0))
                if key not in known:
                    for i in filter(self.holds, range(i0, i1)):
                        state_of(self.params[i])[key] = buf[i]
            else:
                for i in filter(self.holds, range(i0, i1)):
                    st = state_of(self.params[i])
                    if st.get(key, cs) is not v:
                        st[key] = v
            known.add(key)
        return None

    def is_intact(self):
        """False when user code moved a parameter (``param.data = ...``, ``model.to(...)``)."""
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.param_ptrs))
