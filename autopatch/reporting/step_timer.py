"""Training iterations timed on the step clock, for the report's breakdown, TensorBoard and the
autotuner.

An iteration ends when the *clock optimizer* (the first one to step) steps; a job that steps
several optimizers per iteration is timed once per iteration. Each iteration's wall time is split
into data (waiting in DataLoader iterators' ``__next__``), forward and backward (``phase_clock.py``),
optimizer (the controllers' own step timings, less what ran inside them: a closure's forward and
backward, and autopatch choosing, probing and switching modes), communication wait (when autopatch's bucketed allreduce reports one) and other
(zero_grad, the loss, logging). What the timer and its listeners (switching, TensorBoard, the
autotuner) take between two iterations is counted apart, as autopatch's own (``own``): it is not
in the iteration's ``seconds``, which stay the training's alone for the autotuner's scores.
Forward and backward are seen only when a breakdown is wanted (the default). The timer listens to the session's
``step`` event; its own listeners hear of each finished iteration, ``last`` holding it.
"""

import time
from dataclasses import dataclass, fields

from ..listeners import Listeners
from ..running_totals import TOTALS


@dataclass
class Window:
    """Sums over a run of iterations; ``None`` forward/backward when no module forward was seen."""
    steps: int = 0
    seconds: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    comm: float = 0.0
    data: float = 0.0
    choosing: float = 0.0     # inside the steps: autopatch choosing, probing and switching modes
    own: float = 0.0          # between the steps: the timer and its listeners (not in ``seconds``)
    seen_forward: bool = False

    def add(self, other):
        for name in SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.seen_forward |= other.seen_forward

    def breakdown_ms(self):
        """Mean milliseconds per iteration, by part (communication only when some was waited for)."""
        if not self.steps:
            return {}
        ms = lambda s: round(1e3 * s / self.steps, 4)
        out = {"step": ms(self.seconds), "optimizer": ms(self.optimizer)}
        for part in ("comm", "data"):
            if getattr(self, part):
                out[part] = ms(getattr(self, part))
        if self.own or self.choosing:
            out["autopatch"] = ms(self.own + self.choosing)
        rest = self.seconds - self.optimizer - self.comm - self.data - self.choosing
        if self.seen_forward:
            out.update(forward=ms(self.forward), backward=ms(self.backward),
                       other=ms(max(0.0, rest - self.forward - self.backward)))
        else:
            out["compute"] = ms(max(0.0, rest))
        return out


SUMMED = tuple(f.name for f in fields(Window) if f.name != "seen_forward")


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
        self.last = None                # the last iteration's Window
        self._last_tick = None
        self._own = 0.0
        self._totals_then = self._totals()   # optimizer, choosing, communication, data seconds
        self._phases = None
        self._want_breakdown = breakdown
        self._subscriptions = [session.subscribe("step", self._on_step)]

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

    @staticmethod
    def _totals():
        t = TOTALS
        return t.optimizer, t.choosing, t.comm, t.data

    def _on_step(self, ctrl):
        if self._phases is not None:
            self._phases.step_ends()
        if self.clock is None:
            self.clock = ctrl
            if self._want_breakdown:   # torch is surely imported now; it may not be at enable()
                from .phase_clock import PhaseClock
                self._phases = PhaseClock()
                self._subscriptions.append(self.session.subscribe("step_begins", self._phases.step_begins))
        if ctrl is not self.clock:
            return
        now = time.perf_counter()
        t, then = TOTALS, self._totals_then
        optimizer, choosing, comm, data = (t.optimizer - then[0], t.choosing - then[1], t.comm - then[2],
                                           t.data - then[3])
        phases = (0.0, 0.0, 0.0, 0) if self._phases is None else self._phases.take()
        if self._last_tick is not None:
            forward, backward, in_steps, backwards = phases
            w = Window(steps=1, seconds=now - self._last_tick, optimizer=max(0.0, optimizer - choosing - in_steps),
                       comm=comm, data=data, choosing=choosing, own=self._own)
            if backwards:
                w.seen_forward = True
                w.forward, w.backward = forward, backward
            self.last = w
            for acc in self._accumulators:
                acc.window.add(w)
        self.iteration += 1
        self._listeners(self)
        # Time spent by the listeners (switching, logging) is the tuner's cost, not the next step's.
        self._last_tick = time.perf_counter()
        if self._phases is not None:
            self._phases.iteration_begins()
        self._own = self._last_tick - now
        self.listener_seconds += self._own
        self._totals_then = (t.optimizer, t.choosing, t.comm, t.data)     # _totals(), inline: every step

    def close(self):
        if self._phases is not None:
            self._phases.close()
        for subscription in self._subscriptions:
            subscription.remove()
