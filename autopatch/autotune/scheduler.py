"""The search on the step clock: warm-up, timed trials, then the best config frozen.

Every decision is taken by rank 0 at an iteration all ranks know in advance, and broadcast, so
every rank switches to the same config at the same step. Switches happen between optimizer steps
through lossless switches, so the search never changes what the model learns.
- warm-up: at least ``warmup_steps`` iterations and ``warmup_seconds``; nothing changes. Its
  iterations give the first estimate of the step time.
- trials: trial 0 is the run's starting config, then bayes_opt's proposals. A trial runs one
  settling iteration (re-planning buffers after a switch is a one-off cost, not the config's
  speed), then ``windows`` windows sized so that the trial lasts about ``trial_seconds``; its score
  is the median window throughput.
- frozen: after ``max_samples`` trials (or when every config is measured) the best is applied
  for the rest of the run and saved as JSON. ``resume`` with such a file skips the search.
"""

import math
import os
import statistics
import tempfile
import time

from ..step_timer import Window
from . import score
from .knobs import RunKnobs
from .space import Space
from .sync import agree, is_decider, world_size
from .trials_log import CsvLog, load_best, save_best

SETTLE = 1
BEST_NAME = "autotune_best.json"


class Autotuner:
    def __init__(self, runtime, timer, board):
        self.runtime, self.timer, self.board = runtime, timer, board
        self.cfg = cfg = runtime.policy.autotune
        self.phase = "warmup"
        self.until = max(1, cfg.warmup_steps)
        self.knobs = self.space = self.tuner = self.csv = None
        self.left_out, self.notes = {}, []
        self.trials, self.best, self.current = [], None, None
        self.applied = []            # [iteration, config] on this rank, in order
        self.samples_per_step = None
        self.decision_seconds = 0.0
        self.started = self.search_started = self.search_ended = None
        self.best_path = None
        self.resume_config = self._load_resume()
        self._acc = timer.accumulator()
        self._windows = []
        self._step_time = None       # seconds per iteration, last measured: sizes the next trial
        timer.listeners.append(self._tick)
        runtime.sections["autotune"] = self.describe

    def _load_resume(self):
        path = self.cfg.resume
        if not path:
            return None
        if not os.path.exists(path):
            self.notes.append(f"resume file {path} does not exist yet: searching, the best goes there")
            return None
        try:
            return load_best(path)
        except (OSError, ValueError) as e:
            self.notes.append(f"resume ignored, searching instead: {e}")
            return None

    # -- the clock ---------------------------------------------------------------------------
    def _tick(self, timer):
        if self.phase == "frozen":
            return
        it = timer.iteration
        if self.started is None:
            self.started = time.perf_counter()
        if self.phase == "trial" and self.current is not None:
            self._measure(it)
        if it < self.until:
            return
        t0 = time.perf_counter()
        decision = self._decide(it) if is_decider() else None
        self._follow(agree(decision), it)
        self.decision_seconds += time.perf_counter() - t0

    def _measure(self, it):
        """Rank 0: close a window when one is full; the settling iteration is dropped."""
        since = it - self.current["start"]
        if since == SETTLE:
            self._acc.take()
        elif since > SETTLE and (since - SETTLE) % self.current["per_window"] == 0:
            w = self._acc.take()
            self.current["window"].add(w)
            self._windows.append(score.rate(w, self.samples_per_step))

    # -- rank 0 decides -----------------------------------------------------------------------
    def _decide(self, it):
        if self.phase == "warmup":
            left = self.cfg.warmup_seconds - (time.perf_counter() - self.started)
            if left > 0:
                return {"phase": "warmup", "until": it + max(1, math.ceil(left / self._step_seconds()))}
            return self._begin(it)
        return self._end_trial(it)

    def _step_seconds(self):
        if self._step_time is None:
            w = self._acc.window   # still warming up
            return w.seconds / w.steps if w.steps else 0.01
        return self._step_time

    def _begin(self, it):
        self.search_started = time.perf_counter()
        self.knobs = RunKnobs(self.runtime)
        bounds, self.left_out = self.knobs.bounds()
        if self.resume_config is not None:
            config = {k: v for k, v in self.resume_config.items() if k in bounds}
            for k in set(self.resume_config) - set(config):
                self.notes.append(f"resumed knob {k} does not apply to this run: left as is")
            return {"phase": "frozen", "config": config, "resumed": self.cfg.resume}
        if not bounds:
            self.notes.append("no knob applies to this run: nothing to tune")
            return {"phase": "frozen", "config": {}}
        self.space = Space(bounds)
        try:
            from .tuner import BayesTuner
            self.tuner = BayesTuner(self.space)
        except ImportError as e:
            self.notes.append(f"autotune needs bayesian-optimization (pip install 'autopatch[autotune]'): {e}")
            return {"phase": "frozen", "config": {}}
        batch = self.cfg.batch_size or score.detect_batch_size()
        self.samples_per_step = batch * world_size() if batch else None
        if self.cfg.log_csv:
            self.csv = CsvLog(self.cfg.log_csv, self.space.names)
        if self.board is not None:
            self.board.samples_per_step = self.samples_per_step
            self.board.space(bounds, score.unit(self.samples_per_step))
        self._step_time = self._step_seconds()
        return self._trial(0, self.knobs.current(bounds), it)

    def _trial(self, index, config, it):
        windows = self.cfg.windows
        per_window = max(1, round(self.cfg.trial_seconds / windows / self._step_seconds()))
        return {"phase": "trial", "trial": index, "config": config, "per_window": per_window,
                "until": it + SETTLE + windows * per_window}

    def _end_trial(self, it):
        cur, w = self.current, self.current["window"]
        rec = {"trial": cur["trial"], "config": cur["config"], "score": statistics.median(self._windows),
               "train_iter": it, "windows": self._windows, "modes": cur["modes"],
               "seconds": time.perf_counter() - cur["t0"], "steps": it - cur["start"],
               "started": cur["started"], "breakdown_ms": w.breakdown_ms()}
        self.trials.append(rec)
        self.tuner.register(rec["config"], rec["score"])
        if self.best is None or rec["score"] > self.best["score"]:
            self.best = rec
        if self.csv:
            self.csv.add(rec["config"], rec["score"], it)
        if self.board is not None:
            self.board.trial_done(rec)
        self._step_time = w.seconds / w.steps
        nxt = self.tuner.suggest() if len(self.trials) < self.cfg.max_samples else None
        if nxt is None:
            return {"phase": "frozen", "config": self.best["config"], "trial": self.best["trial"]}
        return self._trial(len(self.trials), nxt, it)

    # -- every rank follows -------------------------------------------------------------------
    def _follow(self, decision, it):
        self.phase, self.until = decision["phase"], decision.get("until")
        if self.phase == "warmup":
            return
        if self.knobs is None:
            self.knobs = RunKnobs(self.runtime)
        if not self.knobs.applied:
            self.knobs.current(decision["config"])
        if self.board is not None:
            self.board.flush_window()   # no scalar window straddles a switch
        modes = self.knobs.apply(decision["config"])
        self.applied.append([it, decision["config"]])
        if self.phase == "trial":
            self.current = {"trial": decision["trial"], "config": decision["config"], "start": it,
                            "per_window": decision["per_window"], "modes": modes, "t0": time.perf_counter(),
                            "started": time.time(), "window": Window()}
            self._acc.take()
            self._windows = []
            if self.board is not None:
                self.board.trial = decision["trial"]
        else:
            self._freeze(decision)

    def _freeze(self, decision):
        self.search_ended = time.perf_counter()
        self.current = None
        self.timer.listeners.remove(self._tick)
        if self.board is not None:
            self.board.trial = None
        if not is_decider() or decision["config"] == {}:
            return
        rec = {"config": decision["config"], "trial": decision.get("trial"),
               "score": self.best["score"] if self.best else None, "unit": score.unit(self.samples_per_step),
               "improvement": self._improvement(), "resumed": decision.get("resumed"),
               "trials": len(self.trials), "policy": self.runtime.policy.source}
        if not decision.get("resumed"):
            self.best_path = self._best_path()
            save_best(self.best_path, rec)
        if self.board is not None:
            self.board.frozen({**rec, "best_json": self.best_path})

    def _best_path(self):
        cfg, logdir = self.cfg, self.runtime.policy.logging.tensorboard_dir
        return (cfg.save_best or cfg.resume or (os.path.join(logdir, BEST_NAME) if logdir else None)
                or os.path.join(tempfile.gettempdir(), "autopatch_" + BEST_NAME))

    def _improvement(self):
        if not self.trials or not self.trials[0]["score"]:
            return None
        return self.best["score"] / self.trials[0]["score"] - 1

    # -- the report -------------------------------------------------------------------------
    def _cost(self):
        """What the search cost: its wall time, the time spent deciding and switching, and the
        time lost against having run the best config from the start."""
        if self.search_started is None or not self.best:
            return None
        best_step = (self.samples_per_step or 1) / self.best["score"]
        end = self.search_ended or time.perf_counter()
        return {"search_seconds": round(end - self.search_started, 4),
                "decision_seconds": round(self.decision_seconds, 4),
                "lost_seconds": round(sum(max(0.0, t["seconds"] - t["steps"] * best_step) for t in self.trials), 4)}

    def describe(self):
        out = {"active": True, "phase": self.phase, "rank_decides": 0, "applied": self.applied,
               "left_out": self.left_out, "notes": self.notes}
        if self.space is not None:
            out.update(knobs=self.space.names, space_size=len(self.space.grid()),
                       unit=score.unit(self.samples_per_step))
        if self.trials:
            out["trials"] = [{k: t[k] for k in ("trial", "config", "score", "train_iter", "modes")}
                             for t in self.trials]
            out["best"] = {k: self.best[k] for k in ("trial", "config", "score")}
            out["improvement_over_start"] = self._improvement()
            out["cost"] = self._cost()
        out["log_csv"] = self.csv.path if self.csv else None
        out["best_json"] = self.best_path
        out["resumed_from"] = self.cfg.resume if self.resume_config is not None else None
        return out
