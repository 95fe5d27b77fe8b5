"""The node-local cache: an lmdb environment in a directory that outlives the run.

lmdb was chosen by measurement (benchmarks/RESULTS.md, "Data: the sample cache and the
load-balanced sampler"): with two worker processes it read samples 2 to 7 times faster than
diskcache and wrote them 1.7 to 10 times faster, and six processes writing the same keys at once
neither failed nor tore a value. Readers share the file's pages through the page cache, and one
writer at a time holds lmdb's lock.

lmdb has no eviction of its own: when the map is full, a tenth of the entries starting at a
random key is deleted and the write tried again (a few times), so the cache stays within ``capacity`` and
entries of datasets that changed age out, as with Redis's random eviction.

lmdb forbids an environment open twice in one process and its use across fork(), and py-lmdb
refuses to open, in a forked child, a path its parent had open. So each process holds one
environment per directory, shared by every store on it, and closes them all just before it forks
(DataLoader workers are forked): the child opens its own, the parent reopens on next use.
"""

import os
import random
import shutil
from pathlib import Path

import lmdb

__all__ = ["LocalStore", "default_cache_dir"]

GiB = 1 << 30
EVICTION_ROUNDS = 5   # a full map: evict a tenth and retry, this many times before failing
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse.sshfs", "ceph"}
_open_envs = {}   # this process's environments by directory


def _environment(path, capacity):
    env = _open_envs.get(path)
    if env is None:
        os.makedirs(path, exist_ok=True)
        env = _open_envs[path] = lmdb.open(path, map_size=capacity, sync=False, metasync=False,
                                           readahead=False, max_readers=2048, lock=True)
    return env


def _close_before_fork():
    while _open_envs:
        _open_envs.popitem()[1].close()


os.register_at_fork(before=_close_before_fork)


def default_cache_dir():
    """``$XDG_CACHE_HOME/autopatch/data`` (``~/.cache``), or the temporary directory when the home
    cache sits on a network filesystem, where lmdb's locks do not work and reads are not local."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autopatch" / "data"
    if _filesystem_type(home) in NETWORK_FILESYSTEMS:
        return Path(os.environ.get("TMPDIR", "/tmp")) / f"autopatch-data-{os.getuid()}"
    return home


def _filesystem_type(path):
    path, best = str(path.absolute()), ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mount, fstype = line.split()[1:3]
                if path.startswith(mount) and len(mount) > len(best[0]):
                    best = (mount, fstype)
    except OSError:
        pass
    return best[1]


def default_capacity(path):
    """64 GiB, or half the disk space free now when that is less (but at least 1 GiB), in whole
    GiB so that processes opening the store at about the same time agree."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    return GiB * max(1, min(64, shutil.disk_usage(probe).free // 2 // GiB))


class LocalStore:
    """Bagua's store interface (set, get, mset, mget, num_keys, clear, status, shutdown) on lmdb."""

    def __init__(self, path=None, capacity=None):
        self.path = os.path.realpath(path or default_cache_dir())
        self.capacity = int(capacity or default_capacity(self.path))
        self._open()

    def _open(self):
        return _environment(self.path, self.capacity)

    def _begin(self, write=False):
        env = self._open()
        try:
            return env.begin(write=write)
        except lmdb.MapResizedError:   # another process (another rank) grew the map: adopt its size
            env.set_mapsize(0)
            return env.begin(write=write)

    def get(self, key):
        with self._begin() as txn:
            return txn.get(key.encode())

    def mget(self, keys):
        with self._begin() as txn:
            return [txn.get(k.encode()) for k in keys]

    def set(self, key, value):
        self.mset({key: value})

    def mset(self, mapping):
        items = [(k.encode(), bytes(v) if isinstance(v, (bytearray, memoryview)) else v)
                 for k, v in mapping.items()]
        for _ in range(EVICTION_ROUNDS):
            try:
                return self._put(items)
            except lmdb.MapFullError:
                self._evict_tenth()
        self._put(items)

    def _put(self, items):
        with self._begin(write=True) as txn:
            for k, v in items:
                txn.put(k, v)

    def _evict_tenth(self):
        env = self._open()
        entries = env.stat()["entries"]
        if not entries:
            return
        start, count = random.randrange(entries), max(1, entries // 10)
        with self._begin(write=True) as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
            for key in (keys[start:] + keys[:start])[:count]:
                txn.delete(key)

    def num_keys(self):
        return self._open().stat()["entries"]

    def clear(self):
        env = self._open()
        with self._begin(write=True) as txn:
            txn.drop(env.open_db(), delete=False)

    def status(self):
        try:
            self._open().stat()
        except lmdb.Error:
            return False
        return True

    def shutdown(self):
        """Close this process's environment on the directory (reopened if used again)."""
        env = _open_envs.pop(self.path, None)
        if env is not None:
            env.close()
