"""How fused chunks are stepped under ``fusion.exact: rounding``, and which way an optimizer gets.

Bitwise equality means running the user's step as written, a Python loop of tensor ops that makes
many passes over memory. Within float rounding two faster routes exist:

- ``fused kernel``: torch's own fused implementation (Adam, AdamW, SGD, Adagrad on the devices
  torch lists), switched on in the group for the call only, so the optimizer's settings, its state
  layout and its ``state_dict()`` stay as the user configured them;
- ``compiled``: the class's step through ``torch.compile``, one graph per param group whatever a
  chunk's length (dynamic shapes) and whatever its learning rate (passed as a tensor), with a
  compile-time budget;
- ``bitwise``: the user's step as written, where neither applies, fails or deviates too much.

A chunk's first step (state still empty) always runs bitwise, so state is created as the user's
settings create it. A route that fails at run time falls back to bitwise for good and says why.
"""

import inspect
import time
import weakref

import torch

from ..torch_internals import (compile_settings, count_own_graphs, dynamo_available, fused_kernel_devices,
                               graphs_compiled, hit_recompile_limit, recompile_limit, traceable, unhooked_step)
from .chunk_step import step_chunks

FUSED, COMPILED, BITWISE = "fused kernel", "compiled", "bitwise"
FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
# Group settings torch's fused kernels refuse or would change the meaning of.
_FUSED_CONFLICTS = ("differentiable", "capturable")


class Route:
    """The bitwise route, and what every route shares: the first step of a chunk, the fallback."""

    kind = BITWISE
    takes_params = False
    compile_seconds = 0.0     # spent compiling (the compiled route; the probe's share included)

    def __init__(self, opt, reason="fusion.exact: bitwise", max_deviation=None):
        self.raw = unhooked_step(opt)
        self.reason = reason
        self.max_deviation = max_deviation
        self.deviation = None        # the probe's figure for this route, relative
        self.bound = None            # the most the probe allowed
        self.fallback = None         # why a route stopped at run time
        self.ready = weakref.WeakValueDictionary()   # id -> chunk stepped once, no state created

    @classmethod
    def refusal(cls, opt, compile_budget_seconds):
        return None

    def fresh(self, opt):
        """The same route for another optimizer of the class (the probe's copy)."""
        return type(self)(opt, self.reason, self.max_deviation)

    def step_chunks(self, opt, items, hparams=None):
        """``chunk_step.step_chunks`` through this route."""
        if self.kind == BITWISE:
            step_chunks(opt, self.raw, items, hparams)
            return
        first = [it for it in items if not it[2] and self.ready.get(id(it[1])) is not it[1]]
        if first:
            step_chunks(opt, self.raw, first, hparams)
            self.ready.update((id(chunk), chunk) for _, chunk, _ in first)
        stepped = {id(chunk) for _, chunk, _ in first}
        rest = [it for it in items if id(it[1]) not in stepped]
        if rest:
            self._step_ready(opt, rest, hparams)

    def _step_ready(self, opt, items, hparams):
        step_chunks(opt, self.raw, items, hparams)

    def _fall_back(self, why):
        self.fallback = f"{self.kind} route left at run time: {why}"
        self.kind = BITWISE

    def note(self):
        """One phrase for the optimizer's reason in the report."""
        if self.fallback:
            return f"rounding route bitwise ({self.fallback})"
        if self.kind == BITWISE:
            return f"rounding route bitwise: {self.reason}"
        return (f"rounding route {self.kind}: the probe found it within {self.deviation:.2g} "
                f"(relative) of per-tensor steps, bound {self.bound:.2g}")

    def describe(self):
        out = {"route": self.kind, "why": self.fallback or self.reason,
               "deviation": self.deviation, "bound": self.bound}
        return out


class FusedKernelRoute(Route):
    kind = FUSED
    takes_params = True     # one kernel call takes every tensor of a group: no chunks needed

    def __init__(self, opt, reason="", max_deviation=None):
        super().__init__(opt, reason, max_deviation)
        self.mirrors = {}     # id(chunk) -> (weak ref to the chunk, its step count on its device)

    @classmethod
    def refusal(cls, opt, compile_budget_seconds):
        definer = next(k for k in type(opt).__mro__ if "step" in vars(k))
        if definer not in FUSED_CLASSES:
            return f"torch has no fused kernel for {type(opt).__qualname__}"
        devices = fused_kernel_devices()
        for group in opt.param_groups:
            for key in _FUSED_CONFLICTS:
                if group.get(key):
                    return f"a param group sets {key}=True"
            for p in group["params"]:
                if p.device.type not in devices or not p.dtype.is_floating_point:
                    return f"torch's fused kernels do not take {p.dtype} parameters on {p.device.type}"
        return None

    def _step_ready(self, opt, items, hparams):
        fused = {gi: dict((hparams or {}).get(gi, {}), fused=True, foreach=False) for gi, _, _ in items}
        steps = self._mirror_steps(items)
        try:
            step_chunks(opt, self.raw, items, fused)
        except Exception as e:      # refused before any update: step them as written instead
            self._unmirror(steps, stepped=False)
            self._fall_back(f"{type(e).__name__}: {e}".splitlines()[0][:300])
            step_chunks(opt, self.raw, items, hparams)
            return
        self._unmirror(steps, stepped=True)

    def _mirror_steps(self, items):
        """Fused kernels keep the step count beside the parameter, in float32; the user's settings
        may keep it on the CPU (CUDA without capturable) or in float64. Hand the kernel a mirror
        of it for the call, so the state and its ``state_dict()`` keep the user's layout."""
        swapped = []
        for _, chunk, cs in items:
            step = cs.get("step")
            if not isinstance(step, torch.Tensor) or (step.device == chunk.device and step.dtype == torch.float32):
                continue
            ref, mirror = self.mirrors.get(id(chunk), (None, None))
            if ref is None or ref() is not chunk:
                mirror = step.to(chunk.device, torch.float32)
                key = id(chunk)
                self.mirrors[key] = (weakref.ref(chunk, lambda _: self.mirrors.pop(key, None)), mirror)
            cs["step"] = mirror
            swapped.append((cs, step))
        return swapped

    @staticmethod
    def _unmirror(swapped, stepped):
        for cs, step in swapped:
            cs["step"] = step
            if stepped:
                step.add_(1)     # what the kernel did to the mirror, without waiting for the device


def _stand_in_class(cls):
    """A class with ``cls``'s methods that is no Optimizer: dynamo guards an Optimizer's tensors by
    identity (one graph per chunk); those of a plain object by shape, so one graph serves every
    chunk of a group."""
    methods = {}
    for k in reversed(cls.__mro__):
        methods.update({n: v for n, v in vars(k).items() if not n.startswith("__")})
    # Dynamo hides torch's ``_init_group`` from tracing, as it handles an Optimizer's itself.
    if "_init_group" in methods:
        methods["_init_group"] = traceable(methods["_init_group"])
    return type(f"{cls.__name__}StandIn", (), methods)


_compiled = {}     # optimizer class -> (stand-in class, compiled step): dynamo's graphs are per class


def _compiled_step(cls, raw):
    if cls not in _compiled:
        inner = inspect.unwrap(raw)     # without torch's no-grad wrapper, which breaks the graph
        _compiled[cls] = (_stand_in_class(cls), torch.compile(inner, fullgraph=True, dynamic=True))
    return _compiled[cls]


class CompiledRoute(Route):
    kind = COMPILED

    def __init__(self, opt, reason="", max_deviation=None, budget_seconds=60.0):
        super().__init__(opt, reason, max_deviation)
        self.budget_seconds = budget_seconds
        self.compile_seconds = 0.0
        self.graphs = 0
        stand_in_cls, self.fn = _compiled_step(type(opt), self.raw)
        self.stand_in = stand_in_cls.__new__(stand_in_cls)

    @classmethod
    def refusal(cls, opt, compile_budget_seconds):
        if compile_budget_seconds <= 0:
            return "fusion.compile_budget_seconds is 0"
        why = dynamo_available()
        if why:
            return why
        if any(g.get("differentiable") for g in opt.param_groups):
            return "a param group sets differentiable=True"
        return None

    def fresh(self, opt):
        return type(self)(opt, self.reason, self.max_deviation, self.budget_seconds)

    def _call(self, opt):
        self.stand_in.__dict__.update(vars(opt))
        # Only the chunk's state: dynamo guards a dict's length and keys.
        self.stand_in.state = {p: opt.state[p] for g in opt.param_groups for p in g["params"]}
        with torch.no_grad(), compile_settings():
            self.fn(self.stand_in)

    def _step_ready(self, opt, items, hparams):
        for n, item in enumerate(items):
            graphs, t0 = graphs_compiled(), time.perf_counter()
            try:
                step_chunks(opt, self._call, [item], _tensor_lr(opt, item[0], hparams))
            except Exception as e:     # dynamo raises before the frame runs: nothing was updated
                self._fall_back(compile_failure(e))
                step_chunks(opt, self.raw, items[n:], hparams)
                return
            new = graphs_compiled() - graphs
            if new:
                count_own_graphs(new)
                self.graphs += new
                self.compile_seconds += time.perf_counter() - t0
                if self.compile_seconds > self.budget_seconds:
                    self._fall_back(f"compiling took {self.compile_seconds:.1f} s, over "
                                    f"fusion.compile_budget_seconds ({self.budget_seconds:g} s)")
                    step_chunks(opt, self.raw, items[n + 1:], hparams)
                    return

    def describe(self):
        return dict(super().describe(), graphs=self.graphs, compile_seconds=round(self.compile_seconds, 3))


def _tensor_lr(opt, gi, hparams):
    """The group's learning rate as a 0-dim tensor for the call: a float is baked into the graph,
    so a scheduled one would cost a graph per value; a tensor is an input."""
    hp = dict((hparams or {}).get(gi, {}))
    lr = hp.get("lr", opt.param_groups[gi].get("lr"))
    if isinstance(lr, float):
        hp["lr"] = torch.tensor(lr, dtype=torch.float64)
    out = dict(hparams or {})
    out[gi] = hp
    return out


def compile_failure(error):
    """One line for the report on why torch.compile is not used."""
    if hit_recompile_limit(error):
        limit = recompile_limit()
        return (f"torch.compile reached dynamo's recompile limit ({limit}, shared by every optimizer "
                "of this class; a hyperparameter other than the learning rate that changes every "
                "step needs a graph per value)")
    return f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]


def choose(opt, exact, max_deviation, compile_budget_seconds):
    """The route for ``opt``: the first of fused kernel, compiled that applies and that the probe
    finds within ``max_deviation`` (relative, per probe step) of per-tensor steps; else bitwise."""
    if exact != "rounding":
        return Route(opt)
    if unhooked_step(opt) is None:
        return Route(opt, "its step() is not wrapped by torch's Optimizer hooks", max_deviation)
    from .fusability import route_deviation
    tried = []
    for cls in (FusedKernelRoute, CompiledRoute):
        why = cls.refusal(opt, compile_budget_seconds)
        if why is None:
            if cls is CompiledRoute:
                route = cls(opt, "", max_deviation, compile_budget_seconds)
            else:
                route = cls(opt, "", max_deviation)
            why = route_deviation(opt, route)
            if why is None:
                route.reason = "; ".join(tried + [f"{route.kind}: within the bound"])
                return route
        tried.append(f"not {cls.kind}: {why}")
    return Route(opt, "; ".join(tried), max_deviation)
