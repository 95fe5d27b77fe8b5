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
from .auto_mode import AutoMode
from .fusion.backward import BackwardFusion
from .fusion.chunk_step import raw_step_of
from .fusion.chunking import default_chunk_bytes
from .fusion.forward import ForwardFusion
from .fusion.multi_layer import MultiLayerStep
from .fusion.probe import probe
from .fusion.rounding import choose as choose_route
from .observe import CLOSURE, Observation
from .policy import class_matches

FUSION_MODES = ("multi_layer", "backward", "forward")
WATCHED_MODES = ("backward", "forward")    # right for some loops only: the watch says which


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
        self.step_mode = "off"        # the mode that ran the last step (a switch may follow it)
        self.reason = "not stepped yet"
        self.decided = False
        self.fusable = False          # the probe accepted it: its mode may change at run time
        self.chosen_by = None         # who set the mode in effect: "policy", "auto" or "autotune"
        self.steps = 0
        self.step_seconds = 0.0
        self.params = self._count_params(opt)
        self.strategy = None
        self.owned_storages = set()  # flat buffers built for this optimizer, by any mode
        self.chunk_bytes = None
        self.bitwise = None
        self.route = None             # how fused chunks are stepped (fusion/rounding.py)
        self.observation = None
        self.watched = False          # the first steps were watched: ``blocked`` is known
        self.blocked = {}             # mode -> what this run does that the mode would get wrong
        self.auto = AutoMode(policy.fusion) if policy.fusion.mode == "auto" else None
        self.incidents = []           # modes left mid-run because the run stopped suiting them
        self.final_fusion = None
        self._groups = None           # param groups at the last step: one more means a re-plan
        self._remeasure = None        # why mode auto measures again at the next step boundary
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
        if why := sharded.mode_refusal(opt, mode):
            return why
        fusion = self.policy.fusion
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

    def why_not(self, opt, mode):
        """None when this run may use ``mode`` now, else why not: what the watch or the run
        showed, or what the check found."""
        if mode == "off":
            return None
        if not self.fusable:
            return "this optimizer is not fused"
        if mode in self.blocked:
            return self.blocked[mode]
        if mode in WATCHED_MODES and not self.watched:
            return "the first steps were not watched"
        return self.check(opt, mode)

    def _autotune_modes(self):
        """The modes autotune may switch this optimizer to, when it tunes the mode."""
        tune = self.policy.autotune
        return set(tune.bounds_of("mode")) if tune.enabled and "mode" in tune.knobs else set()

    def _auto_measures(self):
        """Mode auto measures, unless autotune searches the mode itself."""
        return self.auto is not None and not self._autotune_modes()

    @property
    def choosing(self):
        """True while the mode is still being chosen: watching, measuring, or about to measure."""
        return (self.observation is not None or self._remeasure is not None
                or (self.auto is not None and self.auto.race is not None))

    def _averaged_by(self, opt):
        """Across processes, backward fusion updates a chunk once autopatch's allreduce has
        averaged its gradients: the DDP takeover, when it averages all of this optimizer's."""
        comm = self.runtime.comm
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        return comm if comm is not None and comm.averages(params) else None

    def _probe_note(self):
        if self.policy.fusion.exact == "rounding":
            return self.route.note()
        if class_matches(self.qualname, self.policy.fusion.force) or not self.policy.fusion.probe:
            return "fused without the probe (fusion.force / fusion.probe: false)"
        if self.bitwise:
            return "the probe found fused updates bit-for-bit equal to per-tensor updates"
        return "the probe found fused updates equal to per-tensor updates within float rounding"

    def _new_strategy(self, opt, mode, strict):
        if self.chunk_bytes is None:
            chunk = self.policy.fusion.chunk_bytes
            self.chunk_bytes = default_chunk_bytes(opt) if chunk == "auto" else chunk
        if strategy := sharded.strategy_for(opt, mode, self.chunk_bytes):
            return strategy
        if mode == "multi_layer":
            return MultiLayerStep(opt, self.chunk_bytes, owned_storages=self.owned_storages,
                                  route=self.route)
        if mode == "forward":
            return ForwardFusion(opt, self.chunk_bytes, owned_storages=self.owned_storages, route=self.route)
        return BackwardFusion(opt, self.chunk_bytes, owned_storages=self.owned_storages,
                              averaged_by=self._averaged_by(opt) if _world_size() > 1 else None,
                              strict=strict, route=self.route)

    def _activate(self, opt, mode, reason, strict=False):
        """Leave the current mode (applying anything pending) and build the next one. The old
        one's buffers go with it; the params and the state stay where they lie and the next
        mode's plan adopts them in place. ``strict``: backward fusion raises on accumulation
        (the user named the mode) instead of stepping the rest unfused and saying so."""
        if self.strategy is not None:
            self.strategy.deactivate()
            self.runtime.disable_forward_fusion(self)
        self.strategy = None if mode == "off" else self._new_strategy(opt, mode, strict)
        if mode == "forward":
            self.runtime.enable_forward_fusion(self)
        elif mode == "backward":
            self.strategy.invalidate()    # arm the gradient hooks before the next backward
        self._settle(mode, reason)
        for listener in self.runtime.switch_listeners:
            listener(self)

    def _switch(self, opt, mode, reason):
        if mode == self.mode:
            self.reason = reason
        else:
            self._activate(opt, mode, reason)

    # -- choosing the mode --------------------------------------------------------------------
    def _decide(self, opt):
        """First step: what runs while the mode is chosen.

        Backward and forward fusion are right for some training loops only, so neither runs
        before the first steps have been watched: a policy naming one of them gets multi_layer
        meanwhile, mode auto runs unpatched until it has watched and measured.
        """
        self.decided = True   # the probe steps copies of this optimizer; never decide twice
        self._groups = len(opt.param_groups)
        requested = self.policy.fusion.mode
        why = self.check(opt, "multi_layer")
        if why:
            self._settle("off", f"left unfused: {why}")
            return
        self.fusable = True
        fusion = self.policy.fusion
        self.route = choose_route(opt, fusion.exact, fusion.max_deviation, fusion.compile_budget_seconds)
        self.chosen_by = "auto" if self.auto else "policy"
        wanted = set(self.auto.candidates if self.auto else (requested,)) | self._autotune_modes()
        if wanted & set(WATCHED_MODES):
            n = self.policy.fusion.observe_steps
            self.observation = Observation(opt, n)
            if self.auto:
                self._activate(opt, "off", f"auto: unpatched while watching the first {n} steps")
            elif requested in WATCHED_MODES:
                self._activate(opt, "multi_layer", f"{requested}: multi_layer while watching the first {n} steps")
            else:
                self._activate(opt, "multi_layer", self._probe_note())
            return
        if self.auto:
            self._auto_begin(opt, "from the first step")
        else:
            self._activate(opt, "multi_layer", self._probe_note())

    def _conclude(self, opt):
        """After watching: rule out what the run showed; a named mode is taken if allowed (else
        multi_layer), mode auto starts measuring."""
        obs, self.observation = self.observation, None
        obs.close()
        self.watched = True
        for mode in WATCHED_MODES:
            if obs.blockers(mode):
                self.blocked.setdefault(mode, "; ".join(obs.blockers(mode)))
        requested = self.policy.fusion.mode
        if self.auto:
            self._auto_begin(opt, f"after watching {obs.steps} steps")
            return
        if requested not in WATCHED_MODES:
            return                        # multi_layer named: the watch was for autotune
        ruled_out = []
        for mode in (requested, "multi_layer"):
            why = self.why_not(opt, mode)
            if why is None:
                detail = f" ({'; '.join(ruled_out)})" if ruled_out else ""
                reason = f"chose {mode} after watching {obs.steps} steps{detail}; {self._probe_note()}"
                if mode == self.mode:
                    self.reason = reason
                else:
                    self._activate(opt, mode, reason, strict=True)
                return
            ruled_out.append(f"not {mode}: {why}")

    def _auto_begin(self, opt, why):
        if self._auto_measures():
            self._measure(opt, why)
        else:
            self._switch(opt, "off", "auto: autotune chooses the mode (autotune.knobs has mode), "
                                     f"among those the run allows; unpatched until then ({why})")

    def _measure(self, opt, why):
        """Measure off and every mode auto may still use (every process agrees on which)."""
        self._remeasure = None
        self.chosen_by = "auto"
        if not self.auto.can_measure:
            keep = self.mode if self.why_not(opt, self.mode) is None else "off"
            self._switch(opt, keep, f"auto kept {keep}: it has measured {len(self.auto.history)} "
                                    f"times in this run already ({why})")
            return
        allowed, ruled_out = [], {}
        for mode in self.auto.candidates:
            reason = self.why_not(opt, mode)
            if reason:
                ruled_out[mode] = reason
            else:
                allowed.append(mode)
        agree = None
        if _world_size() > 1:
            from .autotune import sync
            everywhere = sync.gather(allowed)
            for mode in [m for m in allowed if not all(m in other for other in everywhere)]:
                allowed.remove(mode)
                ruled_out[mode] = "ruled out in another process"
            agree = sync.agree
        device = next((p.device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
        first = self.auto.start(allowed, ruled_out, why, self.steps, device, agree)
        if first is None:
            self._switch(opt, "off", self.auto.reason())
        else:
            self._switch(opt, first, self.auto.measuring_reason())

    def _measure_step(self, opt):
        """A step boundary while measuring: switch as the schedule says, or to the choice."""
        try:
            mode = self.auto.boundary()
        except Exception as e:         # measuring must never break the run: unpatched instead
            self.auto.abandon(f"{type(e).__name__}: {e}")
            self._switch(opt, "off", self.auto.reason())
            return
        if self.auto.race is not None:
            if mode != self.mode:
                self._activate(opt, mode, self.auto.measuring_reason())
            return
        self._switch(opt, mode, self.auto.reason() + ("" if mode == "off" else "; " + self._probe_note()))
        for listener in self.runtime.auto_listeners:
            listener(self, self.auto.describe())

    # -- the run changing under a mode ----------------------------------------------------------
    def _watch_run(self, opt, closure):
        """At each step() after the watch: what would make a mode wrong, or a measurement stale."""
        if closure is not None and not all(m in self.blocked for m in WATCHED_MODES):
            self._incident(opt, WATCHED_MODES, CLOSURE)
        if len(opt.param_groups) != self._groups:
            self._groups = len(opt.param_groups)
            self._changed("a param group was added")

    def _changed(self, why):
        """The run changed (a re-plan): mode auto measures again at the next step boundary."""
        if self._auto_measures() and self.decided and self.fusable and self.observation is None:
            self._remeasure = f"{why} at step {self.steps}"

    def _incident(self, opt, modes, what, differs=False):
        """The run just did something ``modes`` would get wrong: rule them out and, if one of
        them runs, leave it now (before a closure runs, or after a step: nothing is lost)."""
        new = [m for m in modes if m not in self.blocked]
        for m in new:
            self.blocked[m] = what
        running = self.mode if self.mode in modes else None
        race = self.auto.race if self.auto is not None else None
        if self._auto_measures() and (running or (race is not None and set(new) & set(race.modes))):
            self._remeasure = f"{what} at step {self.steps}"
        if running is None:
            return
        safe = "multi_layer" if self.chosen_by == "policy" else "off"
        self.incidents.append({"step": self.steps, "left": running, "for": safe, "what": what,
                               "chosen_by": self.chosen_by, "update_differs": differs})
        if differs and sum(i["update_differs"] for i in self.incidents) == 1:
            print(f"autopatch: {self.qualname}: {what} at step {self.steps} while mode {running} "
                  f"(chosen by {self.chosen_by}) ran: this step's update differs from unpatched, as "
                  f"part of it was already applied inside backward; switched to {safe}",
                  file=sys.stderr)
        then = {"auto": "measuring again", "autotune": "autotune goes on without it"}.get(self.chosen_by)
        self._activate(opt, safe, f"left {running} for {safe} at step {self.steps}: {what}"
                                  + (f"; {then}" if then else ""))

    # -- run-time switches (autotune) --------------------------------------------------------
    def set_mode(self, mode):
        """Switch between steps; lossless by construction. Returns the mode in effect: a mode
        this run showed it cannot use, or the checks reject, is refused and the current one kept."""
        opt = self.ref()
        if opt is None or mode == self.mode or guard.fell_back(self):
            return self.mode
        with guard.fallback(self, opt, f"switching to {mode}"):
            if not self.decided:
                self._decide(opt)
            if mode != "off" and (mode in self.blocked or self.check(opt, mode) is not None):
                return self.mode
            self.chosen_by = "autotune"
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
        with guard.fallback(self, opt, "choosing the mode"):
            if not self.decided:
                self._decide(opt)
            elif self.observation is None and self.fusable:
                self._watch_run(opt, closure)
        self.step_mode = self.mode
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
            unsafe = getattr(self.strategy, "unsafe", None)   # backward fusion, not strict
            differs = bool(unsafe) and bool(self.strategy.stepped)
            guard.after_step(self, opt)
            if unsafe:
                self._incident(opt, ("backward",), unsafe, differs)
        with guard.fallback(self, opt, "choosing the mode"):
            if self.observation is not None:
                if self.observation.done:
                    self._conclude(opt)
                else:
                    self.observation.on_step_end()
            elif self._remeasure is not None:
                self._measure(opt, self._remeasure)
            elif self.auto is not None and self.auto.race is not None:
                self._measure_step(opt)
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
        self._changed("an optimizer state was loaded")

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
        self.runtime.disable_forward_fusion(self)
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
        if self.route is not None:
            out["route"] = self.route.describe()
        if self.strategy is not None:
            out["fusion"] = self.strategy.describe()
        elif self.final_fusion is not None:
            out["fusion"] = self.final_fusion
        if self.auto is not None and self.fusable:
            out["auto"] = self.auto.describe()
        if self.incidents:
            out["incidents"] = list(self.incidents)
        return out
