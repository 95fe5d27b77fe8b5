"""The node-local cache: an lmdb environment in a directory that outlives the run.

lmdb was chosen by measurement (benchmarks/RESULTS.md, "Data: the sample cache and the
load-balanced sampler"): with two worker processes it read samples 2 to 7 times faster than
diskcache and wrote them 1.7 to 10 times faster, and six processes writing the same keys at once
neither failed nor tore a value. Readers share the file's pages through the page cache, and one
writer at a time holds lmdb's lock.

The directory is this user's alone (0700, files 0600: ``private_files``). lmdb maps its file into
memory, so a file cut short would kill the process with SIGBUS at the first read past its end, and
one that is not an lmdb file cannot be opened: each process checks the file when it opens it (its
size against the last page lmdb says it uses, under a lock on the directory so that two processes
never repair at once) and starts a damaged store afresh, saying why in ``repaired``. A store that
reports corrupted pages while in use is started afresh the same way.

lmdb has no eviction of its own: when the map is full, a tenth of the entries starting at a
random key is deleted and the write tried again (a few times), so the cache stays within ``capacity`` and
entries of datasets that changed age out, as with Redis's random eviction.

lmdb forbids an environment open twice in one process and its use across fork(), and py-lmdb
refuses to open, in a forked child, a path its parent had open. So each process holds one
environment per directory, shared by every store on it, and closes them all just before it forks
(DataLoader workers are forked): the child opens its own, the parent reopens on next use.
"""

import contextlib
import errno
import fcntl
import os
import random
import shutil
from pathlib import Path

import lmdb

from ...private_files import private_dir, private_file
from .user_key import cache_root
from .write_buffer import forget_held, hold_all, release_all

__all__ = ["LocalStore", "default_cache_dir"]

GiB = 1 << 30
EVICTION_ROUNDS = 5   # a full map: evict a tenth and retry, this many times before failing
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse.sshfs", "ceph"}
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
          lmdb.BadRslotError, lmdb.BadTxnError, lmdb.BadValsizeError, lmdb.PanicError)
_open_envs = {}   # this process's environments by directory: (environment, inode of its file)
_repairs = {}     # directory -> why this process started it afresh


def _open_checked(path, capacity):
    """An environment on ``path``, the file checked first (and started afresh when damaged)."""
    with _directory_lock(path):
        for name in ("data.mdb", "lock.mdb"):
            try:
                private_file(os.path.join(path, name))
            except FileNotFoundError:
                pass
        damage = _damage(path)
        if damage:
            _start_afresh(path, damage)
        env = lmdb.open(path, map_size=capacity, sync=False, metasync=False, readahead=False,
                        max_readers=2048, lock=True, mode=0o600)
        env.reader_check()   # slots of readers that were killed
        return env, os.stat(os.path.join(path, "data.mdb")).st_ino


@contextlib.contextmanager
def _directory_lock(path):
    fd = os.open(os.path.join(path, "open.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _damage(path):
    """Why the store's file cannot be used as it is, or None. Other processes may be writing to it
    meanwhile (another DataLoader worker, another rank): the file only grows in use, so its size is
    read after the pages its header says it holds, and a file that keeps growing past the map this
    check opens is in use, not cut."""
    data = os.path.join(path, "data.mdb")
    for _ in range(3):
        try:
            size = os.path.getsize(data)
        except FileNotFoundError:
            return None
        if size == 0:
            return None
        try:
            env = lmdb.open(path, readonly=True, lock=False, max_readers=2048, map_size=max(size, 1 << 20))
            try:
                needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            finally:
                env.close()
        except lmdb.MapResizedError:   # it grew between the size read and the header read
            continue
        except DAMAGE as e:
            return f"it is not a readable lmdb file ({type(e).__name__}: {e})"
        size = os.path.getsize(data)
        if size < needed:
            return f"its file was cut to {size} of the {needed} bytes it holds"
        return None
    return None


def _start_afresh(path, why):
    for name in ("data.mdb", "lock.mdb"):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    _repairs[path] = f"the local store {path} was started afresh: {why}"


def _environment(path, capacity):
    known = _open_envs.get(path)
    if known is None:
        known = _open_envs[path] = _open_checked(path, capacity)
    return known[0]


def _close_before_fork():
    hold_all()   # no write of a buffer's timer thread is under way in an environment closed here
    while _open_envs:
        _open_envs.popitem()[1][0].close()


os.register_at_fork(before=_close_before_fork, after_in_parent=release_all, after_in_child=forget_held)


def default_cache_dir():
    """``$XDG_CACHE_HOME/autopatch/data`` (``~/.cache``), or a directory of this user's in the
    temporary directory when the home cache sits on a network filesystem, where lmdb's locks do not
    work and reads are not local."""
    home = cache_root() / "data"
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
    """Bagua's store interface (set, get, mset, mget, num_keys, clear, status, shutdown) on lmdb,
    and ``delete`` / ``delete_prefix``."""

    def __init__(self, path=None, capacity=None):
        if path is None:
            private_dir(cache_root())
        self.path = private_dir(os.path.realpath(path or default_cache_dir()))
        self.capacity = int(capacity or default_capacity(self.path))
        self._open()

    @property
    def repaired(self):
        """Why this process started the store afresh, or None."""
        return _repairs.get(self.path)

    def _open(self):
        return _environment(self.path, self.capacity)

    def _damaged(self, error):
        """A store that reports damage in use is started afresh (once per file: another process
        may have done it already)."""
        known = _open_envs.pop(self.path, None)
        if known is not None:
            known[0].close()
            with _directory_lock(self.path):
                try:
                    same = os.stat(os.path.join(self.path, "data.mdb")).st_ino == known[1]
                except FileNotFoundError:
                    same = False
                if same:
                    _start_afresh(self.path, f"lmdb reported {type(error).__name__}: {error}")

    def _run(self, work, write=False):
        """``work(txn)`` in a transaction; a damaged store is started afresh and the work done
        there (a second damage is raised, for the guard to count)."""
        for attempt in range(3):
            env = self._open()
            try:
                with env.begin(write=write) as txn:
                    return work(txn)
            except lmdb.MapResizedError:   # another process (another rank) grew the map: adopt its size
                env.set_mapsize(0)
            except DAMAGE as e:
                self._damaged(e)
                if attempt:
                    raise
        with self._open().begin(write=write) as txn:
            return work(txn)

    def get(self, key):
        return self._run(lambda txn: txn.get(key.encode()))

    def mget(self, keys):
        return self._run(lambda txn: [txn.get(k.encode()) for k in keys])

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
        def put(txn):
            for k, v in items:
                txn.put(k, v)
        try:
            self._run(put, write=True)
        except (lmdb.MapFullError, *DAMAGE):
            raise
        except lmdb.Error as e:   # lmdb says EIO when the disk is full: say what it is
            free = shutil.disk_usage(self.path).free
            if free < sum(len(v) for _, v in items) + (1 << 20):
                raise OSError(errno.ENOSPC, f"the disk holding {self.path} is full ({free} bytes free; "
                                            f"lmdb: {e})") from e
            raise

    def delete(self, keys):
        def drop(txn):
            for k in keys:
                txn.delete(k.encode())
        self._run(drop, write=True)

    def delete_prefix(self, prefix):
        """Delete every entry whose key starts with ``prefix``."""
        start = prefix.encode()

        def drop(txn):
            cursor = txn.cursor()
            found = cursor.set_range(start)
            while found and cursor.key().startswith(start):
                found = cursor.delete()
        self._run(drop, write=True)

    def _evict_tenth(self):
        """Delete a tenth of the entries from a random key on. A map so full that even deleting
        cannot commit (deletion copies pages too) deletes fewer at a time."""
        entries = self.num_keys()
        count = max(1, entries // 10)
        while entries:
            start = random.randrange(entries)

            def evict(txn):
                keys = list(txn.cursor().iternext(keys=True, values=False))
                for key in (keys[start:] + keys[:start])[:count]:
                    txn.delete(key)
            try:
                return self._run(evict, write=True)
            except lmdb.MapFullError:
                if count == 1:
                    raise
                count = max(1, count // 4)

    def num_keys(self):
        return self._open().stat()["entries"]

    def clear(self):
        env = self._open()
        self._run(lambda txn: txn.drop(env.open_db(), delete=False), write=True)

    def status(self):
        try:
            self._open().stat()
        except lmdb.Error:
            return False
        return True

    def shutdown(self):
        """Close this process's environment on the directory (reopened if used again)."""
        known = _open_envs.pop(self.path, None)
        if known is not None:
            known[0].close()
