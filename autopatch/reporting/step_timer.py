"""Training iterations timed on the step clock, for TensorBoard and the autotuner.

An iteration ends when the *clock optimizer* (the first one to step) steps; a job that steps
several optimizers per iteration is timed once per iteration. Each iteration's wall time is split
into forward (first to last module forward), optimizer (the controllers' own step timings),
communication wait (when the bucketed allreduce reports one), backward (the rest between the last
forward and the end of the step, loss included) and other (data loading, logging, zero_grad).
Forward is seen through torch's global module hooks, installed only when a breakdown is wanted.
The timer listens to the session's ``step`` event; its own listeners (the TensorBoard writer, the
autotuner) hear of each finished iteration.
"""

import sys
import time
from dataclasses import dataclass, fields

from ..listeners import Listeners


@dataclass
class Window:
    """Sums over a run of iterations; ``None`` forward/backward when no module forward was seen."""
    steps: int = 0
    seconds: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    comm: float = 0.0
    seen_forward: bool = False

    def add(self, other):
        for f in fields(self):
            if f.name != "seen_forward":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.seen_forward |= other.seen_forward

    def breakdown_ms(self):
        """Mean milliseconds per iteration, by part (communication only when some was waited for)."""
        if not self.steps:
            return {}
        ms = lambda s: round(1e3 * s / self.steps, 4)
        out = {"step": ms(self.seconds), "optimizer": ms(self.optimizer)}
        if self.comm:
            out["comm"] = ms(self.comm)
        if self.seen_forward:
            out.update(forward=ms(self.forward), backward=ms(self.backward),
                       other=ms(max(0.0, self.seconds - self.forward - self.backward - self.optimizer - self.comm)))
        else:
            out["compute"] = ms(max(0.0, self.seconds - self.optimizer - self.comm))
        return out


class Accumulator:
    """One consumer's running window; ``take()`` hands it over and starts a new one."""

    def __init__(self):
        self.window = Window()

    def take(self):
        w, self.window = self.window, Window()
        return w


class StepTimer:
    def __init__(self, session, breakdown):
        self.session = session
        self.clock = None
        self.iteration = 0
        self._listeners = Listeners()   # fn(timer), called after each iteration
        self.listener_seconds = 0.0
        self._accumulators = []
        self._last_tick = None
        self._optimizer_total = 0.0
        self._comm_total = 0.0
        self._fwd_start = self._fwd_end = None
        self._hooks = []
        self._want_breakdown = breakdown
        self._subscription = session.subscribe("step", self._on_step)

    @property
    def clock_mode(self):
        """The mode that ran the clock optimizer's last step, or None before it stepped."""
        return None if self.clock is None else self.clock.step_mode

    def subscribe(self, fn):
        """Call ``fn(timer)`` after each iteration; returns a handle with ``remove()``."""
        return self._listeners.subscribe(fn)

    def accumulator(self):
        acc = Accumulator()
        self._accumulators.append(acc)
        return acc

    def _forward_pre(self, module, args):
        if self._fwd_start is None:
            self._fwd_start = time.perf_counter()

    def _forward_post(self, module, args, output):
        self._fwd_end = time.perf_counter()

    def _totals(self):
        optimizer = sum(o.step_seconds for o in self.session.optimizers)
        comm = self.session.allreduce
        return optimizer, 0.0 if comm is None else comm.wait_seconds

    def _on_step(self, ctrl):
        if self.clock is None:
            self.clock = ctrl
            if self._want_breakdown:   # torch is surely imported now; it may not be at enable()
                modules = sys.modules["torch.nn.modules.module"]
                self._hooks = [modules.register_module_forward_pre_hook(self._forward_pre),
                               modules.register_module_forward_hook(self._forward_post)]
        if ctrl is not self.clock:
            return
        now = time.perf_counter()
        optimizer, comm = self._totals()
        if self._last_tick is not None:
            w = Window(steps=1, seconds=now - self._last_tick, optimizer=optimizer - self._optimizer_total,
                       comm=comm - self._comm_total)
            if self._fwd_start is not None and self._fwd_end is not None and self._fwd_start >= self._last_tick:
                w.seen_forward = True
                w.forward = self._fwd_end - self._fwd_start
                w.backward = max(0.0, now - self._fwd_end - w.optimizer - w.comm)
            for acc in self._accumulators:
                acc.window.add(w)
        self._optimizer_total, self._comm_total = optimizer, comm
        self._fwd_start = self._fwd_end = None
        self.iteration += 1
        self._listeners(self)
        # Time spent by the listeners (switching, logging) is the tuner's cost, not the next step's.
        self._last_tick = time.perf_counter()
        self.listener_seconds += self._last_tick - now
        self._optimizer_total, self._comm_total = self._totals()

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._subscription.remove()
