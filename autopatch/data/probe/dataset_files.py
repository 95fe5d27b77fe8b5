"""The files a dataset names, and whether they changed since it was cached.

A signature loads 16 samples and each epoch rechecks 8 others, so one rewritten file among
thousands would be served from the cache for many epochs, and across runs until the recheck
reaches it. Most datasets read files they name: torchvision's folder datasets list
``(path, class)`` in ``samples`` / ``imgs``, others keep a list of paths or a ``root`` directory.
Those are found in the dataset's attributes (and in the datasets it wraps, ``MAX_DEPTH`` levels
down): a string or path naming a file, a directory (walked for at most ``WALK_ENTRIES`` entries;
a directory's own time shows files added or removed), a list or tuple whose first item is, or
begins with, an existing file's path. Their ``st_size`` and ``st_mtime_ns`` go into the signature
and are compared again at each epoch.

A check stats at most ``STATS_PER_CHECK`` files: all of them when the dataset names no more.
Otherwise a fixed spread of half that many is in the signature and stat'ed at every check, and
each check also stats the next block of the others in turn, compared with what this run first saw
of that block: a change there during the run is found within ``files / (STATS_PER_CHECK / 2)``
epochs, and one made between runs is not seen here (the sample recheck remains for it). Nothing
is opened or read: a file rewritten with the same size within the file system's time
granularity, and data that does not come from named files (a database, a network, a file opened
by a name the dataset builds) are not seen here either. A directory the program also writes to
(checkpoints, logs) changes at every epoch, and turns the cache off.
"""

import collections
import hashlib
import os

import torch

__all__ = ["DatasetFiles", "STATS_PER_CHECK", "WALK_ENTRIES"]

STATS_PER_CHECK = 8192   # os.stat calls of one check, at most
WALK_ENTRIES = 100_000   # names listed, at most, walking one directory a dataset names (once)
MAX_DEPTH = 3            # datasets wrapped in datasets (Subset, ConcatDataset) looked into
_MAX_PATH = 4096


class DatasetFiles:
    """The files (and directories) ``named_by`` a dataset, in a fixed order."""

    def __init__(self, paths):
        self.paths = tuple(dict.fromkeys(paths))
        n, half = len(self.paths), STATS_PER_CHECK // 2
        self._fixed = list(range(n)) if n <= STATS_PER_CHECK else [i * n // half for i in range(half)]
        fixed = set(self._fixed)
        self._rest = [i for i in range(n) if i not in fixed]
        self._fixed_stats = None     # what the signature saw of the fixed files
        self._blocks = {}            # block number -> digest, as first seen in this run
        self._turn = 0

    @classmethod
    def named_by(cls, dataset):
        paths = []
        _collect(dataset, paths, MAX_DEPTH, set())
        return cls(paths)

    def fingerprint(self):
        """The fixed files' sizes and times, for the signature (b"" when the dataset names none)."""
        if not self.paths:
            return b""
        self._fixed_stats = _stats(self.paths[i] for i in self._fixed)
        return _digest(self._fixed_stats)

    def changed(self):
        """What changed since ``fingerprint`` (or, in a block of the rest, since this run first
        stat'ed it), in words; None when nothing did. At most ``STATS_PER_CHECK`` stats."""
        if self._fixed_stats is None:
            self.fingerprint()
            return None
        now = _stats(self.paths[i] for i in self._fixed)
        for i, before, after in zip(self._fixed, self._fixed_stats, now):
            if before != after:
                return f"file {self.paths[i]!r} changed ({_shown(before)}, now {_shown(after)})"
        if not self._rest:
            return None
        size = STATS_PER_CHECK - len(self._fixed)
        block = self._turn % -(-len(self._rest) // size)
        self._turn += 1
        members = self._rest[block * size:(block + 1) * size]
        digest = _digest(_stats(self.paths[i] for i in members))
        if self._blocks.setdefault(block, digest) != digest:
            return f"one of the files from {self.paths[members[0]]!r} to {self.paths[members[-1]]!r} changed"
        return None


def _stats(paths):
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_size, st.st_mtime_ns))
        except OSError as e:
            out.append((-1, e.errno or 0))
        except ValueError:   # a NUL in the name
            out.append((-1, -1))
    return out


def _digest(stats):
    h = hashlib.blake2b(digest_size=16)
    for size, time in stats:
        h.update(b"%d:%d;" % (size, time))
    return h.digest()


def _shown(stat):
    size, time = stat
    return "missing" if size < 0 else f"{size} bytes, mtime {time} ns"


def _collect(value, paths, depth, seen):
    """Add the paths a dataset's attributes name (see the module's docstring)."""
    if depth < 0 or id(value) in seen:
        return
    seen.add(id(value))
    for attr in vars(value).values() if hasattr(value, "__dict__") else ():
        if isinstance(attr, torch.utils.data.Dataset):
            _collect(attr, paths, depth - 1, seen)
        elif _is_path(attr):
            _add_named(os.fspath(attr), paths)
        elif isinstance(attr, (list, tuple)) and attr:
            first = attr[0]
            if isinstance(first, torch.utils.data.Dataset):
                for inner in attr:
                    _collect(inner, paths, depth - 1, seen)
            elif _path_of(first) is not None and os.path.isfile(_path_of(first)):
                paths.extend(p for p in map(_path_of, attr) if p is not None)


def _is_path(value):
    if isinstance(value, os.PathLike):
        return True
    return isinstance(value, str) and 0 < len(value) <= _MAX_PATH and "\0" not in value and "\n" not in value


def _path_of(item):
    """The path an item of a list names: itself, or the first of a (path, label) pair."""
    if isinstance(item, (tuple, list)) and item:
        item = item[0]
    return os.fspath(item) if _is_path(item) else None


def _add_named(path, paths):
    if os.path.isfile(path):
        paths.append(path)
    elif os.path.isdir(path):
        paths.extend(_walk(path))


def _walk(root):
    """The directories and files under ``root``, breadth first, at most ``WALK_ENTRIES``."""
    found, queue = [root], collections.deque([root])
    while queue and len(found) < WALK_ENTRIES:
        try:
            with os.scandir(queue.popleft()) as entries:
                names = sorted(entries, key=lambda e: e.name)
        except OSError:
            continue
        for entry in names[:WALK_ENTRIES - len(found)]:
            found.append(entry.path)
            if entry.is_dir(follow_symlinks=False):
                queue.append(entry.path)
    return found
