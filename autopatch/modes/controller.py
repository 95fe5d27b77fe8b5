"""One optimizer under autopatch: its public handle, composing the rooms that run it.

``interception`` catches its steps, ``eligibility`` says which modes may run it and why not,
``chooser`` decides the mode at step boundaries, ``active`` holds the strategy of the mode in
effect. The controller only passes decisions from the chooser to the active mode, and is what
``autopatch.session().optimizers`` hands out: the mode and its reason, lossless switches
(``set_mode``, ``set_chunk_bytes``), the report entry.
"""

import time
import weakref

from ..policy import check_setting
from ..running_totals import TOTALS
from ..vocabulary import BACKWARD, OFF, WATCHED_MODES
from . import guard
from .active import ActiveMode
from .chooser import ModeChooser
from .eligibility import Eligibility
from .interception import StepInterception
from .step_override import StepOverride

LET_GO = "autopatch was disabled"
FREED = "the optimizer was freed"
CHOOSING = "choosing the mode"


def qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


class OptimizerController:
    def __init__(self, opt, policy, events, forward_reads, comm):
        """``events``: where steps beginning and ending, switches and auto's measurements are
        announced to observers; ``forward_reads``: mode forward's patches; ``comm``: what this
        optimizer may ask of the communication side, and tell it (runtime/comm_view.py)."""
        self.ref = weakref.ref(opt)
        self.qualname = qualified_name(type(opt))
        self.events = events
        self._announce_step_begins = events.emitter("step_begins")
        self._announce_step = events.emitter("step")
        self.comm = comm
        self.override = None          # the StepOverride of the step under way
        self.overridden = {}          # who took steps over -> how many
        self.choosing_seconds = 0.0   # inside step(): choosing, probing, switching (autopatch's own work)
        self.params = self._count_params(opt)
        self.step_mode = OFF          # the mode that ran the last step (a switch may follow it)
        self.eligibility = Eligibility(self.qualname, policy.fusion, comm)
        self.chooser = ModeChooser(self.qualname, policy, self.eligibility)
        self.active = ActiveMode(self.qualname, policy.fusion.chunk_bytes, forward_reads,
                                 self.eligibility.averager, route_of=lambda: self.chooser.route,
                                 on_switch=lambda: events.emit("switch", self),
                                 on_fall_back=lambda: self.chooser.stop("autopatch fell back"),
                                 shard_of=lambda: self.chooser.shard)
        self.freed = False            # the optimizer was garbage-collected; its report stays
        self.interception = StepInterception(opt, self)
        self._apply(opt, self.chooser.before_any_step())
        weakref.finalize(opt, self._optimizer_freed)

    @staticmethod
    def _count_params(opt):
        return sum(len(g["params"]) for g in opt.param_groups)

    # -- the handle ---------------------------------------------------------------------------------
    optimizer = property(lambda self: self.ref(), doc="The optimizer, or None once it was freed.")
    mode = property(lambda self: self.active.mode)
    reason = property(lambda self: self.active.reason)
    fusable = property(lambda self: self.eligibility.fusable, doc="The probe accepted its class.")
    blocked = property(lambda self: dict(self.eligibility.blocked), doc="mode -> why the run rules it out")
    choosing = property(lambda self: self.chooser.choosing, doc="Still watching or measuring.")
    steps = property(lambda self: self.interception.steps)
    chunk_bytes = property(lambda self: self.active.chunk_bytes_in_use(self.ref()),
                           doc="The chunk size its fused steps use (after backward's cap and the memory bound).")
    step_seconds = property(lambda self: self.interception.step_seconds)

    def why_not(self, mode):
        """None when this run may use ``mode`` now, else why not."""
        opt = self.ref()
        return "the optimizer was freed" if opt is None else self.chooser.why_not(opt, mode)

    def set_mode(self, mode):
        """Switch between steps; lossless by construction. Returns the mode in effect: a mode
        this run showed it cannot use, or the checks reject, is refused and the current one kept."""
        opt = self.ref()
        if opt is None or mode == self.mode or self.active.fallen:
            return self.mode
        with guard.fallback(self.active, opt, f"switching to {mode}"):
            if not self.chooser.decided:
                self._apply(opt, self.chooser.step_begins(opt, None, self.steps, self.mode))
            if mode != OFF and (mode in self.eligibility.blocked or self.eligibility.check(opt, mode)
                                or self.chooser.why_not_sharded(mode)):
                return self.mode
            self.chooser.switched_by_autotune()
            self.active.activate(opt, mode, f"switched to {mode} at run time")
        return self.mode

    def set_chunk_bytes(self, chunk_bytes):
        """A byte count ``fusion.chunk_bytes`` takes (``4 << 20``, ``"4MiB"``); ValueError else."""
        self.active.set_chunk_bytes(check_setting("fusion.chunk_bytes", chunk_bytes))

    def flush(self):
        self.active.flush()

    def _optimizer_freed(self):
        """The optimizer is gone: nothing more is decided, and nothing of its is kept but the report."""
        self.chooser.stop(FREED)
        self.active.forget()
        self.freed = True

    def shares_parameters(self, other):
        """Another optimizer (``other``, its qualified name) was adopted over some of this one's
        parameters: an update inside backward or deferred to the next forward would no longer be
        this optimizer's to make, so both modes are left now and ruled out."""
        opt = self.ref()
        if opt is None:
            return
        what = f"its parameters are shared with another optimizer ({other})"
        with guard.fallback(self.active, opt, "leaving a mode"):
            self._apply(opt, self.chooser.incident(WATCHED_MODES, what, self.steps, self.mode))

    def release(self):
        """Apply anything pending and remove every hook; the optimizer goes on as unpatched."""
        self.chooser.stop(LET_GO)
        self.active.release()
        self.interception.remove()

    def leave(self, reason):
        """Stop fusing this optimizer's steps for good (the report says why), but go on hearing of
        them: the communication side still runs around each step (``fuse_optimizer``'s
        ``fuse_step`` steps it through ``step()``, and with_bagua's algorithm must see those)."""
        opt = self.ref()
        self.chooser.stop(reason)
        with guard.fallback(self.active, opt, "leaving the optimizer to its own fused step"):
            self.active.release(reason)

    def describe(self):
        opt = self.ref()
        if opt is not None:
            self.params = self._count_params(opt)
        out = {"class": self.qualname, "mode": self.mode, "reason": self.reason,
               "params": self.params, "steps": self.steps, "step_seconds": round(self.step_seconds, 6)}
        if self.eligibility.bitwise is not None:
            out["bitwise"] = self.eligibility.bitwise
        if self.chooser.route is not None:
            out["route"] = self.chooser.route.describe()
        fusion = self.active.describe()
        if fusion is not None:
            out["fusion"] = fusion
        if self.chooser.fusion.shard:
            out["shard"] = (fusion or {}).get("shard") or {"active": False, "reason": self.chooser.shard_refusal}
        if self.overridden:
            out["steps_taken_over"] = dict(self.overridden)
        if self.freed:
            out["freed"] = True
        out.update(self.chooser.describe())
        return out

    # -- from the interception ------------------------------------------------------------------------
    def _apply(self, opt, decision):
        if decision is None:
            return
        if decision.mode == self.mode:
            self.active.explain(decision.reason)
        else:
            self.active.activate(opt, decision.mode, decision.reason, decision.strict)
        if decision.measured is not None:
            self.events.emit("auto", self, decision.measured)

    # Every step runs these: the rooms are read directly (``self.active.mode``, not the ``mode``
    # property), and a boundary where the chooser decides nothing applies nothing.
    def step_begins(self, opt, closure):
        self.comm.before_step(opt)
        self._announce_step_begins(self)
        active = self.active
        self._choose(opt, self.chooser.step_begins, closure, self.interception.steps, active.mode)
        self.step_mode = active.mode
        if active.strategy is not None:
            return active.before_step(opt, closure)
        owner = self.comm.step_owner(opt)
        if owner is None:
            return None
        self.overridden[owner.name] = self.overridden.get(owner.name, 0) + 1
        self.override = StepOverride(opt, owner)
        return self.override.before_step(closure)

    def _end_override(self):
        if self.override is not None:
            self.override.after_step()
            self.override = None

    def step_ends(self, opt):
        if self.override is not None:
            self._end_override()
        active = self.active
        if active.strategy is not None:
            unsafe, differs = active.after_step(opt)
            if unsafe:
                self._apply(opt, self.chooser.incident((BACKWARD,), unsafe, self.steps, self.mode, differs))
        self._choose(opt, self.chooser.step_ends, self.interception.steps, active.mode)

    def _choose(self, opt, decide, *args):
        """Apply what the chooser decides at a step boundary; its time is autopatch's own, and a
        failure in it falls back (guard.py)."""
        t0 = time.perf_counter()
        try:
            decision = decide(opt, *args)
            if decision is not None:
                self._apply(opt, decision)
        except Exception as error:
            if not guard.absorbed(self.active, opt, CHOOSING, error):
                raise
        seconds = time.perf_counter() - t0
        self.choosing_seconds += seconds
        TOTALS.choosing += seconds

    def step_counted(self, opt):
        self.comm.after_step(opt)
        self._announce_step(self)

    def step_abandoned(self):
        self._end_override()
        self.flush()

    def state_io(self, opt):
        with guard.fallback(self.active, opt, "flushing"):
            self.flush()    # before state_dict()/load_state_dict(): nothing pending, nothing swapped

    def state_reading(self, opt):
        """``state_dict()`` begins: flushed, and inside a step the user's params lists shown."""
        self.state_io(opt)
        self.active.show_user_lists()

    def state_read(self, opt, state_dict):
        """``state_dict()`` ended: the lists hidden again, and its result completed where the
        strategy holds state elsewhere (sharded state gathered; None: return it as it is)."""
        self.active.hide_user_lists()
        return self.active.packed_state(state_dict)

    def state_loaded(self, opt):
        self.active.invalidate(opt)
        self.chooser.changed("an optimizer state was loaded", self.steps)
