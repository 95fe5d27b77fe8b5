"""Autotune's section of ``autopatch.report()``: where the search stands, the trials, what the
search cost and where the best config went, read off the tuner's public state."""

import time

from . import score


def describe(tuner):
    """The report section of ``tuner`` (an ``Autotuner``), a plain dict."""
    out = {"active": True, "phase": tuner.phase, "applied": tuner.applied,
           "left_out": tuner.left_out, "notes": tuner.notes}
    if tuner.space is not None:
        out.update(knobs=tuner.space.names, space_size=len(tuner.space.grid()),
                   unit=score.unit(tuner.samples_per_step))
    if tuner.knobs is not None and tuner.knobs.ruled_out:
        out["ruled_out_modes"] = dict(tuner.knobs.ruled_out)
    if tuner.failure:
        out["failed"] = tuner.failure
    out.update(tuner.book.describe())
    if tuner.book.trials:
        searched = None if tuner.search_started is None else \
            (tuner.search_ended or time.perf_counter()) - tuner.search_started
        out["cost"] = tuner.book.cost(searched, tuner.decision_seconds, tuner.samples_per_step)
    out["best_json"] = tuner.best_path
    if tuner.best_failed:
        out["best_json_failed"] = tuner.best_failed
    out["resumed_from"] = tuner.cfg.resume if tuner.resume_config is not None else None
    return out
