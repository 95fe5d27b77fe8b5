"""One optimizer under autopatch: its hooks, its mode and the reason for it, its step clock.

Interception uses the optimizer's own per-instance step hooks. ``Optimizer.step`` is wrapped once
per class by torch itself, and LR schedulers or wrappers such as accelerate's call through that
wrapper, so these hooks see every step however it is reached (closures included).
"""

import fnmatch
import time
import weakref

from .fusion.chunking import default_chunk_bytes
from .fusion.multi_layer import MultiLayerStep
from .fusion.probe import probe

UNAVAILABLE = ("backward", "forward")


def qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(qualname, globs):
    short = qualname.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(qualname, g) or fnmatch.fnmatchcase(short, g) for g in globs)


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
        self.fused = None
        self.parked = None      # a MultiLayerStep kept while switched off, to resume losslessly
        self.probe = None
        self._t0 = None
        self._handles = [
            opt.register_step_pre_hook(self._pre_step),
            opt.register_step_post_hook(self._post_step),
            opt.register_state_dict_pre_hook(self._before_state_dict),
            opt.register_load_state_dict_post_hook(self._after_load),
        ]
        fusion = policy.fusion
        if not policy.optimizers.selects(self.qualname):
            self._settle("off", "not selected by the policy's optimizers.include/exclude")
        elif fusion.mode == "off":
            self._settle("off", "policy sets fusion.mode: off")
        elif fusion.mode in UNAVAILABLE:
            self._settle("off", f"mode '{fusion.mode}' is not available in this version; running unfused")
        elif _matches(self.qualname, fusion.forbid):
            self._settle("off", "class matches fusion.forbid in the policy")

    @staticmethod
    def _count_params(opt):
        return sum(len(g["params"]) for g in opt.param_groups)

    def _settle(self, mode, reason):
        self.mode, self.reason, self.decided = mode, reason, True

    def _decide(self, opt):
        """First step: choose multi_layer when every group passes the probe (or is forced)."""
        fusion = self.policy.fusion
        self.decided = True   # the probe steps a copy; never decide twice
        if _matches(self.qualname, fusion.force) or not fusion.probe:
            why = "fused without the probe (fusion.force / fusion.probe: false)"
        else:
            for group in opt.param_groups:
                result = probe(opt, group)
                self.probe = result
                if not result.fusable:
                    self._settle("off", f"left unfused: {result.reason}")
                    return
            why = self.probe.reason
        chunk = fusion.chunk_bytes
        self.fused = MultiLayerStep(opt, default_chunk_bytes(opt) if chunk == "auto" else chunk)
        prefix = "auto chose multi_layer, the fastest mode available; " if fusion.mode == "auto" else ""
        self._settle("multi_layer", prefix + why)

    def set_mode(self, mode):
        """Switch between steps (the autotuner does this); lossless by construction.

        Returns the mode in effect: a class the probe rejected stays ``off``.
        """
        opt = self.ref()
        if opt is None:
            return self.mode
        if not self.decided:
            self._decide(opt)
        if mode == self.mode:
            return self.mode
        if mode == "off":
            if self.fused is not None:
                self.fused.restore()
                self.parked = self.fused
                self.fused = None
            self._settle("off", "switched off at run time")
        elif mode == "multi_layer" and (self.fused is not None or self.parked is not None):
            self.fused, self.parked = self.fused or self.parked, None
            self.fused.invalidate()   # per-parameter state moved on while unfused
            self._settle("multi_layer", "switched to multi_layer at run time")
        return self.mode

    def set_chunk_bytes(self, chunk_bytes):
        """Change the chunk size; the flat buffers are re-planned before the next step."""
        for step in (self.fused, self.parked):
            if step is not None:
                step.chunk_bytes = int(chunk_bytes)
                step.invalidate()

    def _pre_step(self, opt, args, kwargs):
        self._t0 = time.perf_counter()
        self.steps += 1
        if not self.decided:
            self._decide(opt)
        if self.fused is None:
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            self.fused.swap_in()
            return None
        fused = self.fused

        def closure_then_fuse():
            # The closure computes the grads; fuse once they exist, before the update runs.
            loss = closure()
            fused.swap_in()
            return loss
        if len(args) > 1:
            return (args[0], closure_then_fuse, *args[2:]), kwargs
        return args, dict(kwargs, closure=closure_then_fuse)

    def _post_step(self, opt, args, kwargs):
        if self.fused is not None:
            self.fused.restore()
        if self._t0 is not None:
            self.step_seconds += time.perf_counter() - self._t0
            self._t0 = None
        for listener in self.runtime.step_listeners:
            listener(self)

    def _before_state_dict(self, opt):
        if self.fused is not None:
            self.fused.restore()   # a step that raised may have left chunks swapped in

    def _after_load(self, opt):
        if self.fused is not None:
            self.fused.invalidate()

    def release(self):
        """Remove every hook; the optimizer goes on exactly as an unpatched one."""
        if self.fused is not None:
            self.fused.restore()
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
        if self.probe is not None:
            out["bitwise"] = self.probe.bitwise
        if self.fused is not None:
            out["fusion"] = self.fused.describe()
        return out
