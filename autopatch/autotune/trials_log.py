"""What a search leaves behind: the trials CSV in Bagua's layout and the best config as JSON.

The CSV has one column per knob, then ``score`` and ``train_iter`` (the iteration at which the
trial ended), exactly like Bagua's ``bagua_autotune_*.log``, so existing scripts read it.
"""

import csv
import json
import os
import tempfile

from ..vocabulary import OFF

BEST_VERSION = 1
BEST_NAME = "autotune_best.json"


class CsvLog:
    def __init__(self, path, knobs):
        self.path = path
        self.knobs = list(knobs)
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow([*self.knobs, "score", "train_iter"])

    def add(self, config, score, train_iter):
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([*(config[k] for k in self.knobs), score, train_iter])


def save_best(path, record):
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": BEST_VERSION, **record}, f, indent=2)
    os.replace(tmp, path)   # a reader never sees half a file


def load_best(path):
    """The config saved by ``save_best``; ValueError when the file is not one."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != BEST_VERSION or not isinstance(doc.get("config"), dict):
        raise ValueError(f"{path}: not an autopatch best-config file (version {BEST_VERSION})")
    return doc["config"]


def read_resume(path):
    """(the config saved at ``path``, or None; a note for the report when it is not used)."""
    if not os.path.exists(path):
        return None, f"resume file {path} does not exist yet: searching, the best goes there"
    try:
        return load_best(path), None
    except (OSError, ValueError) as e:
        return None, f"resume ignored, searching instead: {e}"


def fit_resumed(config, bounds, notes):
    """The knobs of a resumed ``config`` that apply to this run (``bounds``); ``notes`` says why
    the others are left as they are."""
    fitted = {k: v for k, v in config.items() if k in bounds}
    for k in set(config) - set(fitted):
        notes.append(f"resumed knob {k} does not apply to this run: left as is")
    if fitted.get("mode", OFF) not in bounds.get("mode", (OFF,)):
        notes.append(f"resumed mode {fitted.pop('mode')} is not allowed for this run: left as is")
    return fitted


def best_path(autotune, logdir):
    """Where the best config is saved: the policy's save_best or resume path, else the
    TensorBoard log dir, else the temp dir."""
    return (autotune.save_best or autotune.resume or (os.path.join(logdir, BEST_NAME) if logdir else None)
            or os.path.join(tempfile.gettempdir(), "autopatch_" + BEST_NAME))
