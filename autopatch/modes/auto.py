"""Mode auto for one optimizer: the modes it may choose, the measurements among them, and what
they found, for the controller's reasons and the report.

The mode chooser starts a measurement once the watch is over, and again when the run changes (a
param group added, a state loaded, a mode found unsafe), and calls ``boundary()`` after every step
while one runs. The measuring itself is ``race.py``; this module turns policy knobs into its plain
arguments and its results into words and figures.
"""

from ..vocabulary import AUTO, FUSION_MODES, OFF
from .race import ModeRace, clock_for

MAX_MEASUREMENTS = 4    # per optimizer: the first one and up to three after changes in the run


def candidates(fusion):
    """The fused modes auto may choose (``fusion.auto_candidates``); ``off`` always competes."""
    chosen = fusion.auto_candidates
    return FUSION_MODES if chosen == AUTO else tuple(m for m in FUSION_MODES if m in chosen)


def ms(value):
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


class AutoMode:
    def __init__(self, fusion):
        self.candidates = candidates(fusion)
        self.measure_steps = fusion.measure_steps
        self.race = None
        self.result = None        # the last finished measurement: the race's figures
        self.ruled_out = {}       # mode -> why auto may not use it, as of the last measurement
        self.history = []         # one entry per measurement: when, why, its cost and choice

    @property
    def can_measure(self):
        return len(self.history) < MAX_MEASUREMENTS

    def start(self, allowed, ruled_out, why, step, device, agree=None, current=OFF):
        """Race ``off`` and ``allowed`` (``current``, the mode running now, first); returns the
        mode to run first, or None when there is nothing to measure (``result`` then says off,
        and why)."""
        self.ruled_out = dict(ruled_out)
        self.race = None
        if not allowed:
            self.result = {"chosen": OFF, "why": "no fused mode is allowed for this run"}
            return None
        self.history.append({"step": step, "why": why, "modes": [OFF, *allowed]})
        self.race = ModeRace([OFF, *allowed], self.measure_steps, clock_for(device), agree, first=current)
        return self.race.mode

    def boundary(self):
        """After a step while measuring: the mode for the next step (the choice once made)."""
        mode = self.race.boundary()
        if self.race.result is not None:
            start = self.history[-1]["step"]     # race steps count from the step after it
            self.result = dict(self.race.result, decided_at_step=start + self.race.result["steps"])
            self.result["dropped"] = {m: dict(d, step=start + d["step"]) for m, d in self.result["dropped"].items()}
            self.history[-1].update(steps=self.result["steps"], seconds=self.result["seconds"],
                                    chosen=self.result["chosen"], ran=self.result["ran"],
                                    dropped=self.result["dropped"])
            self.race = None
        return mode

    def abandon(self, why):
        """Measuring failed: off, and why (measuring must never break the run)."""
        self.race = None
        self.result = {"chosen": OFF, "why": f"measuring failed ({why})"}
        if self.history:
            self.history[-1].update(chosen=OFF, failed=why)

    def measuring_reason(self):
        r = self.race
        return (f"auto: racing {', '.join(r.alive)} in rounds of {r.window} timed steps each, dropping "
                f"what the rounds show slower beyond the noise (at most {r.max_steps} steps; "
                f"{self.history[-1]['why']})")

    def reason(self):
        r = self.result
        out = f"auto chose {r['chosen']}"
        if "ms_per_step" not in r:
            out += f": {r['why']}"
        else:
            times = r["ms_per_step"]
            others = ", ".join(f"{m} {ms(t)}" for m, t in times.items() if m not in (OFF, r["chosen"]))
            if r["chosen"] == OFF:
                out += (f": no mode was faster than unpatched beyond the measured noise ({others} vs "
                        f"{ms(times[OFF])} ms/step unpatched)")
            else:
                out += (f": {ms(times[r['chosen']])} ms/step vs {ms(times[OFF])} unpatched "
                        f"({r['speedup_vs_off']:.2f}x)" + (f"; also measured {others}" if others else ""))
            out += f" (decided after {r['steps']} steps of measuring)"
        if self.ruled_out:
            out += "; " + "; ".join(f"not {m}: {why}" for m, why in self.ruled_out.items())
        return out

    def describe(self):
        out = {"candidates": [OFF, *self.candidates], "ruled_out": dict(self.ruled_out),
               "measuring": self.race is not None, "measure_steps_limit": self.measure_steps,
               "measurements": [dict(h) for h in self.history]}
        if self.result is not None:
            out.update((k, v) for k, v in self.result.items() if k not in ("steps", "seconds"))
        out["measure_steps"], out["measure_seconds"] = self.spent()
        return out

    def spent(self):
        """(steps, seconds) spent measuring over the whole run, finished measurements only."""
        done = [h for h in self.history if "steps" in h]
        return sum(h["steps"] for h in done), round(sum(h["seconds"] for h in done), 4)
