"""Mode auto's measurement: which fusion mode trains this run fastest, timed on the run itself, as
a race that ends as soon as the answer is clear.

The candidates (``off``, unpatched, among them) take turns in rounds. In each round every candidate
still in the race runs one settling step, not timed (the first step after a switch re-plans flat
buffers: a one-off cost, counted as measuring), then ``WINDOW`` timed step(s); the order rotates
from round to round. The first round starts with the mode already running, then the cheapest switches:
``multi_layer`` plans the flat buffers, which ``backward`` and ``forward`` then adopt where they lie.

What is timed is the whole training iteration, from the end of one ``step()`` of the optimizer to
the end of the next: backward and forward fusion move the update out of ``step()``.

After each round from the second on, the log step times of the race are fitted as a mode effect
plus a round effect (load from other work comes and goes over seconds: the round effect takes it
out) by median polish, and the residuals' spread, never taken below ``NOISE_FLOOR``, is the
measured noise (``Standings``). A difference counts only beyond a Student-t confidence half-width
of it (``h``). Then:

- a candidate is dropped once it is slower than off, or not faster than off by ``MIN_GAIN``,
  beyond the noise, or slower than the leader beyond the noise;
- off is dropped once the leader is faster than it by ``MIN_GAIN`` beyond the noise; from then
  on, a candidate that could beat the leader by no more than ``TIE`` even at the edge of the noise
  is dropped too (the difference is not worth more measuring), and after ``ENDGAME`` more rounds
  the leader is taken: every mode left beats unpatched, and on a noisy machine telling them apart
  could take the whole budget;
- the race ends when one mode is left, or when the budget (``max_steps``) cannot fit another round:
  then off stays unless the leader beats it by ``MIN_GAIN`` beyond the noise;
- the leader is ``multi_layer`` wherever ``backward`` or ``forward`` leads it by no more than the
  noise (``_preferred``).

So off stays unless a mode is faster beyond the noise, a clearly slower mode is dropped after two
rounds, and a clear winner is chosen after two rounds.

On CUDA, step boundaries are CUDA events recorded on the training stream and read only once
``query()`` says they completed, so measuring never waits for the device: a round whose timings
are not in yet is judged later, and at the end the decision waits a few steps (``grace``).

The schedule depends on step counts and on decisions only, and every decision goes through
``agree`` (rank 0's decision on every rank), so every process of a multi-process run walks the
same schedule and switches at the same step.
"""

import math
import statistics
import time

import torch

from ..vocabulary import MULTI_LAYER, OFF

WINDOW = 1          # timed steps per candidate per round: on a noisy machine, more rounds of one
                    # timed step decide sooner than fewer, longer ones (benchmarks/bench_auto.py)
SETTLE = 1          # steps after a switch that are not timed
JUDGE_FROM = 2      # rounds before anything is dropped or chosen
MIN_GAIN = 0.01     # a mode must beat off by at least this much, beyond the noise
TIE = 0.05          # once off is out: candidates within this of the leader are not worth measuring
ENDGAME = 2         # once off is out: rounds left to order the modes that all beat it
NOISE_FLOOR = 0.01  # relative noise never taken as smaller than this
# Student's t, 97.5% one-sided, by degrees of freedom (beyond the table: the normal's 1.96 + 2.4/df).
_T = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
      12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04}


def t_quantile(df):
    below = [d for d in _T if d <= df]
    return _T[max(below)] if df <= 30 else 1.96 + 2.4 / df


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


class Standings:
    """Where the modes still racing stand, and how far a difference between two of them can be
    noise.

    Log step times, of every timing of the race (modes already dropped too), are fitted as a mode
    effect plus a round effect (load that comes and goes over a round is the round's) by Tukey's
    median polish, and the noise of one timed step is the median absolute size of the residuals
    the fit left free (scaled to a standard deviation): a step that an unrelated process stretched
    now and then moves neither the effects nor the noise, where means and squares would let it
    delay every decision."""

    def __init__(self, modes, table):
        k = sum(all(m in r for m in modes) for r in table)
        effect, spread, df = _median_polish(table)
        self.mean = {m: effect[m] for m in modes}
        self.noise = max(NOISE_FLOOR, spread)
        # a median-based effect has about 1.25 times a mean's standard error
        self.h = t_quantile(max(df, 1)) * 1.25 * self.noise * math.sqrt(2 / k)
        self.leader = min(self.mean, key=self.mean.get)

    def gain(self, a, b):
        """How much faster ``a`` is than ``b`` (log of b's time over a's): > 0 when ``a`` is."""
        return self.mean[b] - self.mean[a]


def _median_polish(table, sweeps=10):
    """(mode -> effect, the residuals' spread, their degrees of freedom) of log step times fitted
    as mode effect + round effect over every timing in ``table`` (rounds need not hold every mode)."""
    obs = [(i, mode, math.log(t)) for i, r in enumerate(table) for mode, t in r.items()]
    modes = {m for _, m, _ in obs}
    effect, shift = dict.fromkeys(modes, 0.0), [0.0] * len(table)
    for _ in range(sweeps):
        for i in range(len(table)):
            shift[i] = statistics.median(y - effect[m] for j, m, y in obs if j == i)
        for m in modes:
            effect[m] = statistics.median(y - shift[i] for i, mode, y in obs if mode == m)
    df = len(obs) - len(modes) - len(table) + 1
    if df < 1:
        return effect, 0.0, 0
    # The polish makes every round's and every mode's median residual zero, so up to one residual
    # per effect fitted is (about) zero by construction: in a table of a few rounds that is most of
    # them, and their median said "no noise" where steps varied by 20% (a race on 2 cores then
    # chose a mode no faster than off, one run in three). The noise is read from the df residuals
    # the fit left free: the largest df of them, their median scaled to a standard deviation.
    free = sorted((abs(y - effect[m] - shift[i]) for i, m, y in obs), reverse=True)[:df]
    return effect, 1.4826 * statistics.median(free), df


def _preferred(standings, alive):
    """The leader, or ``multi_layer`` where the leader (``backward`` or ``forward``) is not faster
    than it beyond the noise: the plain fused step keeps no hooks in backward or forward, and a
    race that cannot tell them apart takes it (backward timed within 1% of multi_layer in the
    race and 10-25% slower after it, in benchmarks/bench_auto.py's steady runs)."""
    lead = standings.leader
    if lead not in (OFF, MULTI_LAYER) and MULTI_LAYER in alive and standings.gain(lead, MULTI_LAYER) <= standings.h:
        return MULTI_LAYER
    return lead


def _log_gain(fraction):
    return -math.log(1 - fraction)


class ModeRace:
    """Walks the race one step boundary at a time; ``result`` is set once decided."""

    def __init__(self, modes, max_steps, clock, agree=None, first=None):
        """``modes``: the candidates, ``off`` among them, cheapest to try first; ``max_steps``: the
        most steps, settling ones and the wait for timings included, before a decision;
        ``agree``: rank 0's decision on every rank (identity in one process); ``first``: the mode
        running now, which starts the first round (no switch)."""
        self.modes = [OFF] + [m for m in modes if m != OFF]
        if first in self.modes:
            self.modes.remove(first)
            self.modes.insert(0, first)
        self.clock = clock
        self.agree = agree or (lambda decision: decision)
        self.max_steps = max_steps
        self.budget = max(max_steps - clock.grace, len(self.modes) * (SETTLE + WINDOW))
        self.window = WINDOW
        self.alive = list(self.modes)
        self.ran = dict.fromkeys(self.modes, 0)     # steps each mode ran, settling ones included
        self.dropped = {}                           # mode -> when and why it left the race
        self.times = {}                             # round -> {mode: seconds per step}
        self.pending = []                           # (round, mode, start mark, end mark) unread
        self.round = 0
        self.order = list(self.alive)               # this round's turns
        self.turn = 0
        self.steps = 0
        self.started = time.perf_counter()
        self.result = None
        self.off_left = None                        # the round off was dropped in
        self._in_turn = 0
        self._start = None
        self._closing = False                       # no round fits any more: waiting for timings

    @property
    def mode(self):
        """The mode the next step runs."""
        if self.result is not None:
            return self.result["chosen"]
        return self.order[min(self.turn, len(self.order) - 1)]

    def boundary(self):
        """Call at the end of every step(), after the step's own work; returns ``mode``."""
        self.steps += 1
        self.ran[self.mode] += 1
        if self._closing:
            self._decide(self.agree(self._final()))
            return self.mode
        self._in_turn += 1
        if self._in_turn == SETTLE:
            self._start = self.clock.mark()
        elif self._in_turn == SETTLE + self.window:
            self.pending.append((self.round, self.mode, self._start, self.clock.mark()))
            self.turn += 1
            self._in_turn = 0
            if self.turn == len(self.order):
                self._end_round()
        return self.mode

    def _end_round(self):
        self.round += 1
        self._decide(self.agree(self._judge()))
        if self.result is not None:
            return
        if self.steps + len(self.alive) * (SETTLE + self.window) > self.budget:
            self._closing = True
            self.turn = len(self.order) - 1         # the last mode runs on while the timings come
            self._decide(self.agree(self._final()))
            return
        shift = self.round % len(self.alive)
        self.order = self.alive[shift:] + self.alive[:shift]
        self.turn = 0

    # -- rank 0 judges; every rank follows --------------------------------------------------------
    def _read(self):
        """Move every window whose timing is in from ``pending`` into ``times``."""
        still = []
        for rnd, mode, start, end in self.pending:
            seconds = self.clock.seconds(start, end)
            if seconds is None:
                still.append((rnd, mode, start, end))
            else:
                self.times.setdefault(rnd, {})[mode] = seconds / self.window
        self.pending = still

    def _standings(self, modes):
        table = [r for _, r in sorted(self.times.items())]
        if sum(all(m in r for m in modes) for r in table) < JUDGE_FROM:
            return None
        return Standings(modes, table)

    def _judge(self):
        """After a round: the modes to drop, and the choice once one mode is left."""
        self._read()
        s = self._standings(self.alive)
        if s is None:
            return {"drop": {}}
        lead, drop, min_gain = _preferred(s, self.alive), {}, _log_gain(MIN_GAIN)
        for x in self.alive:
            if x == lead:
                continue
            if x == OFF:
                if s.gain(lead, OFF) - s.h > min_gain:
                    drop[x] = f"{lead} is faster beyond the measured noise"
            elif OFF in self.alive and s.gain(x, OFF) + s.h < min_gain:
                drop[x] = "not faster than off beyond the measured noise"
            elif s.gain(lead, x) - s.h > 0:
                drop[x] = f"slower than {lead} beyond the measured noise"
        left = [m for m in self.alive if m not in drop]
        if OFF not in left:
            endgame = self.off_left is not None and self.round - self.off_left >= ENDGAME
            for x in left:
                if x != lead and s.gain(x, lead) + s.h < _log_gain(TIE):
                    drop[x] = f"within {TIE:.0%} of {lead} even at the edge of the noise"
                elif x != lead and endgame:
                    where = "behind" if s.gain(lead, x) >= 0 else "not ahead beyond the noise of"
                    drop[x] = f"{where} {lead} after {ENDGAME} rounds without off (every mode left beats it)"
        left = [m for m in left if m not in drop]
        return self._decision(drop, left[0] if len(left) == 1 else None, s.noise)

    def _final(self):
        """The budget is spent: the leader if it beats off beyond the noise, else off; None while
        timings are still on their way (within the budget)."""
        self._read()
        if self.pending and self.steps < self.max_steps:
            return None
        s = self._standings(self.alive)
        if s is None:
            return self._decision({}, OFF, None, "no two rounds of timings completed within the measuring budget")
        lead = _preferred(s, self.alive)
        if OFF in self.alive and (lead == OFF or s.gain(lead, OFF) - s.h <= _log_gain(MIN_GAIN)):
            lead = OFF
        return self._decision({}, lead, s.noise)

    def _decision(self, drop, chosen, noise, why=None):
        """What every rank applies; a choice carries this rank's figures, so every rank reports
        rank 0's."""
        out = {"drop": drop, "chosen": chosen, "noise": noise}
        if chosen is not None:
            left = {m: {"step": self.steps, "round": self.round, "why": w} for m, w in drop.items()}
            out["figures"] = self._figures(chosen, dict(self.dropped, **left), noise, why)
        return out

    def _decide(self, decision):
        if decision is None:
            return
        for mode, why in decision["drop"].items():
            self.alive.remove(mode)
            self.dropped[mode] = {"step": self.steps, "round": self.round, "why": why}
            if mode == OFF:
                self.off_left = self.round
        if decision.get("chosen") is not None:
            self.result = decision["figures"]

    def _figures(self, chosen, dropped, noise, why=None):
        """The choice and what it rests on: per mode, its median step time and its median ratio
        to off over the rounds both ran; the steps each ran; when and why the others left."""
        ms, ratios = {}, {}
        for mode in self.modes:
            mine = [r[mode] for r in self.times.values() if mode in r]
            if mine:
                ms[mode] = round(1e3 * statistics.median(mine), 4)
            both = [r[mode] / r[OFF] for r in self.times.values() if mode in r and OFF in r]
            if both:
                ratios[mode] = round(statistics.median(both), 4)
        out = {"chosen": chosen, "rounds": self.round, "window_steps": self.window, "steps": self.steps,
               "clock": self.clock.name, "seconds": round(time.perf_counter() - self.started, 4),
               "ran": dict(self.ran), "dropped": dropped}
        if why is not None or chosen not in ms or OFF not in ms:
            out["why"] = why or "no timings of the chosen mode and of off to compare"
            return out
        out.update(ms_per_step=ms, ratio_vs_off=ratios, speedup_vs_off=round(ms[OFF] / ms[chosen], 4),
                   noise=None if noise is None else round(noise, 4))
        return out
