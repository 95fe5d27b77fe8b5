"""One optimizer under autopatch: its hooks, its mode and the reason for it, its step clock.

Interception uses the optimizer's own per-instance step hooks. ``Optimizer.step`` is wrapped once
per class by torch itself, and LR schedulers or wrappers such as accelerate's call through that
wrapper, so these hooks see every step however it is reached (closures included).

Every fusion mode is an object with the same small protocol (``before_step(closure)``,
``after_step()``, ``flush()``, ``invalidate()``, ``deactivate()``, ``set_chunk_bytes(n)``,
``describe()``); switching modes between steps deactivates one (applying anything pending) and
activates another over the same per-parameter optimizer state, so a switch never changes results.
"""

import sys
import time
import weakref

import torch

from . import guard, sharded
from .fusion.backward import BackwardFusion
from .fusion.chunk_step import raw_step_of
from .fusion.chunking import default_chunk_bytes
from .fusion.forward import ForwardFusion
from .fusion.multi_layer import MultiLayerStep
from .fusion.probe import probe
from .observe import Observation
from .policy import class_matches

FUSION_MODES = ("multi_layer", "backward", "forward")
# Mode auto's order, fastest first. On CPU, updating inside backward or forward gains no cache
# locality worth its per-chunk calls and hooks, and multi_layer measures fastest
# (benchmarks/RESULTS.md, "Fusion modes"); on accelerators the paper's order applies.
AUTO_ORDER = {"cpu": ("multi_layer",), "accelerator": ("backward", "forward", "multi_layer")}


# The code of torch's per-class step wrapper: a subclass whose step() calls super().step() runs
# two of them, and only the outer one is the user's step.
_STEP_WRAPPER_CODE = torch.optim.Optimizer.profile_hook_step(lambda *a: None).__code__


def _outer_step_running(opt):
    """True when an enclosing step() of ``opt`` is still running (we are a nested call)."""
    frame, seen = sys._getframe(2), 0
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER_CODE and frame.f_locals.get("self") is opt:
            seen += 1
            if seen == 2:
                return True
        frame = frame.f_back
    return False


def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


class OptimizerController:
    def __init__(self, runtime, opt):
        self.runtime = runtime
        policy = self.policy = runtime.policy
        self.ref = weakref.ref(opt)
        self.qualname = qualified_name(type(opt))
        self.mode = "off"
        self.reason = "not stepped yet"
        self.decided = False
        self.steps = 0
        self.step_seconds = 0.0
        self.params = self._count_params(opt)
        self.strategy = None
        self.owned_storages = set()  # flat buffers built for this optimizer, by any mode
        self.chunk_bytes = None
        self.bitwise = None
        self.observation = None
        self.candidates = ()
        self.final_fusion = None
        self._depth = 0               # nesting of step() calls on this optimizer
        self._t0 = None
        self._handles = [
            opt.register_step_pre_hook(self._pre_step),
            opt.register_step_post_hook(self._post_step),
            opt.register_state_dict_pre_hook(self._flush_hook),
            opt.register_load_state_dict_pre_hook(self._flush_hook),
            opt.register_load_state_dict_post_hook(self._after_load),
        ]
        fusion = policy.fusion
        if not policy.optimizers.selects(self.qualname):
            self._settle("off", "not selected by the policy's optimizers.include/exclude")
        elif fusion.mode == "off":
            self._settle("off", "policy sets fusion.mode: off")
        elif class_matches(self.qualname, fusion.forbid):
            self._settle("off", "class matches fusion.forbid in the policy")

    @staticmethod
    def _count_params(opt):
        return sum(len(g["params"]) for g in opt.param_groups)

    def _settle(self, mode, reason):
        self.mode, self.reason, self.decided = mode, reason, True

    # -- eligibility -------------------------------------------------------------------------
    def check(self, opt, mode):
        """None when ``mode`` cannot change this optimizer's results, else the reason it might."""
        fusion = self.policy.fusion
        if why := sharded.mode_refusal(opt, mode):
            return why
        if mode in ("backward", "forward") and raw_step_of(opt) is None:
            return "its step() is not wrapped by torch's Optimizer hooks"
        if mode == "backward" and _world_size() > 1 and self._averaged_by(opt) is None:
            return (f"gradients are averaged across {_world_size()} processes, not all of them by "
                    "autopatch's allreduce (allreduce off, or left to DDP: see the allreduce "
                    "section); an update inside backward would use the local gradient")
        if class_matches(self.qualname, fusion.force) or not fusion.probe:
            return None
        for group in opt.param_groups:
            result = probe(opt, group, split=mode != "multi_layer")
            if not result.fusable:
                return result.reason
            self.bitwise = result.bitwise if self.bitwise is None else self.bitwise and result.bitwise
        return sharded.probe_refusal(opt, self.bitwise)

    def _averaged_by(self, opt):
        """Across processes, backward fusion updates a chunk once autopatch's allreduce has
        averaged its gradients: the DDP takeover, when it averages all of this optimizer's."""
        comm = self.runtime.comm
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        return comm if comm is not None and comm.averages(params) else None

    def _probe_note(self):
        if self.policy.fusion.compile:
            return ("multi_layer steps run through torch.compile: equal to per-tensor updates within "
                    "float rounding (the compiler may fuse arithmetic); backward/forward stay eager")
        if class_matches(self.qualname, self.policy.fusion.force) or not self.policy.fusion.probe:
            return "fused without the probe (fusion.force / fusion.probe: false)"
        if self.bitwise:
            return "the probe found fused updates bit-for-bit equal to per-tensor updates"
        return "the probe found fused updates equal to per-tensor updates within float rounding"

    def _new_strategy(self, opt, mode):
        if self.chunk_bytes is None:
            chunk = self.policy.fusion.chunk_bytes
            self.chunk_bytes = default_chunk_bytes(opt) if chunk == "auto" else chunk
        if strategy := sharded.strategy_for(opt, mode, self.chunk_bytes):
            return strategy
        if mode == "multi_layer":
            return MultiLayerStep(opt, self.chunk_bytes, owned_storages=self.owned_storages,
                                  compile=self.policy.fusion.compile)
        if mode == "forward":
            return ForwardFusion(opt, self.chunk_bytes, owned_storages=self.owned_storages)
        return BackwardFusion(opt, self.chunk_bytes, owned_storages=self.owned_storages,
                              averaged_by=self._averaged_by(opt) if _world_size() > 1 else None)

    def _activate(self, opt, mode, reason):
        """Leave the current mode (applying anything pending) and build the next one. The old
        one's buffers go with it; the params and the state stay where they lie and the next
        mode's plan adopts them in place."""
        if self.strategy is not None:
            self.strategy.deactivate()
            self.runtime.forward_fusions.discard(self)
        self.strategy = None if mode == "off" else self._new_strategy(opt, mode)
        if mode == "forward":
            self.runtime.enable_forward_fusion(self)
        elif mode == "backward":
            self.strategy.invalidate()    # arm the gradient hooks before the next backward
        self._settle(mode, reason)

    def _decide(self, opt):
        """First step: multi_layer at once; backward, forward and auto after watching the run.

        Backward and forward fusion are only right for some training loops, so even when the
        policy names one of them it is taken only once the first steps show it is safe (else
        multi_layer, with the reason); meanwhile the steps run as multi_layer.
        """
        self.decided = True   # the probe steps copies of this optimizer; never decide twice
        requested = self.policy.fusion.mode
        why = self.check(opt, "multi_layer")
        if why:
            self._settle("off", f"left unfused: {why}")
            return
        if requested == "auto":
            self.candidates = self._auto_order(opt)
        else:
            self.candidates = (requested, "multi_layer")
        if self.candidates[0] == "multi_layer":
            how = ("auto chose multi_layer, the fastest mode on CPU (fusion.auto_order); "
                   if requested == "auto" else "")
            self._activate(opt, "multi_layer", how + self._probe_note())
            return
        n = self.policy.fusion.observe_steps
        self.observation = Observation(opt, n)
        self._activate(opt, "multi_layer", f"{requested}: multi_layer while watching the first {n} steps")

    def _auto_order(self, opt):
        order = self.policy.fusion.auto_order
        if order != "auto":
            return tuple(order[:order.index("multi_layer") + 1])
        on_cpu = all(p.device.type == "cpu" for g in opt.param_groups for p in g["params"])
        return AUTO_ORDER["cpu" if on_cpu else "accelerator"]

    def _conclude(self, opt):
        """After watching: the first candidate mode that cannot change results."""
        obs, self.observation = self.observation, None
        obs.close()
        ruled_out = []
        for mode in self.candidates:
            blockers = obs.blockers(mode) if mode != "multi_layer" else []
            why = "; ".join(blockers) or self.check(opt, mode)
            if why is None:
                how = "auto chose" if self.policy.fusion.mode == "auto" else "chose"
                detail = f" ({'; '.join(ruled_out)})" if ruled_out else ""
                self._activate(opt, mode, f"{how} {mode} after watching {obs.steps} steps"
                                          f"{detail}; {self._probe_note()}")
                return
            ruled_out.append(f"not {mode}: {why}")

    # -- run-time switches (autotune) --------------------------------------------------------
    def set_mode(self, mode):
        """Switch between steps; lossless by construction. Returns the mode in effect: a mode
        the checks reject for this optimizer is refused and the current one kept."""
        opt = self.ref()
        if opt is None or mode == self.mode or guard.fell_back(self):
            return self.mode
        with guard.fallback(self, opt, f"switching to {mode}"):
            if not self.decided:
                self._decide(opt)
            if mode != "off" and self.check(opt, mode) is not None:
                return self.mode
            self._activate(opt, mode, f"switched to {mode} at run time")
        return self.mode

    def set_chunk_bytes(self, chunk_bytes):
        """Change the chunk size; flat buffers are re-planned before the next update."""
        self.chunk_bytes = int(chunk_bytes)
        if self.strategy is not None:
            self.strategy.set_chunk_bytes(chunk_bytes)

    def flush(self):
        if self.strategy is not None:
            self.strategy.flush()

    # -- hooks -------------------------------------------------------------------------------
    def _pre_step(self, opt, args, kwargs):
        if self._depth:
            if _outer_step_running(opt):
                self._depth += 1      # super().step() inside the user's step(): not a new step
                return None
            self.flush()              # the last step() raised before its post-hook could run
        self._depth = 1
        self._t0 = time.perf_counter()
        self.steps += 1
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self.observation is not None:
            self.observation.on_step(closure)
        if not self.decided:
            with guard.fallback(self, opt, "choosing the mode"):
                self._decide(opt)
        if self.strategy is None:
            return None
        replacement = guard.before_step(self, opt, closure)
        if replacement is None:
            return None
        if len(args) > 1:
            return (args[0], replacement, *args[2:]), kwargs
        return args, dict(kwargs, closure=replacement)

    def _post_step(self, opt, args, kwargs):
        self._depth -= 1
        if self._depth > 0:
            return
        if self.strategy is not None:
            guard.after_step(self, opt)
        if self.observation is not None:
            if self.observation.done:
                with guard.fallback(self, opt, "choosing the mode"):
                    self._conclude(opt)
            else:
                self.observation.on_step_end()
        if self._t0 is not None:
            self.step_seconds += time.perf_counter() - self._t0
            self._t0 = None
        for listener in self.runtime.step_listeners:
            listener(self)

    def _flush_hook(self, opt, *args):
        with guard.fallback(self, opt, "flushing"):
            self.flush()    # before state_dict()/load_state_dict(): nothing pending, nothing swapped

    def _after_load(self, opt):
        if self.strategy is not None:
            with guard.fallback(self, opt, "re-planning after load_state_dict()"):
                self.strategy.invalidate()

    def release(self):
        """Apply anything pending and remove every hook; the optimizer goes on as unpatched."""
        if self.observation is not None:
            self.observation.close()
            self.observation = None
        if self.strategy is not None:
            self.strategy.deactivate()
            self.final_fusion = self.strategy.describe()
        # The report outlives disable(): keep its figures, not the optimizer and its buffers.
        self.strategy = None
        self.runtime.forward_fusions.discard(self)
        for h in self._handles:
            h.remove()
        self._handles = []

    def describe(self):
        opt = self.ref()
        if opt is not None:
            self.params = self._count_params(opt)
        out = {"class": self.qualname, "mode": self.mode, "reason": self.reason,
               "params": self.params, "steps": self.steps,
               "step_seconds": round(self.step_seconds, 6)}
        if self.bitwise is not None:
            out["bitwise"] = self.bitwise
        if self.strategy is not None:
            out["fusion"] = self.strategy.describe()
        elif self.final_fusion is not None:
            out["fusion"] = self.final_fusion
        return out
