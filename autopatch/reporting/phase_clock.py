"""Forward and backward seconds of each training iteration, seen at a few points per iteration.

- forward runs from the end of the last backward or step (or its start, for a closure's forward;
  after the step that ends an iteration, from when the step timer's listeners are done) to the
  next call of
  ``torch.autograd.backward`` (``loss.backward()`` calls it), less the batches waited for in
  between: the model's forward, the loss, and what the loop does before them (``zero_grad``,
  moving the batch to its device). No module hook is needed for it, so module calls keep torch's
  hook-free path and nothing of autopatch's stays in torch's global hooks between steps;
- backward runs from that call until it returns. Only the outermost call counts (a reentrant
  checkpoint calls it again inside backward);
- time counted elsewhere is taken out where it happened: collectives waited for inside backward
  (autopatch's allreduce finishes there), and everything measured inside an optimizer's ``step()``
  (a closure runs forward and backward there), so that the optimizer's share is its own.

The waits come from the process's running totals (running_totals.py).
"""

import functools
import time

from ..patches.autograd import AutogradBackwardPatch
from ..running_totals import TOTALS


class PhaseClock:
    def __init__(self):
        self.forward = 0.0      # this iteration's seconds, until take()
        self.backward = 0.0
        self.in_steps = 0.0     # seconds measured here or waited (comm, data) inside a step()
        self.backwards = 0
        self._forward_start = None
        self._data_at_start = 0.0
        self._step_start = None
        self._depth = 0
        self._patch = AutogradBackwardPatch()
        self._patch.install(self._timed)
        self._forward_begins()

    def _forward_begins(self):
        self._forward_start = time.perf_counter()
        self._data_at_start = TOTALS.data

    def _timed(self, backward):
        @functools.wraps(backward)
        def timed_backward(*args, **kwargs):
            if self._depth:
                return backward(*args, **kwargs)
            t0 = time.perf_counter()
            comm0 = TOTALS.comm
            self.forward += max(0.0, t0 - self._forward_start - (TOTALS.data - self._data_at_start))
            self._depth = 1
            try:
                return backward(*args, **kwargs)
            finally:
                self._depth = 0
                self.backward += max(0.0, time.perf_counter() - t0 - (TOTALS.comm - comm0))
                self.backwards += 1
                self._forward_begins()
        return timed_backward

    def step_begins(self, _optimizer=None):
        """An optimizer's step() begins (the session's ``step_begins`` event, which names it)."""
        if self._step_start is None:
            self._step_start = (TOTALS.comm + TOTALS.data, self.forward + self.backward)
            self._forward_begins()     # a closure's forward starts inside the step

    def step_ends(self):
        if self._step_start is not None:
            counted, spans = self._step_start
            self.in_steps += (TOTALS.comm + TOTALS.data - counted) + (self.forward + self.backward - spans)
            self._step_start = None
        self._forward_begins()

    def iteration_begins(self):
        """The step timer's listeners have run after the step: the next forward starts now, their
        time being autopatch's own (counted apart, outside the iteration)."""
        self._forward_begins()

    def take(self):
        """This iteration's (forward, backward, seconds inside steps, backward calls); starts the
        next, whose forward ``step_ends()`` (called just before, at the step) began.
        A forward still open (no backward followed it) stays in 'other'."""
        out = (self.forward, self.backward, self.in_steps, self.backwards)
        self.forward = self.backward = self.in_steps = 0.0
        self.backwards = 0
        return out

    def close(self):
        self._patch.uninstall()
