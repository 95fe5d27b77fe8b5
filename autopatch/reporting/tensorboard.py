"""TensorBoard output, written by rank 0 only.

- scalars under ``autopatch/`` in the log dir itself: step, data-wait, forward, backward,
  optimizer, communication-wait and autopatch's own times (ms per iteration), throughput, and the
  current autotune trial;
- one HParams session per autotune trial (its own ``trial-NNN`` run: the knobs as hparams, the
  score as metric), through ``tensorboard.plugins.hparams.summary_v2``, which needs no TensorFlow;
- ``autopatch.jsonl``: the same facts as plain records (window, space, trial, frozen, and ``auto``:
  what mode auto measured and chose), which the autopatch dashboard plugin reads without parsing
  event files.

Writing never reaches training: the writer is called from inside ``optimizer.step()``, so any
failure (a log dir that cannot be made or written, a disk that fills) turns it off for the rest
of the run, with one warning on stderr and the reason in the report's ``tensorboard`` section.
"""

import atexit
import functools
import json
import os
import sys
import threading
import time

from ..dist import rank
from ..tunables import KNOBS
from .files import Folder

JSONL = "autopatch.jsonl"
SCALAR_PERIOD = 0.5     # seconds of training summarised by one scalar point
SCORE_TAG = "autopatch/score"
_TAGS = {"step": "step_time_ms", "forward": "forward_time_ms", "backward": "backward_time_ms",
         "optimizer": "optimizer_time_ms", "comm": "comm_wait_ms", "other": "other_time_ms",
         "compute": "compute_time_ms", "data": "data_wait_ms", "autopatch": "autopatch_time_ms"}


def _guarded(method):
    """A failure inside ``method`` turns the writer off instead of reaching the caller."""
    @functools.wraps(method)
    def guarded(self, *args):
        try:
            return method(self, *args)
        except Exception as e:
            self._stop(f"{type(e).__name__}: {e}")
    return guarded


class Board:
    def __init__(self, logdir, timer, session):
        self.logdir = logdir
        self.timer = timer
        self.trial = None                 # the autotune trial now running, for the scalars
        self.samples_per_step = None      # set once known; throughput is then samples/s
        self.failed = None                # why writing stopped early, if it did
        self._acc = timer.accumulator()
        self._events = None               # the run's event file, once open
        self._jsonl = None
        self._closed = False
        self._lock = threading.Lock()
        self._mode = None          # the mode the clock optimizer ran in this window
        self._switched = False     # its mode changed: close the window after this iteration
        self._subscriptions = [timer.subscribe(self._tick), session.subscribe("switch", self._on_switch),
                               session.subscribe("auto", self.auto_measured)]
        session.add_report_section("tensorboard", self.describe)
        atexit.register(self.close)

    def in_trial(self, trial):
        """The autotune trial now running (None: none), for the scalars."""
        self.trial = trial

    def count_samples(self, samples_per_step):
        """Throughput is samples/s from now on (else steps/s)."""
        self.samples_per_step = samples_per_step

    def describe(self):
        """The report's ``tensorboard`` section: where it writes, and why it stopped if it did."""
        return {"logdir": self.logdir, "failed": self.failed}

    def _writing(self):
        """Rank 0 only, asked at the first write: torch.distributed is set up by then."""
        if self._events is None and not self._closed and rank() != 0:
            self._release()
        return not self._closed

    def _open(self):
        if self._events is None:
            from .event_file import EventFile    # tensorboard: a missing one turns the writer off
            os.makedirs(self.logdir, exist_ok=True)
            with Folder(self.logdir) as folder:
                self._jsonl = folder.open(JSONL)
                self._events = EventFile(folder)
            self.record({"kind": "start", "time": time.time(), "pid": os.getpid()})
        return self._events

    @_guarded
    def record(self, rec):
        """One line of autopatch.jsonl, flushed at once so a live dashboard sees it."""
        if not self._writing():
            return
        self._open()
        with self._lock:
            self._jsonl.write((json.dumps(rec) + "\n").encode())
            self._jsonl.flush()

    @_guarded
    def _tick(self, timer):
        if self._mode is None:
            self._mode = timer.clock_mode
        if self._switched or self._acc.window.seconds >= SCALAR_PERIOD:
            self._switched = False
            self.flush_window()

    @_guarded
    def flush_window(self):
        """Write the scalars of the iterations since the last call (also called at each switch)."""
        w = self._acc.take()
        mode, self._mode = self._mode, None
        if not w.steps or not self._writing():
            return
        events, it = self._open(), self.timer.iteration
        parts = w.breakdown_ms()
        for part, ms in parts.items():
            events.add_scalar(f"autopatch/{_TAGS[part]}", ms, it)
        rate = w.steps * (self.samples_per_step or 1) / w.seconds
        events.add_scalar("autopatch/throughput", rate, it)
        if self.trial is not None:
            events.add_scalar("autopatch/trial", self.trial, it)
        events.flush()
        self.record({"kind": "window", "iteration": it, "steps": w.steps, "trial": self.trial,
                     "mode": mode, "breakdown_ms": parts, "throughput": rate})

    def _on_switch(self, ctrl):
        if ctrl is self.timer.clock:
            self._switched = True   # no window mixes two modes

    def auto_measured(self, ctrl, figures):
        """What mode auto measured for one optimizer, and what it chose."""
        self.record({"kind": "auto", "optimizer": ctrl.qualname, "iteration": self.timer.iteration,
                     "step": ctrl.steps, **figures})

    @_guarded
    def space(self, knobs, unit):
        """The search space as the HParams experiment; ``knobs``: name -> choices or (lo, hi)."""
        if not self._writing():
            return
        from tensorboard.plugins.hparams import summary_v2 as hp
        hparams = [hp.HParam(name, hp.RealInterval(float(b[0]), float(b[1])) if KNOBS[name].exponent
                             else hp.Discrete(list(b))) for name, b in knobs.items()]
        pb = hp.hparams_config_pb(hparams, [hp.Metric(SCORE_TAG, display_name=f"throughput ({unit})")])
        self._open().add_summary(pb)
        self.record({"kind": "space", "knobs": {k: list(v) for k, v in knobs.items()}, "unit": unit})

    @_guarded
    def trial_done(self, rec):
        """One finished trial: its HParams session in its own run, and its record."""
        if not self._writing():
            return
        from tensorboard.plugins.hparams import summary_v2 as hp
        from .event_file import EventFile
        name = f"trial-{rec['trial']:03d}"
        hparams = {k: (float(v) if KNOBS[k].exponent else v) for k, v in rec["config"].items()}
        os.makedirs(os.path.join(self.logdir, name), exist_ok=True)
        with Folder(os.path.join(self.logdir, name)) as folder:
            run = EventFile(folder)
        try:
            run.add_summary(hp.hparams_pb(hparams, trial_id=name, start_time_secs=rec["started"]))
            if rec["score"] is not None:      # a failed trial has none
                run.add_scalar(SCORE_TAG, rec["score"], rec["train_iter"])
        finally:
            run.close()
        self._open().flush()
        self.record({"kind": "trial", **rec})

    def frozen(self, rec):
        self.record({"kind": "frozen", **rec})

    @_guarded
    def close(self):
        """At exit or disable(); later calls write nothing (a reopen would truncate the records).
        The steps since the last scalar point are written, even by a run too short to have
        written any before (the file opens for them)."""
        if not self._closed:
            self.flush_window()
        self._release()

    def _stop(self, why):
        """Writing failed: say so once, and write nothing more; training goes on."""
        if self.failed is None:
            self.failed = why
            print(f"autopatch: TensorBoard logging to {self.logdir} is off for the rest of the run: {why}",
                  file=sys.stderr)
        try:
            self._release()
        except OSError:
            pass      # what could not be flushed is lost with the rest

    def _release(self):
        """Close every file, each even when another fails; the first failure is raised."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.remove()
        error = None
        for f in (self._events, self._jsonl):
            try:
                if f is not None:
                    f.close()
            except OSError as e:
                error = error or e
        if error is not None:
            raise error
