"""The search on the step clock: warm-up, timed trials, then the best config frozen.

Every decision is taken by rank 0 at an iteration all ranks know in advance and published through
the job's store (agreement.py: no collective, so ranks that step unevenly never hang on it), so
every rank switches to the same config at the same step. Switches happen between optimizer steps
through lossless switches, so the search never changes what the model learns.
- warm-up: at least ``warmup_steps`` iterations and ``warmup_seconds``, and until every
  optimizer has settled its mode (mode ``auto`` watches a few steps first); nothing changes. Its
  iterations give the first estimate of the step time.
- trials: trial 0 is the run's starting config, then bayes_opt's proposals. A trial is
  ``windows`` windows sized so that it lasts about ``trial_seconds``, each after one settling
  iteration (re-planning buffers after a switch is a one-off cost, not the config's speed).
  From trial 1 on, windows alternate between the candidate and the incumbent (the best config so
  far): the candidate's score is its median window throughput, scaled by how the incumbent ran in
  the same trial against its own score. Load from other jobs on a shared machine comes and goes
  over seconds; measured side by side, both configs see the same load, so scores stay comparable
  across the whole search.
- frozen: after ``max_samples`` trials (or when every config is measured) the best is applied
  for the rest of the run and saved as JSON. ``resume`` with such a file skips the search.

The mode knob offers only the modes the run allows once its first steps have been watched. A mode
the run later shows it cannot use (a closure appears, gradient accumulation starts: the controller
leaves that mode by itself) is dropped from the search: the trial running it is logged as failed,
and the best config that remains (or the starting one) runs before the next trial ("restore").
The tuner never raises into the training loop: a failure of its own stops the search and keeps
the best config so far, saying why in the report and on stderr.
"""

import math
import sys
import time

from .. import agreement, dist
from . import score
from .knobs import RunKnobs, choosing_mode
from .report_section import describe
from .space import Space
from .running_trial import SETTLE, RunningTrial
from .trials import TrialBook
from .trials_log import best_path, fit_resumed, read_resume, save_best

# The search's phases, published in every decision and shown in the report as they are.
WARMUP, TRIAL, RESTORE, FROZEN = "warmup", "trial", "restore", "frozen"


class Autotuner:
    def __init__(self, session, timer, board):
        self.session, self.timer, self.board = session, timer, board
        self.cfg = cfg = session.policy.autotune
        self.phase = WARMUP
        self.until = max(1, cfg.warmup_steps)
        self.knobs = self.space = self.tuner = None
        self.left_out, self.notes = {}, []
        self.book = TrialBook(board)
        self.current = None
        self.failure = None          # why the search stopped early, if it did
        self.applied = []            # [iteration, config] decided, as applied on this rank
        self.samples_per_step = None
        self.decision_seconds = 0.0
        self.started = self.search_started = self.search_ended = None
        self.best_path = None
        self.best_failed = None      # why the best config could not be saved, if it could not
        self.resume_config, note = read_resume(cfg.resume) if cfg.resume else (None, None)
        self.notes += [note] if note else []
        self._acc = timer.accumulator()
        self._step_time = None       # seconds per iteration, last measured: sizes the next trial
        self._ticks = timer.subscribe(self._tick)
        session.add_report_section("autotune", lambda: describe(self))

    # -- the clock ---------------------------------------------------------------------------
    def _tick(self, timer):
        if self.phase == FROZEN:
            return
        try:
            self._advance(timer.iteration)
        except Exception as e:      # never into the training loop: stop, keep the best so far
            self._stop(f"{type(e).__name__}: {e}")

    def _advance(self, it):
        if self.started is None:
            self.started = time.perf_counter()
        if self.phase in (TRIAL, RESTORE) and self.knobs is not None:
            blocked = self.knobs.newly_blocked()     # every rank sees it at the same step
            if blocked:
                self._agree_and_follow(it, lambda: self._abandon(it, blocked))
                return
        if self.phase == TRIAL and self.current is not None:
            self._window(it)
        if it < self.until:
            return
        self._agree_and_follow(it, lambda: self._decide(it))

    def _agree_and_follow(self, it, decide):
        """Rank 0 decides, every rank follows; a failure while deciding still gives every rank
        a decision: stop searching, keep the best config so far."""
        t0 = time.perf_counter()
        decision = None
        if dist.is_decider():
            try:
                decision = decide()
            except Exception as e:
                decision = self._frozen(failed=f"{type(e).__name__}: {e}")
        self._follow(agreement.agree("autotune", decision), it)
        self.decision_seconds += time.perf_counter() - t0

    def _window(self, it):
        """Close a full window (timings count on rank 0), and at the planned iterations switch
        between candidate and incumbent (every rank, from the same decision)."""
        side = self.current.at(it, self._acc, self.samples_per_step, self.cfg.windows)
        if side is not None:
            if self.board is not None:
                self.board.flush_window()
            self.knobs.apply(side)

    # -- rank 0 decides -----------------------------------------------------------------------
    def _decide(self, it):
        if self.phase == WARMUP:
            left = self.cfg.warmup_seconds - (time.perf_counter() - self.started)
            if left > 0 or choosing_mode(self.session):
                return {"phase": WARMUP, "until": it + max(1, math.ceil(left / self._step_seconds()))}
            return self._begin(it)
        if self.phase == RESTORE:
            return self._next(it)
        return self._end_trial(it)

    def _step_seconds(self):
        if self._step_time is None:
            w = self._acc.window   # still warming up
            return w.seconds / w.steps if w.steps else 0.01
        return self._step_time

    def _begin(self, it):
        self.search_started = time.perf_counter()
        self.knobs = RunKnobs(self.session)
        bounds, self.left_out = self.knobs.bounds()
        if self.knobs.ruled_out:
            self.notes.append("the mode knob leaves out " + "; ".join(
                f"{m} ({why})" for m, why in self.knobs.ruled_out.items()))
        if self.resume_config is not None:
            return {"phase": FROZEN, "config": fit_resumed(self.resume_config, bounds, self.notes),
                    "resumed": self.cfg.resume}
        if not bounds:
            self.notes.append("no knob applies to this run: nothing to tune")
            return {"phase": FROZEN, "config": {}}
        self.space = Space(bounds)
        try:
            from .tuner import BayesTuner
            self.tuner = BayesTuner(self.space)
        except ImportError as e:
            self.notes.append(f"autotune needs bayesian-optimization (pip install 'autopatch[autotune]'): {e}")
            return {"phase": FROZEN, "config": {}}
        batch = self.cfg.batch_size or score.detect_batch_size()
        self.samples_per_step = batch * dist.world_size() if batch else None
        if self.cfg.log_csv:
            self.book.log_to(self.cfg.log_csv, self.space.names)
        if self.board is not None:
            self.board.count_samples(self.samples_per_step)
            self.board.space(bounds, score.unit(self.samples_per_step))
        self._step_time = self._step_seconds()
        start = self.book.start_from(self.knobs.current(bounds))
        return self._trial(0, start, it)

    def _trial(self, index, config, it):
        windows = self.cfg.windows
        per_window = max(1, round(self.cfg.trial_seconds / windows / self._step_seconds()))
        incumbent = self.book.best["config"] if self.book.best else None
        return {"phase": TRIAL, "trial": index, "config": config, "per_window": per_window,
                "incumbent": incumbent, "until": it + windows * (SETTLE + per_window)}

    def _end_trial(self, it):
        best = self.book.best
        rec = self.current.scored(it, best["score"] if best else None, self.samples_per_step)
        self.book.add(rec)
        self.tuner.register(rec["config"], rec["score"])
        self._step_time = self.current.step_seconds()
        return self._next(it)

    def _next(self, it):
        nxt = self.tuner.suggest() if len(self.book.trials) < self.cfg.max_samples else None
        if nxt is None:
            return self._frozen()
        return self._trial(len(self.book.trials), nxt, it)

    def _frozen(self, **extra):
        """The decision to stop searching and keep the best config so far."""
        best = self.book.best
        return {"phase": FROZEN, "config": self.book.fallback(), "trial": best["trial"] if best else None,
                **extra}

    def _abandon(self, it, blocked):
        """Modes the run showed it cannot use: never proposed again; a trial running one of them
        (as candidate: it fails; as incumbent: it is dropped) ends, and the best config that
        remains runs until the next trial."""
        self.book.drop_modes(blocked)
        if self.tuner is not None:
            self.tuner.exclude("mode", set(blocked))
        cur = self.current
        restore = {"phase": RESTORE, "config": self.book.fallback(), "until": it + SETTLE + 1}
        if cur is None:
            return restore if self.phase == RESTORE else {"phase": self.phase, "until": self.until, "keep": True}
        why = "; ".join(f"{m} became unsafe: {w}" for m, w in blocked.items())
        if cur.config.get("mode") in blocked:
            self.book.add_failed(cur.failed(it, why))
            return restore
        if (cur.incumbent or {}).get("mode") in blocked:
            self.notes.append(f"trial {cur.trial} dropped: its incumbent's mode {why}")
            return restore
        return {"phase": self.phase, "until": self.until, "keep": True}

    # -- every rank follows -------------------------------------------------------------------
    def _follow(self, decision, it):
        self.phase, self.until = decision["phase"], decision.get("until")
        if self.phase == WARMUP or decision.get("keep"):
            return
        if self.knobs is None:
            self.knobs = RunKnobs(self.session)
        if not self.knobs.applied:
            self.knobs.current(decision["config"])
        if self.board is not None:
            self.board.flush_window()   # no scalar window straddles a switch
        self.knobs.resync()
        modes = self.knobs.apply(decision["config"])
        self.applied.append([it, decision["config"]])
        if self.phase == RESTORE:
            self.current = None
            return
        if self.phase == TRIAL:
            self.current = RunningTrial(decision, it, modes)
            self._acc.take()
            if self.board is not None:
                self.board.in_trial(decision["trial"])
        else:
            self._freeze(decision)

    def _freeze(self, decision):
        self.search_ended = time.perf_counter()
        self.current = None
        self._ticks.remove()
        if decision.get("failed"):
            self._say_stopped(decision["failed"], decision["config"])
        if self.board is not None:
            self.board.in_trial(None)
        if not dist.is_decider() or decision["config"] == {}:
            return
        rec = self.book.frozen(decision, score.unit(self.samples_per_step), self.session.policy.source)
        if not decision.get("resumed"):
            self.best_path, self.best_failed = save_best(
                best_path(self.cfg, self.session.policy.logging.tensorboard_dir), rec)
        if self.board is not None:
            self.board.frozen({**rec, "best_json": self.best_path})

    def _stop(self, reason):
        """A failure of the tuner itself, on this rank: keep the best config so far and stop."""
        config = None
        try:
            if self.knobs is not None:
                config = self.book.fallback()
                self.knobs.resync()
                self.knobs.apply(config)
        except Exception as e:
            reason += f"; applying {config} failed too ({type(e).__name__}: {e})"
            config = None
        self.phase, self.current = FROZEN, None
        self.search_ended = time.perf_counter()
        self._ticks.remove()
        self._say_stopped(reason, config)

    def _say_stopped(self, reason, config):
        self.failure = reason
        kept = f"keeping {config}" if config else "keeping the config in effect"
        self.notes.append(f"autotune stopped: {reason}; {kept}")
        if dist.is_decider():
            print(f"autopatch: autotune stopped after {len(self.book.trials)} trial(s): {reason}; {kept}",
                  file=sys.stderr)
