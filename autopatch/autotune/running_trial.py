"""The trial now running: its windows, which side each one measures, and its score at the end.

A trial is ``windows`` windows of ``per_window`` iterations, each after ``SETTLE`` iteration(s)
that are not timed (re-planning buffers after a switch is a one-off cost, not the config's speed).
From the second trial on, windows alternate between the candidate and the incumbent (the best
config so far), so both see the same load from other jobs.
"""

import statistics
import time

from ..reporting.step_timer import Window
from . import score

SETTLE = 1


class RunningTrial:
    def __init__(self, decision, start, modes):
        self.trial = decision["trial"]
        self.config = decision["config"]
        self.incumbent = decision["incumbent"]
        self.per_window = decision["per_window"]
        self.start = start
        self.modes = modes                    # the modes that actually ran it
        self.rates = {"candidate": [], "incumbent": []}
        self.window = Window()                # the candidate's iterations, summed
        self.t0, self.started = time.perf_counter(), time.time()

    def at(self, it, acc, samples_per_step, windows):
        """Iteration ``it`` is over: close a full window from ``acc``. Returns the config the next
        window runs, when it switches sides, else None."""
        index, pos = divmod(it - self.start, SETTLE + self.per_window)
        if pos == SETTLE:
            acc.take()        # the settling iteration
        elif pos == 0:
            w = acc.take()
            side = "candidate" if index % 2 or self.incumbent is None else "incumbent"
            self.rates[side].append(score.rate(w, samples_per_step))
            if side == "candidate":
                self.window.add(w)
            if self.incumbent is not None and index < windows:
                return self.incumbent if index % 2 else self.config
        return None

    def scored(self, it, best_score, samples_per_step):
        """The record of the trial ended at ``it``: its median window throughput, scaled by how
        the incumbent ran in the same trial against its own score (``best_score``)."""
        raw = statistics.median(self.rates["candidate"])
        reference = statistics.median(self.rates["incumbent"]) if self.rates["incumbent"] else None
        value = raw * best_score / reference if reference else raw
        # step_ms is the time per step the score stands for, load-corrected like it, so the two
        # always rank trials alike; breakdown_ms is the mean the candidate's windows measured,
        # under whatever load this trial ran.
        return self.record(it, score=value, raw_score=raw, step_ms=1e3 * (samples_per_step or 1) / value,
                           incumbent_now=reference, windows=self.rates)

    def failed(self, it, why):
        return self.record(it, score=None, raw_score=None, failed=why)

    def record(self, it, **result):
        return {"trial": self.trial, "config": self.config, **result, "train_iter": it,
                "modes": self.modes, "seconds": time.perf_counter() - self.t0,
                "steps": it - self.start, "started": self.started,
                "breakdown_ms": self.window.breakdown_ms()}

    def step_seconds(self):
        """The candidate's seconds per iteration, as measured: sizes the next trial."""
        return self.window.seconds / self.window.steps
