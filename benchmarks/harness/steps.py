"""Training steps timed phase by phase, and contenders that take them side by side in one process.

A step is ``zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()``; each phase
is timed with ``clock`` (``time.perf_counter``; ``time.thread_time`` leaves out time spent
waiting for a core on a shared machine).
"""

import time
from collections import namedtuple

from .workloads import square_loss


class Phases(namedtuple("Phases", "zero_grad forward backward step")):
    """Seconds of one step's phases; forward includes the loss."""

    @property
    def total(self):
        return sum(self)


def train_step(model, opt, batch, loss_fn, clock=time.perf_counter, step=None):
    x, y = batch
    t0 = clock()
    opt.zero_grad()
    t1 = clock()
    loss = loss_fn(model(x), y)
    t2 = clock()
    loss.backward()
    t3 = clock()
    (step or opt.step)()
    t4 = clock()
    return Phases(t1 - t0, t2 - t1, t3 - t2, t4 - t3)


class Contender:
    """A copy of the model with an optimizer of its own, trained on a fixed batch; ``step``
    replaces ``opt.step`` (a compiled one), ``handle`` is autopatch's for ``opt``, if adopted."""

    def __init__(self, name, model, opt, batch, loss_fn=square_loss, step=None, handle=None):
        self.name, self.model, self.opt, self.batch, self.loss_fn = name, model, opt, batch, loss_fn
        self.step, self.handle = step or opt.step, handle
        self.steps = 0
        self.rounds = []          # per recorded run() call: its steps' Phases

    def run(self, steps, record=True):
        got = [train_step(self.model, self.opt, self.batch, self.loss_fn, step=self.step) for _ in range(steps)]
        self.steps += steps
        if record:
            self.rounds.append(got)
        return got

    def records(self):
        return [s for r in self.rounds for s in r]
