"""Every trial of one search: its record, the best so far, and where records are written.

A trial's record holds its config, its score (median window throughput, load-corrected against
the incumbent measured in the same trial) or why it failed, the modes that actually ran, and what
it cost. Records go to the CSV log (Bagua's layout) and the TensorBoard writer as they finish.
A mode the run shows unusable drops every trial that ran it from the contest for best.
"""

from ..vocabulary import OFF
from .trials_log import CsvLog


class TrialBook:
    def __init__(self, board):
        self.board = board          # the TensorBoard writer, or None
        self.trials = []
        self.best = None
        self.start_config = None    # the run's config when the search began
        self.unsafe_modes = {}      # mode -> why the run cannot use it (found while searching)
        self.csv = None

    def start_from(self, config):
        """The run's config when the search began (what the search falls back to); returns it."""
        self.start_config = config
        return config

    def log_to(self, path, knobs):
        self.csv = CsvLog(path, knobs)

    def add(self, rec):
        """A trial that ran to its end, scored."""
        self.trials.append(rec)
        if self.best is None or rec["score"] > self.best["score"]:
            self.best = rec
        self._written(rec, rec["score"])

    def add_failed(self, rec):
        """A trial whose mode the run showed unusable while it ran."""
        self.trials.append(rec)
        self._written(rec, "failed")

    def _written(self, rec, score):
        if self.csv:
            self.csv.add(rec["config"], score, rec["train_iter"])
        if self.board is not None:
            self.board.trial_done(rec)

    def drop_modes(self, blocked):
        """``blocked`` (mode -> why) can no longer run: the best is the best of the rest."""
        self.unsafe_modes.update(blocked)
        usable = [t for t in self.trials if t["score"] is not None
                  and t["config"].get("mode") not in self.unsafe_modes]
        self.best = max(usable, key=lambda t: t["score"], default=None)

    def fallback(self):
        """The best config so far, else the starting one (off for a mode found unsafe)."""
        if self.best is not None:
            return self.best["config"]
        config = dict(self.start_config or {})
        if config.get("mode") in self.unsafe_modes:
            config["mode"] = OFF
        return config

    def improvement(self):
        if not self.trials or not self.trials[0]["score"] or self.best is None:
            return None
        return self.best["score"] / self.trials[0]["score"] - 1

    def cost(self, search_seconds, decision_seconds, samples_per_step):
        """What the search cost: its wall time, the time spent deciding and switching, and the
        time lost against having run the best config from the start (None before a best)."""
        if search_seconds is None or not self.best:
            return None
        best_step = (samples_per_step or 1) / self.best["score"]
        lost = sum(max(0.0, t["seconds"] - t["steps"] * best_step) for t in self.trials)
        return {"search_seconds": round(search_seconds, 4), "decision_seconds": round(decision_seconds, 4),
                "lost_seconds": round(lost, 4)}

    def frozen(self, decision, unit, policy_source):
        """The record of the config frozen for the rest of the run (saved as the best JSON)."""
        return {"config": decision["config"], "trial": decision.get("trial"),
                "score": self.best["score"] if self.best else None, "unit": unit,
                "improvement": self.improvement(), "resumed": decision.get("resumed"),
                "trials": len(self.trials), "policy": policy_source}

    def describe(self):
        out = {}
        if self.trials:
            out["trials"] = [{k: t[k] for k in ("trial", "config", "score", "train_iter", "modes", "failed")
                              if k in t} for t in self.trials]
            out["best"] = {k: self.best[k] for k in ("trial", "config", "score")} if self.best else None
            out["improvement_over_start"] = self.improvement()
        out["log_csv"] = self.csv.path if self.csv else None
        if self.csv and self.csv.failed:
            out["log_csv_failed"] = self.csv.failed
        return out
