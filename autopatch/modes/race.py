"""Mode auto's measurement: which fusion mode trains this run fastest, timed on the run itself.

The candidate modes, ``off`` (unpatched) first, take turns in rounds. In each round every
candidate runs one settling step, not timed (the first step after a switch re-plans flat buffers,
a one-off cost), then a window of timed steps; the order rotates from round to round. Load from
other work comes and goes over seconds, so a candidate is judged by its ratio to ``off`` within
each round, which that load mostly cancels out of, and by the median of those ratios.

What is timed is the whole training iteration, from the end of one ``step()`` of the optimizer
to the end of the next: backward and forward fusion move the update out of ``step()`` into
backward or the next forward, so only the whole iteration compares modes fairly.

``off`` stays unless a mode is faster beyond the noise: its median ratio to ``off`` is at least
``MIN_GAIN`` below 1, and even its upper-quartile round was faster than ``off``. Among such modes
the lowest median ratio wins.

On CUDA, step boundaries are CUDA events recorded on the training stream and read only once
``query()`` says they completed, so measuring never waits for the device; the decision waits a
few steps for the last events instead (``grace``).

The schedule depends on step counts only, so every process of a multi-process run walks it in
step; the decision goes through ``agree`` (rank 0's decision on every rank), so all switch to
the chosen mode at the same step.
"""

import statistics
import time

import torch

WINDOW = 5        # timed steps per candidate per round, at most
SETTLE = 1        # steps after a switch that are not timed
MIN_ROUNDS = 3    # windows are shortened (down to one step) to fit this many rounds in the budget
MIN_GAIN = 0.01   # a mode must beat off by at least this much at the median


class WallClock:
    name = "wall clock"
    grace = 0     # steps a decision may wait for the last timings

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end):
        return end - start


class CudaEventClock:
    """Events on the device's current stream, read only once complete: timing never syncs."""
    name = "CUDA events"
    grace = 4

    def __init__(self, device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end):
        if not (start.query() and end.query()):
            return None
        return start.elapsed_time(end) / 1e3


def clock_for(device):
    return CudaEventClock(device) if device.type == "cuda" else WallClock()


def _upper_quartile(values):
    return statistics.quantiles(values, n=4, method="inclusive")[2] if len(values) > 1 else values[0]


def verdict(modes, rounds):
    """The chosen mode and its figures, from ``rounds``: per round, mode -> seconds per step."""
    ms = {m: 1e3 * statistics.median(r[m] for r in rounds) for m in modes}
    ratios = {m: statistics.median(r[m] / r["off"] for r in rounds) for m in modes}
    faster = [m for m in modes if m != "off" and ratios[m] <= 1 - MIN_GAIN
              and _upper_quartile([r[m] / r["off"] for r in rounds]) < 1]
    chosen = min(faster, key=ratios.get) if faster else "off"
    return {"chosen": chosen, "ms_per_step": {m: round(v, 4) for m, v in ms.items()},
            "ratio_vs_off": {m: round(v, 4) for m, v in ratios.items()},
            "speedup_vs_off": round(ms["off"] / ms[chosen], 4), "rounds": len(rounds)}


class ModeRace:
    """Walks the schedule one step boundary at a time; ``result`` is set once decided."""

    def __init__(self, modes, max_steps, clock, agree=None):
        """``modes``: the candidates, ``off`` among them; ``max_steps``: the most steps, settling
        ones and the wait for timings included, before a decision; ``agree``: rank 0's decision
        on every rank (identity in one process)."""
        self.modes = ["off"] + [m for m in modes if m != "off"]
        self.clock = clock
        self.agree = agree or (lambda decision: decision)
        self.max_steps = max_steps
        n = len(self.modes)
        usable = max(max_steps - clock.grace, n * (SETTLE + 1))
        self.window = max(1, min(WINDOW, usable // (MIN_ROUNDS * n) - SETTLE))
        self.rounds = max(1, usable // (n * (SETTLE + self.window)))
        self.schedule = [self.modes[(r + i) % n] for r in range(self.rounds) for i in range(n)]
        self.steps = 0
        self.started = time.perf_counter()
        self.windows = []          # (round, mode, start mark, end mark)
        self.result = None
        self._segment = 0          # index into the schedule
        self._in_segment = 0       # boundaries seen since the segment began
        self._start = None

    @property
    def mode(self):
        """The mode the next step runs."""
        if self.result is not None:
            return self.result["chosen"]
        return self.schedule[min(self._segment, len(self.schedule) - 1)]

    def boundary(self):
        """Call at the end of every step(), after the step's own work; returns ``mode``."""
        self.steps += 1
        if self._segment < len(self.schedule):
            self._in_segment += 1
            if self._in_segment == SETTLE:
                self._start = self.clock.mark()
            elif self._in_segment == SETTLE + self.window:
                self.windows.append((self._segment // len(self.modes), self.schedule[self._segment],
                                     self._start, self.clock.mark()))
                self._segment += 1
                self._in_segment = 0
            if self._segment < len(self.schedule):
                return self.mode
        decision = self.agree(self._decide())
        if decision is not None:
            self.result = decision
        return self.mode

    def _decide(self):
        """The decision once every window's timing is in (or the budget is spent), else None."""
        per_round, pending = {}, False
        for rnd, mode, start, end in self.windows:
            seconds = self.clock.seconds(start, end)
            if seconds is None:
                pending = True
            else:
                per_round.setdefault(rnd, {})[mode] = seconds / self.window
        if pending and self.steps < self.max_steps:
            return None
        rounds = [r for r in per_round.values() if len(r) == len(self.modes)]
        if rounds:
            out = verdict(self.modes, rounds)
        else:
            out = {"chosen": "off", "rounds": 0,
                   "why": "no round of timings completed within the measuring budget"}
        return dict(out, window_steps=self.window, steps=self.steps, clock=self.clock.name,
                    seconds=round(time.perf_counter() - self.started, 4))
