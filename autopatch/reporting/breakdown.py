"""Where each training step's time goes, in every enabled run: the report's ``breakdown`` section.

Each iteration the step timer finishes is split into parts (``PARTS``): waiting for the next
batch, forward, backward, the optimizer step, waiting on communication (the exposed waits of
autopatch's gradient sync; DDP's own reducer syncs inside backward, where its time stays), and
autopatch's own work that it can see: choosing, probing and switching modes inside ``step()``, and
between steps the step timer and its listeners (TensorBoard, the autotuner). Its hooks' own
calls (a few per step) are not timed: they stay in the part they ran in. Per
iteration this adds a few additions and, for the medians, one row in a reservoir of at most
``RESERVOIR`` iterations sampled evenly over the run (Li's Algorithm L: it draws how many rows to
skip before the next one kept, so an iteration not kept costs a comparison, not a random draw;
with a random generator of its own: the program's ``random`` is left alone).
"""

import math
import random
import statistics

PARTS = ("data", "forward", "backward", "optimizer", "comm", "autopatch", "other")
RESERVOIR = 1024
COMM_SEEN = ("the waits of autopatch's gradient sync that nothing overlapped; under DDP's own reducer "
             "the sync runs inside backward and is counted there")


class Breakdown:
    def __init__(self, timer, session):
        self.session = session
        self.steps = 0
        self.unseen_backward = 0        # iterations with no backward seen: forward and backward in other
        self._sums = [0.0] * (len(PARTS) + 1)
        self._rows = [None] * RESERVOIR
        self._random = random.Random(0)
        self._weight = math.exp(math.log(self._uniform()) / RESERVOIR)
        self._next_kept = RESERVOIR + self._skip()     # the index of the next row kept once full
        timer.subscribe(self._add)

    def _uniform(self):
        """A draw from the open interval (0, 1)."""
        u = 0.0
        while u == 0.0:
            u = self._random.random()
        return u

    def _skip(self):
        return math.floor(math.log(self._uniform()) / math.log(1.0 - self._weight))

    def _add(self, timer):
        w = timer.last
        if w is None:
            return
        if not w.seen_forward:
            self.unseen_backward += 1
        other = max(0.0, w.seconds - w.data - w.forward - w.backward - w.optimizer - w.comm - w.choosing)
        row = (w.seconds + w.own, w.data, w.forward, w.backward, w.optimizer, w.comm, w.own + w.choosing, other)
        sums = self._sums
        for i, v in enumerate(row):
            sums[i] += v
        n = self.steps
        self.steps = n + 1
        if n < RESERVOIR:
            self._rows[n] = row
        elif n == self._next_kept:
            self._rows[self._random.randrange(RESERVOIR)] = row
            self._weight *= math.exp(math.log(self._uniform()) / RESERVOIR)
            self._next_kept = n + 1 + self._skip()

    def describe(self):
        if not self.steps:
            return {"steps": 0, "reason": "no training iteration was timed yet (the clock optimizer "
                                          "must step twice)"}
        rows = self._rows[:min(self.steps, RESERVOIR)]
        total = self._sums[0] or 1e-12
        share = {p: round(s / total, 4) for p, s in zip(PARTS, self._sums[1:])}
        out = {"steps": self.steps,
               "median_step_ms": round(1e3 * statistics.median(r[0] for r in rows), 4),
               "mean_step_ms": round(1e3 * self._sums[0] / self.steps, 4),
               "share": share,
               "median_ms": {p: round(1e3 * statistics.median(r[i + 1] for r in rows), 4)
                             for i, p in enumerate(PARTS)},
               "largest": max(share, key=share.get),
               "comm_counted": COMM_SEEN,
               "gradient_bytes": self._gradient_bytes()}
        if self.unseen_backward:
            out["unseen_backward_steps"] = self.unseen_backward
        waits = self.session.data_waits
        if waits is not None:
            out["data"] = waits.describe()
        return out

    def _gradient_bytes(self):
        """Bytes of the gradients the optimizers update (the memory backward fusion frees early)."""
        seen, n = set(), 0
        for ctrl in self.session.optimizers:
            opt = ctrl.optimizer
            for g in [] if opt is None else opt.param_groups:
                for p in g["params"]:
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        n += p.numel() * p.element_size()
        return n
