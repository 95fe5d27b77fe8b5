"""Fusability probe: does stepping over flat chunks give what stepping per tensor gives?

Run on a throw-away copy of the user's optimizer (same class, same hyperparameters, fresh state)
over small random tensors of several shapes, so optimizers with per-tensor norms (LAMB, LARS),
factored state (Adafactor) or matrix updates (Shampoo, Muon) are caught before they touch the
user's model. Results are cached per class, hyperparameters, dtype and device.

Under ``fusion.exact: rounding`` it also measures a rounding route (fused kernel, compiled; see
routes.py) against per-tensor steps: the largest deviation of any weight or state tensor,
relative to that tensor's largest magnitude, must stay within the route's bound per step.
"""

import copy
from collections import OrderedDict, defaultdict

import torch

from ..patches.ledger import own_objects
from ..torch_internals import global_optimizer_hooks_silenced, hook_dicts, unhooked_step
from .chunk_step import step_chunks
from .multi_layer import MultiLayerStep
from .planner import FlatPlanner
from .strategy import NotFusable

SHAPES = [(7, 5), (13,), (3, 4, 5), (1,), (33, 2), (4, 4)]
STEPS = 3
ROUTE_STEPS = 4        # a chunk's first step runs bitwise: three through the route
_cache = {}


class ProbeResult:
    def __init__(self, fusable, bitwise, reason):
        self.fusable, self.bitwise, self.reason = fusable, bitwise, reason


def _hparams_key(group):
    return tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))


def _clone(opt, group, params):
    """A copy of ``opt`` over ``params`` only: no state, no hooks, no reference to the model."""
    memo = {id(opt.state): defaultdict(dict), id(opt.param_groups): []}
    for g in opt.param_groups:
        memo[id(g["params"])] = []
        for p in g["params"]:
            memo[id(p)] = torch.empty(0)
    for hooks in hook_dicts(opt):
        memo[id(hooks)] = OrderedDict()
    # Per-instance callables (an LR scheduler's wrapper around ``opt.step``) point back at the
    # user's optimizer: the copy must use its class's methods instead.
    attrs = {k: v for k, v in vars(opt).items() if not callable(v)}
    clone = type(opt).__new__(type(opt))
    clone.__dict__.update(copy.deepcopy(attrs, memo))
    hp = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
    half = len(params) // 2   # two groups: a split step must leave the other group alone
    clone.param_groups = [dict(hp, params=params[:half]), dict(copy.deepcopy(hp), params=params[half:])]
    clone.state = _initial_state(opt, clone.param_groups)
    return clone


def _initial_state(opt, groups):
    """The state the class's ``__init__`` gives fresh parameters: usually none, but some classes
    create it up front (Adagrad's ``sum`` in torch 2.4 to 2.11) and only read it when stepping.
    Built by the class itself on the copy's groups; empty when the class cannot be built that
    way (an ``__init__`` that does not take its ``defaults`` as keywords)."""
    try:
        with own_objects():
            fresh = type(opt)([dict(g) for g in groups], **copy.deepcopy(opt.defaults))
    except Exception:
        return defaultdict(dict)
    state = defaultdict(dict)
    state.update(fresh.state)
    return state


def _run(opt, params, grads, how, route=None):
    """Step ``opt`` over ``params`` for each set of grads: per tensor ("plain"), over flat chunks
    in one step() ("fused", through ``route`` when given), or one chunk per call of the unwrapped
    step ("split")."""
    chunk_bytes = 48 * params[0].element_size()
    raw = unhooked_step(opt)
    if how == "split" and raw is None:
        raise NotFusable("its step() is not wrapped by torch's Optimizer hooks")
    fused = MultiLayerStep(opt, chunk_bytes, route=route) if how == "fused" else None
    planner = FlatPlanner(opt, chunk_bytes, align=True) if how == "split" else None
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        if how == "plain":
            opt.step()
        elif how == "fused":
            fused.before_step(None)
            try:
                opt.step()
            finally:
                fused.after_step()
        else:
            if planner.needs_plan():
                planner.plan()
            for gi, plan in enumerate(planner.plans):
                for run in plan.runs:
                    for ci, chunk in enumerate(run.chunks):
                        run.grads.bind((ci,))
                        step_chunks(opt, raw, [(gi, chunk, run.chunk_states[ci])])
                        run.grads.release((ci,))
                        run.sync(opt.state.__getitem__, [ci])


def probe(opt, group, split=False):
    """Compare fused and per-tensor steps for one param group of ``opt``.

    ``split``: the fused side calls the optimizer once per chunk (backward and forward fusion),
    which also catches optimizers that keep per-call counters or global state.
    """
    p0 = next((p for p in group["params"] if p.dtype.is_floating_point), None)
    if p0 is None:
        return ProbeResult(False, False, "no floating-point parameters")
    key = (type(opt), _hparams_key(group), p0.dtype, p0.device.type, split)
    if key in _cache:
        return _cache[key]
    ref, fus, grads = _inputs(p0, STEPS)
    try:
        ref_opt = _clone(opt, group, ref)
        fus_opt = _clone(opt, group, fus)
        with global_optimizer_hooks_silenced():      # the copies' steps are not the user's
            _run(ref_opt, ref, grads, "plain")
            _run(fus_opt, fus, grads, "split" if split else "fused")
        ref_state = ref_opt.state_dict()["state"]
        fus_state = fus_opt.state_dict()["state"]
    except NotFusable as e:
        result = ProbeResult(False, False, str(e))
    except Exception as e:  # any failure means: do not fuse this class
        result = ProbeResult(False, False, f"probe failed: {type(e).__name__}: {e}")
    else:
        result = _compare(ref, fus, ref_state, fus_state)
    _cache[key] = result
    return result


def _inputs(p0, steps):
    gen = torch.Generator().manual_seed(1234)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) * (1 + i) for i, s in enumerate(SHAPES)] for _ in range(steps)]
    to = dict(dtype=p0.dtype, device=p0.device)
    return ([torch.nn.Parameter(t.to(**to, copy=True)) for t in init],
            [torch.nn.Parameter(t.to(**to, copy=True)) for t in init],
            [[g.to(**to) for g in gs] for gs in grads])


def route_deviation(opt, route):
    """None when ``route`` steps every param group of ``opt`` within its bound of per-tensor
    steps, else why not. Sets ``route.deviation`` (the largest relative deviation found) and
    ``route.bound`` (``max_deviation`` per step, over the probe's steps)."""
    route.bound = route.max_deviation * ROUTE_STEPS
    route.deviation = 0.0
    for group in opt.param_groups:
        p0 = next((p for p in group["params"] if p.dtype.is_floating_point), None)
        if p0 is None:
            continue
        key = (type(opt), _hparams_key(group), p0.dtype, p0.device.type, route.kind, route.max_deviation)
        if key not in _cache:
            _cache[key] = _route_probe(opt, group, route, p0)
        why, deviation = _cache[key]
        route.deviation = max(route.deviation, deviation or 0.0)
        if why:
            return why
    return None


def _route_probe(opt, group, route, p0):
    ref, fus, grads = _inputs(p0, ROUTE_STEPS)
    try:
        ref_opt = _clone(opt, group, ref)
        fus_opt = _clone(opt, group, fus)
        probe_route = route.fresh(fus_opt)
        with global_optimizer_hooks_silenced():
            _run(ref_opt, ref, grads, "plain")
            _run(fus_opt, fus, grads, "fused", probe_route)
        ref_state = ref_opt.state_dict()["state"]
        fus_state = fus_opt.state_dict()["state"]
    except Exception as e:   # any failure means: not this route
        return f"probe failed: {type(e).__name__}: {e}".splitlines()[0][:300], None
    route.compile_seconds += probe_route.compile_seconds
    if probe_route.fallback:
        return probe_route.fallback, None
    pairs = list(zip(ref, fus))
    for i in ref_state:
        a, b = ref_state[i], fus_state.get(i, {})
        if set(a) != set(b):
            return f"its state keys {sorted(b)} differ from {sorted(a)}", None
        for k in a:
            va, vb = a[k], b[k]
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
                if (va.shape, va.dtype, va.device) != (vb.shape, vb.dtype, vb.device):
                    return (f"state '{k}' becomes {vb.dtype} {tuple(vb.shape)} on {vb.device}, "
                            f"not {va.dtype} {tuple(va.shape)} on {va.device}"), None
                pairs.append((va, vb))
            elif type(va) is not type(vb) or (va != vb and not isinstance(va, torch.Tensor)):
                return f"state '{k}' differs", None
    deviation = max(_relative(a, b) for a, b in pairs)
    if not deviation <= route.bound:
        return (f"the probe found it {deviation:.2g} (relative) from per-tensor steps, beyond the "
                f"bound {route.bound:.2g} (fusion.max_deviation per step)"), deviation
    return None, deviation


def _relative(a, b):
    """Largest elementwise difference relative to the larger tensor's largest magnitude."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(a.abs().max().item(), b.abs().max().item()) if a.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def _compare(ref, fus, ref_state, fus_state):
    pairs = list(zip(ref, fus))
    if set(ref_state) != set(fus_state):
        return ProbeResult(False, False, "fused run keeps state for different parameters")
    for i in ref_state:
        a, b = ref_state[i], fus_state[i]
        if set(a) != set(b):
            return ProbeResult(False, False, f"fused state keys {sorted(b)} differ from {sorted(a)}")
        for k in a:
            va, vb = a[k], b[k]
            if isinstance(va, torch.Tensor) != isinstance(vb, torch.Tensor):
                return ProbeResult(False, False, f"state '{k}' changes type when fused")
            if isinstance(va, torch.Tensor):
                if va.shape != vb.shape:
                    return ProbeResult(False, False, f"state '{k}' is not elementwise")
                pairs.append((va, vb))
            elif va != vb:
                return ProbeResult(False, False, f"state '{k}' differs when fused")
    bitwise = all(torch.equal(a, b) for a, b in pairs)
    if bitwise:
        return ProbeResult(True, True, "the probe found fused steps bit-for-bit equal to per-tensor steps")
    for a, b in pairs:
        a, b = a.double(), b.double()
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
            err = (a - b).abs().max().item()
            return ProbeResult(False, False, f"per-tensor update (fused result differs by up to {err:.3g})")
    return ProbeResult(True, False, "fused steps equal per-tensor steps within float rounding")
