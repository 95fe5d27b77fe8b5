"""The autopatch tab in TensorBoard: what mode auto measured and chose, autotune trials, the
frozen config, per-mode step times, and where each step's time went over the run.

It reads only the ``autopatch.jsonl`` records autopatch writes next to its event files (one per
run directory), so it needs neither TensorFlow nor event parsing, and the page is one
self-contained ES module: nothing is fetched from the network. A log dir with no records, or a
run still searching (or cut short, with a half-written last line), gets a message that says so.
"""

import json
import os
import statistics
from pathlib import Path

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

JSONL = "autopatch.jsonl"
STATIC = Path(__file__).resolve().parent / "static"
MAX_DEPTH = 3          # how deep below the log dir runs are looked for
PARTS = ("data", "forward", "backward", "optimizer", "comm", "autopatch", "other", "compute")
TIMELINE_POINTS = 240  # windows shown over time; a longer run is thinned evenly
AUTO_KEYS = ("optimizer", "step", "chosen", "candidates", "ruled_out", "ms_per_step", "ratio_vs_off",
             "speedup_vs_off", "rounds", "window_steps", "clock", "measure_steps", "measure_seconds",
             "measure_steps_limit", "measurements", "why", "ran", "dropped", "noise", "decided_at_step")


def find_runs(logdir):
    """Run names (paths relative to the log dir, '.' for itself) that hold autopatch records."""
    if not logdir or not os.path.isdir(logdir):
        return []
    runs = []
    base = os.path.abspath(logdir)
    for here, dirs, files in os.walk(base):
        rel = os.path.relpath(here, base)
        if rel.count(os.sep) + (rel != ".") >= MAX_DEPTH:
            dirs[:] = []
        if JSONL in files:
            runs.append(rel)
    return sorted(runs)


def read_records(path):
    """(records, partial): a line that does not parse (a run writing or killed) marks it partial."""
    records, partial = [], False
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                partial = True
    return records, partial


def summarize(records):
    """What the tab shows, from one run's records."""
    space = next((r for r in reversed(records) if r.get("kind") == "space"), None)
    trials = [r for r in records if r.get("kind") == "trial"]
    frozen = next((r for r in reversed(records) if r.get("kind") == "frozen"), None)
    by_mode = {}
    for r in records:
        if r.get("kind") == "window" and r.get("mode"):
            by_mode.setdefault(r["mode"], []).append(r)
    breakdown = {}
    for mode, windows in by_mode.items():
        parts = {p: statistics.median(w["breakdown_ms"][p] for w in windows if p in w["breakdown_ms"])
                 for p in PARTS if any(p in w["breakdown_ms"] for w in windows)}
        breakdown[mode] = {"parts_ms": parts, "steps": sum(w["steps"] for w in windows),
                           "step_ms": statistics.median(w["breakdown_ms"]["step"] for w in windows)}
    windows = [r for r in records if r.get("kind") == "window"]
    stride = -(-len(windows) // TIMELINE_POINTS) or 1
    timeline = [{"iteration": w["iteration"], "mode": w.get("mode"),
                 "parts_ms": {p: w["breakdown_ms"][p] for p in PARTS if p in w["breakdown_ms"]}}
                for w in windows[::stride]]
    scored = [t for t in trials if t.get("score") is not None]     # a failed trial has no score
    best = max(scored, key=lambda t: t["score"]) if scored else None
    auto = [{k: r.get(k) for k in AUTO_KEYS} for r in records if r.get("kind") == "auto"]
    out = {"knobs": list(space["knobs"]) if space else sorted({k for t in trials for k in t["config"]}),
           "unit": (space or {}).get("unit") or (frozen or {}).get("unit") or "steps/s",
           "trials": [{k: t.get(k) for k in ("trial", "config", "score", "step_ms", "train_iter", "modes",
                                             "breakdown_ms", "failed")}
                      for t in trials],
           "best_trial": best["trial"] if best else None,
           "frozen": frozen, "breakdown": breakdown, "timeline": timeline, "auto": auto}
    if frozen is None and trials:
        out["message"] = f"Search in progress: {len(trials)} trial(s) so far, no config frozen yet."
    elif frozen is None:
        shown = "mode auto's measurements and step times are" if auto else "only step times are"
        out["message"] = f"No autotune trial has finished in this run yet (or autotune is off): {shown} shown."
    return out


class AutopatchPlugin(base_plugin.TBPlugin):
    plugin_name = "autopatch"

    def __init__(self, context):
        self._logdir = context.logdir

    def get_plugin_apps(self):
        return {"/index.js": self._index_js, "/runs": self._runs, "/run": self._run}

    def is_active(self):
        return bool(find_runs(self._logdir))

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="autopatch")

    @wrappers.Request.application
    def _index_js(self, request):
        return http_util.Respond(request, (STATIC / "index.js").read_text(), "text/javascript")

    @wrappers.Request.application
    def _runs(self, request):
        runs = find_runs(self._logdir)
        body = {"runs": runs, "logdir": self._logdir}
        if not runs:
            body["message"] = (f"No autopatch records in {self._logdir or 'this log dir'}. Train with "
                               "FUSEDOPT_LOGDIR set to this directory (or logging.tensorboard_dir in the "
                               "policy), with mode auto or autotune, then reload.")
        return http_util.Respond(request, body, "application/json")

    @wrappers.Request.application
    def _run(self, request):
        name = request.args.get("run", ".")
        if name not in find_runs(self._logdir):   # only runs found in the log dir, never a path
            return http_util.Respond(request, {"error": f"no autopatch run {name!r}"}, "application/json", code=404)
        records, partial = read_records(os.path.join(self._logdir, name, JSONL))
        body = {"run": name, "partial": partial, **summarize(records)}
        if partial:
            body["message"] = (body.get("message", "") + " The record file ends in a half-written line "
                               "(the run is still writing it, or stopped); shown up to there.").strip()
        return http_util.Respond(request, body, "application/json")
