"""Optimizers over DTensor parameters (FSDP2, tensor parallel) step over the plain local shards.

An optimizer over DTensors pays DTensor dispatch (sharding propagation in Python) on every op of
every parameter, although an elementwise update does not care how a tensor is sharded: each rank
updates its own shard, and every rank updates its replica of a replicated tensor alike. Around
each ``step()`` this swaps the DTensor parameters of a group for plain Parameters over their local
shards (the same memory), gives each the local shard of its gradient and of its optimizer state,
and swaps everything back afterwards. Outside ``step()`` the optimizer holds exactly what it holds
unpatched: DTensor parameters, and DTensor state with the parameter's mesh, placements, shape
and stride, so ``state_dict()``, ``torch.distributed.checkpoint`` and
``get/set_optimizer_state_dict`` see no difference.

Why no flat buffers: FSDP2 owns the shard storage. Its all-gather reads ``_sharded_param_data``,
of which the local tensor is a view, and FSDP re-derives both from the parameter whenever it
resets it (lazy init, ``module.to()``, ``load_state_dict(assign=True)``). Moving the shards into a
buffer of autopatch's would mean rewriting those private fields, whose layout is FSDP's to
change between torch releases. A flat *copy* (update a copy, write it back) would leave FSDP's
storage alone but hold a second copy of the shards and their gradients, against autopatch's
promise never to make a run bigger; ``benchmarks/bench_fsdp.py`` measures what it would gain.

A parameter steps as its local shard only when that is the same computation: placements Shard
or Replicate (a Partial tensor holds unreduced values), a gradient with the parameter's
placements, and optimizer state that is either not a tensor, a 0-dim tensor, or a DTensor laid
out like the parameter. A parameter's first step runs on its DTensor, so the optimizer creates
its state in the very form it creates unpatched; a state tensor that appears later is given the
parameter's layout. A group steps on local shards entirely or on DTensors entirely (torch's
foreach kernels refuse a list mixing both); the report counts why a group stayed on DTensors.

What is known about a parameter is kept between steps and checked again only when something
changed (its shard object, its placements, the objects in its state), so the swap costs a few
microseconds per parameter; the local tensor is read without the fresh view that ``to_local()``
makes for Parameters (torch_internals.local_tensor).
"""

import weakref

import torch

from ..torch_internals import dtensor_like, is_dtensor
from ..torch_internals import local_tensor as _local
from .param_swap import ParamSwap, fuse_when_grads_exist
from .strategy import NotFusable, Strategy, WeakOptimizer

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MISSING = object()
_NEEDS_A_FIRST_STEP = "its first step runs on the DTensor, so the optimizer creates its state as unpatched"


class _Shard:
    """What is known about one DTensor parameter while its local shard object stays the same."""
    __slots__ = ("ref", "local", "placements", "shadow", "why", "state_ids")

    def __init__(self, p, local):
        self.ref, self.local, self.placements = weakref.ref(p), local, p.placements
        self.shadow = torch.nn.Parameter(local, requires_grad=p.requires_grad)
        self.state_ids = None        # ids of the state values last found laid out like the shard
        self.why = None
        if any(pl.is_partial() for pl in self.placements):
            self.why = "Partial placement: its local tensor holds unreduced values"
        elif type(local) not in _PLAIN or local.layout != torch.strided:
            self.why = f"its local shard is a {type(local).__name__}, not a plain tensor"

    def holds(self, p, local):
        return self.local is local and self.placements is p.placements and self.ref() is p


class LocalShardStep(Strategy):
    """Swaps local-shard Parameters into an optimizer around each step (mode multi_layer)."""
    opt = WeakOptimizer()


    def __init__(self, optimizer, chunk_bytes=None):
        self.opt = optimizer
        self.chunk_bytes = chunk_bytes      # unused: kept so a mode switch can hand it on
        self.shards = {}       # id(param) -> _Shard
        self.stepped = {}      # id(param) -> weakref: params the optimizer has stepped on their DTensor
        self.lists = ParamSwap()   # the user's params lists while the shards stand in
        self.handed = []       # (param, its shard, the state handed in) for each swapped param
        self.excluded = {}     # reason -> parameters that stayed on their DTensor at the last step
        self.local_params = 0  # parameters stepped as local shards at the last step
        self.fused_steps = 0
        self.dtensor_group_steps = 0

    # -- what may step as a local shard ---------------------------------------------------------
    def _shard(self, p):
        """``p``'s _Shard, and None when ``p`` (a DTensor with a gradient) can step as its local
        shard this time, else the reason it cannot."""
        local = _local(p)
        shard = self.shards.get(id(p))
        if shard is None or not shard.holds(p, local):
            shard = self.shards[id(p)] = _Shard(p, local)
        return shard, shard.why or self._grad_differs(p, shard) or self._state_differs(p, shard)

    @staticmethod
    def _grad_differs(p, shard):
        g = p.grad
        if not is_dtensor(g) or (g.placements is not shard.placements and g.placements != shard.placements):
            return "its gradient is not laid out like the parameter (needs a reduction first)"
        g_local = _local(g)
        if type(g_local) not in _PLAIN or g_local.shape != shard.local.shape or g_local.layout != torch.strided:
            return "its gradient's local shard differs from the parameter's"
        return None

    def _state_differs(self, p, shard):
        state = self.opt.state.get(p)
        if state is None:
            ref = self.stepped.get(id(p))
            return None if ref is not None and ref() is p else _NEEDS_A_FIRST_STEP
        ids = tuple(map(id, state.values()))
        if ids == shard.state_ids:
            return None
        for key, v in state.items():
            if is_dtensor(v):
                if v.dim() == 0 and not any(pl.is_partial() for pl in v.placements):
                    continue
                if (v.placements != p.placements or v.shape != p.shape or _local(v).shape != shard.local.shape
                        or (v.device_mesh is not p.device_mesh and v.device_mesh != p.device_mesh)):
                    return f"optimizer state '{key}' is laid out differently from the parameter"
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                return f"optimizer state '{key}' is a plain tensor beside a DTensor parameter"
        shard.state_ids = ids
        return None

    # -- the step -------------------------------------------------------------------------------
    def swap_in(self):
        if self.lists:
            return
        self.excluded, self.local_params = {}, 0
        with torch.no_grad():       # to_local() outside no_grad records an autograd node
            for group in self.opt.param_groups:
                self._swap_group(group)
        if self.lists:
            self.fused_steps += 1

    def _swap_group(self, group):
        params = group["params"]
        ready, blocked = [], []
        for i, p in enumerate(params):
            if p.grad is None or not is_dtensor(p):
                continue        # plain tensors step as they are; without a grad, the optimizer skips it
            shard, why = self._shard(p)
            if why:
                blocked.append(why)
            else:
                ready.append((i, p, shard))
        if blocked:
            self._stays_on_dtensors(params, blocked, len(ready))
        if blocked or not ready:
            return
        swapped = list(params)
        done = []
        state_of = self.opt.state
        for i, p, shard in ready:
            s = swapped[i] = shard.shadow
            s.grad = _local(p.grad)
            state = state_of.get(p)
            handed = None
            if state is not None:
                handed = {k: _local(v) if is_dtensor(v) else v for k, v in state.items()}
                state_of[s] = dict(handed)
            done.append((p, shard, handed))
        self.lists.put(group, swapped)
        self.handed += done
        self.local_params += len(done)

    def _stays_on_dtensors(self, params, blocked, ready):
        """The group steps on its DTensors this time, as unpatched. The report says why, unless
        it is only some parameter's first step."""
        reasons = [why for why in blocked if why != _NEEDS_A_FIRST_STEP]
        for why in reasons:
            self.excluded[why] = self.excluded.get(why, 0) + 1
        if reasons and ready:
            why = "in a param group with a parameter that stays a DTensor"
            self.excluded[why] = self.excluded.get(why, 0) + ready
        self.dtensor_group_steps += 1
        for p in params:
            if p.grad is not None and is_dtensor(p):
                self.stepped[id(p)] = weakref.ref(p)

    def restore(self):
        """Put the DTensors back and carry what the step did to the shards' state over to them."""
        self.lists.restore()
        done, self.handed = self.handed, []
        failure = None
        with torch.no_grad():
            for p, shard, handed in done:
                shard.shadow.grad = None
                state = self.opt.state.pop(shard.shadow, None)
                if failure is None and state is not None:
                    failure = self._carry_back(p, shard, state, handed or {})
        if failure:
            raise NotFusable(f"{type(self.opt).__qualname__} cannot step local shards: {failure}")

    def _carry_back(self, p, shard, state, handed):
        """Mirror the shard's state into ``p``'s: changed entries only, as DTensors where full-size."""
        s, local = shard.shadow, shard.local
        if s.data_ptr() != local.data_ptr():    # the optimizer replaced s.data: write it back
            local.copy_(s.detach())
            s.data = local
        mine = self.opt.state[p]
        if len(mine) != len(state):
            for key in [k for k in mine if k not in state]:
                del mine[key]
        for key, v in state.items():
            if handed.get(key, _MISSING) is v:
                continue                # updated in place, as nearly every optimizer does
            old = mine.get(key)
            if isinstance(v, torch.Tensor) and is_dtensor(old) and v.shape == _local(old).shape:
                v = dtensor_like(v, old)
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.shape != local.shape:
                    return f"state '{key}' is not elementwise (shape differs from the local shard)"
                v = dtensor_like(v, p)
            mine[key] = v
        return None

    # -- the strategy -------------------------------------------------------------------------
    def before_step(self, closure):
        return fuse_when_grads_exist(closure, self.swap_in)

    # Every way out of a step puts the DTensors back and carries the shards' state over.
    after_step = flush = deactivate = restore

    def invalidate(self):
        """State was loaded or params replaced from outside: forget what was known."""
        self.restore()
        self.shards = {}

    def set_chunk_bytes(self, chunk_bytes):
        self.chunk_bytes = int(chunk_bytes)

    def chunk_bytes_in_use(self):
        return self.chunk_bytes

    def describe(self):
        return {
            "layout": "local_shards",
            "runs": 0, "chunks": 0, "flat_bytes": 0, "gathered_params": 0, "kept_grad_bytes": 0,
            "fused_params": self.local_params,
            "chunk_bytes": self.chunk_bytes, "chunk_bytes_requested": self.chunk_bytes, "replans": 0,
            "excluded_params": dict(self.excluded),
            "fused_steps": self.fused_steps,
            "dtensor_group_steps": self.dtensor_group_steps,
        }

