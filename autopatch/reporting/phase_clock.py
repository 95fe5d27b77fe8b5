"""Forward and backward seconds of each training iteration, seen at a few points per iteration.

- forward begins at the first module call after the last backward (or the last step): a global
  forward pre-hook that removes itself when it fires, so every other module call takes torch's
  hook-free path; it is armed again when a backward ends and at each step;
- forward ends, and backward begins, when ``torch.autograd.backward`` is called (``loss.backward()``
  calls it); backward ends when it returns. Only the outermost call counts (a reentrant checkpoint
  calls it again inside backward);
- time counted elsewhere is taken out where it happened: batches waited for inside a forward span
  (an evaluation loop between two backwards), collectives waited for inside backward (autopatch's
  allreduce finishes there), and everything measured inside an optimizer's ``step()`` (a closure
  runs forward and backward there), so that the optimizer's share is its own.

``counters()`` gives the running totals ``(communication wait, data wait)`` in seconds.
"""

import functools
import sys
import time

from ..patching import Ledger


class PhaseClock:
    def __init__(self, counters):
        self._counters = counters
        self.forward = 0.0      # this iteration's seconds, until take()
        self.backward = 0.0
        self.in_steps = 0.0     # seconds measured here or by counters() inside a step()
        self.backwards = 0
        self._forward_start = None
        self._data_at_start = 0.0
        self._step_start = None
        self._depth = 0
        self._hook = None
        self._begin = self._forward_begins    # one bound method: the same hook object each time
        self._modules = sys.modules["torch.nn.modules.module"]
        self._ledger = Ledger()
        autograd = sys.modules["torch.autograd"]
        self._ledger.replace(autograd, "backward", self._timed(vars(autograd)["backward"]))
        self._arm()

    def _arm(self):
        if self._hook is None:
            self._hook = self._modules.register_module_forward_pre_hook(self._begin)

    def _forward_begins(self, module, args):
        self._hook.remove()
        self._hook = None
        self._forward_start = time.perf_counter()
        self._data_at_start = self._counters()[1]

    def _timed(self, backward):
        @functools.wraps(backward)
        def timed_backward(*args, **kwargs):
            if self._depth:
                return backward(*args, **kwargs)
            t0 = time.perf_counter()
            comm0, data0 = self._counters()
            if self._forward_start is not None:
                self.forward += max(0.0, t0 - self._forward_start - (data0 - self._data_at_start))
                self._forward_start = None
            self._depth = 1
            try:
                return backward(*args, **kwargs)
            finally:
                self._depth = 0
                self.backward += max(0.0, time.perf_counter() - t0 - (self._counters()[0] - comm0))
                self.backwards += 1
                self._arm()
        return timed_backward

    def step_begins(self):
        if self._step_start is None:
            comm, data = self._counters()
            self._step_start = (comm + data, self.forward + self.backward)

    def step_ends(self):
        if self._step_start is not None:
            counted, spans = self._step_start
            comm, data = self._counters()
            self.in_steps += (comm + data - counted) + (self.forward + self.backward - spans)
            self._step_start = None

    def take(self):
        """This iteration's (forward, backward, seconds inside steps, backward calls); starts the next.
        A forward still open (no backward followed it) is dropped: its time stays in 'other'."""
        out = (self.forward, self.backward, self.in_steps, self.backwards)
        self.forward = self.backward = self.in_steps = 0.0
        self.backwards = 0
        self._forward_start = None
        self._arm()
        return out

    def close(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._ledger.uninstall()
