"""Flat buffers: one contiguous run of parameters, its gradients and its optimizer state.

A run holds parameters of one group that share dtype, device and the shape of their optimizer
state. Each parameter's ``.data`` becomes a view into the run's flat buffer, so an update of the
flat buffer (or of any chunk of it) is an update of the parameters. Chunks are plain slices of the
flat buffer; a parameter may straddle two chunks, which is harmless for elementwise updates.
"""

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
    """Parameters flattened into one buffer, with a flat gradient buffer and chunk views."""

    def __init__(self, params, states, chunk_elems):
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        p0 = self.params[0]
        self.flat = self._flatten_params(p0.dtype, p0.device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.grad_views = [self._view(self.flat_grad, i) for i in range(len(self.params))]
        self.param_ptrs = [p.data_ptr() for p in self.params]
        bounds = list(range(0, total, max(1, chunk_elems))) + [total]
        self.chunks = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            c = torch.nn.Parameter(self.flat[s:e], requires_grad=True)
            c.grad = self.flat_grad[s:e]
            self.chunks.append(c)
        self.chunk_bounds = list(zip(bounds[:-1], bounds[1:]))
        self.chunk_states = [dict() for _ in self.chunks]
        self.flat_state = {}       # key -> flat tensor (full-size state)
        self.scalar_state = {}     # key -> 1-D buffer, element i is parameter i's 0-dim value
        self.python_state = {}     # key -> plain value shared by every parameter
        self.known_keys = set()
        self._adopt_state(states)

    def _view(self, flat, i):
        o = self.offsets[i]
        return flat[o:o + self.params[i].numel()].view(self.shapes[i])

    def _flatten_params(self, dtype, device):
        """Reuse the storage when the params already lie back to back in one buffer."""
        first = self.params[0].data
        base = first.untyped_storage()
        start = first.storage_offset()
        if all(p.untyped_storage().data_ptr() == base.data_ptr() and p.is_contiguous()
               and p.storage_offset() == start + o for p, o in zip(self.params, self.offsets)):
            return first.new_empty(0).set_(base, start, (self.numel,), (1,))
        flat = torch.empty(self.numel, dtype=dtype, device=device)
        for i, p in enumerate(self.params):
            self._view(flat, i).copy_(p.data)
        for i, p in enumerate(self.params):
            p.data = self._view(flat, i)
        return flat

    def _adopt_state(self, states):
        """Move existing per-parameter state (checkpoint, earlier steps) into flat buffers."""
        if not states:
            return
        for key, v in states[0].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                flat = torch.empty(self.numel, dtype=v.dtype, device=v.device)
                for i, st in enumerate(states):
                    self._view(flat, i).copy_(st[key])
                self._set_full(key, flat, states)
            elif isinstance(v, torch.Tensor):
                buf = torch.stack([st[key] for st in states])
                self._set_scalar(key, buf, states)
                for cs in self.chunk_states:
                    cs[key] = v.clone()
            else:
                self.python_state[key] = v
                for cs in self.chunk_states:
                    cs[key] = v
        self.known_keys = set(states[0])

    def _set_full(self, key, flat, states):
        self.flat_state[key] = flat
        for i, st in enumerate(states):
            st[key] = self._view(flat, i)
        for cs, (s, e) in zip(self.chunk_states, self.chunk_bounds):
            cs[key] = flat[s:e]

    def _set_scalar(self, key, buf, states):
        self.scalar_state[key] = buf
        for i, st in enumerate(states):
            st[key] = buf[i]

    def sync(self, state_of):
        """After a fused step: make per-parameter state agree with the chunks' state.

        ``state_of(param)`` gives the optimizer's state dict of a parameter. Returns a reason
        string when the chunks' state cannot be expressed per parameter.
        """
        keys = set(self.chunk_states[0])
        if keys == self.known_keys:
            self.after_step(state_of)
            return None
        states = [state_of(p) for p in self.params]
        return self._consolidate(states, keys)

    def _consolidate(self, states, keys):
        """Gather lazily created chunk state (first step, or keys added later) into flat buffers."""
        if any(set(cs) != keys for cs in self.chunk_states):
            return "chunks created different state keys"
        for key in keys - self.known_keys:
            vals = [cs[key] for cs in self.chunk_states]
            v0 = vals[0]
            if isinstance(v0, torch.Tensor) and v0.dim() > 0:
                if any(v.shape != (e - s,) for v, (s, e) in zip(vals, self.chunk_bounds)):
                    return f"state '{key}' is not elementwise (shape differs from the chunk)"
                flat = torch.empty(self.numel, dtype=v0.dtype, device=v0.device)
                for v, (s, e) in zip(vals, self.chunk_bounds):
                    flat[s:e].copy_(v)
                self._set_full(key, flat, states)
            elif isinstance(v0, torch.Tensor):
                if any(not torch.equal(v, v0) for v in vals[1:]):
                    return f"scalar state '{key}' differs between chunks"
                buf = v0.detach().reshape(1).repeat(len(self.params))
                self._set_scalar(key, buf, states)
            else:
                self.python_state[key] = v0
                for st in states:
                    st[key] = v0
        self.known_keys = keys
        by_id = {id(p): st for p, st in zip(self.params, states)}
        self.after_step(lambda p: by_id[id(p)])
        return None

    def after_step(self, state_of):
        """Keep flat buffers authoritative when the optimizer replaced tensors instead of
        updating them in place, and copy scalar state out to every parameter."""
        for c, (s, e) in zip(self.chunks, self.chunk_bounds):
            if c.data_ptr() != self.flat[s:e].data_ptr():
                self.flat[s:e].copy_(c.data)
                c.data = self.flat[s:e]
        for key, flat in self.flat_state.items():
            for cs, (s, e) in zip(self.chunk_states, self.chunk_bounds):
                v = cs[key]
                if v.data_ptr() != flat[s:e].data_ptr() or v.shape != (e - s,):
                    flat[s:e].copy_(v)
                    cs[key] = flat[s:e]
        for key, buf in self.scalar_state.items():
            buf.copy_(self.chunk_states[0][key].expand_as(buf))
        for key in self.python_state:
            v = self.chunk_states[0][key]
            if v is not self.python_state[key]:
                self.python_state[key] = v
                for p in self.params:
                    state_of(p)[key] = v

    def is_intact(self):
        """False when user code moved a parameter (``param.data = ...``, ``model.to(...)``)."""
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.param_ptrs))
