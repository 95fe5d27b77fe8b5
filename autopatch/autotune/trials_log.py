"""What a search leaves behind: the trials CSV in Bagua's layout and the best config as JSON.

The CSV has one column per knob, then ``score`` and ``train_iter`` (the iteration at which the
trial ended), exactly like Bagua's ``bagua_autotune_*.log``, so existing scripts read it.
Neither ever reaches training: a write that fails turns that file off, with one warning on
stderr, and the autotune report says why (``log_csv_failed``, ``best_json_failed``); the search
goes on. With no place named, the best config goes to this user's private directory
(reporting/files.py), never to a fixed name in the shared temp dir.
"""

import csv
import io
import json
import os
import sys

from ..reporting.files import Folder, folder_of, private_folder
from ..vocabulary import OFF

BEST_VERSION = 1
BEST_NAME = "autotune_best.json"


def _failure(what, error):
    why = f"{type(error).__name__}: {error}"
    print(f"autopatch: autotune: {what} is off: {why}; the search goes on", file=sys.stderr)
    return why


class CsvLog:
    """The trials CSV at ``path``: its header at once, a row per finished trial. ``failed``: why
    it stopped being written, if it did."""

    def __init__(self, path, knobs):
        self.path = path
        self.knobs = list(knobs)
        self.failed = None
        try:
            folder, name = folder_of(path)
            with folder, folder.open(name) as f:
                f.write(self._line([*self.knobs, "score", "train_iter"]))
        except Exception as e:
            self.failed = _failure(f"the trials CSV {path}", e)

    def add(self, config, score, train_iter):
        if self.failed is not None:
            return
        try:   # the directory as it is now: one removed meanwhile is a failure, not made again
            with Folder(os.path.dirname(self.path) or ".") as folder, \
                    folder.open(os.path.basename(self.path), append=True) as f:
                f.write(self._line([*(config[k] for k in self.knobs), score, train_iter]))
        except Exception as e:
            self.failed = _failure(f"the trials CSV {self.path}", e)

    @staticmethod
    def _line(row):
        text = io.StringIO()
        csv.writer(text).writerow(row)
        return text.getvalue().encode()


def save_best(path, record):
    """Write the best config, whole, at ``path`` (None: ``autotune_best.json`` in the private
    directory). Returns (the path written, None), or (None, why not) after one warning."""
    data = json.dumps({"version": BEST_VERSION, **record}, indent=2).encode()
    try:
        folder, name = folder_of(path) if path else (private_folder(), BEST_NAME)
        with folder:
            return folder.write_whole(name, data), None
    except Exception as e:
        return None, _failure(f"saving the best config{f' to {path}' if path else ''}", e)


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
    TensorBoard log dir, else None (the private directory)."""
    return autotune.save_best or autotune.resume or (os.path.join(logdir, BEST_NAME) if logdir else None)
