"""Real places where writing fails, for the tests that check autopatch's output never stops
training: a path under a regular file, a read-only directory, a full filesystem (a small tmpfs
mounted for the test, root only), and another local user (``nobody``) planting links."""

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile

import pytest

NOBODY = 65534
FAULTS = ("parent is a file", "read-only", "full")
# What the failure says, by fault (root is refused by a read-only mount; others by permissions).
SAYS = {"parent is a file": ("Not a directory", "File exists"),
        "read-only": ("Read-only file system", "Permission denied"),
        "full": ("No space left on device",)}


def is_root():
    return os.geteuid() == 0


@contextlib.contextmanager
def small_tmpfs(path, size="64k", read_only=False):
    """A tmpfs of ``size`` mounted at ``path`` for the block, unmounted after; skips when it
    cannot be mounted (not root, or no mount rights in this container)."""
    if not is_root():
        pytest.skip("a full or read-only filesystem needs a tmpfs mounted by root")
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0755" + (",ro" if read_only else "")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path):
    """Fill the filesystem holding ``path`` until the kernel says no space is left."""
    block = b"\0" * 4096
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return


@contextlib.contextmanager
def unwritable(tmp_path, fault):
    """A directory in which nothing can be written, for ``fault`` (one of FAULTS)."""
    if fault == "parent is a file":
        (tmp_path / "a-file").write_text("not a directory\n")
        yield tmp_path / "a-file"
    elif fault == "read-only":
        if is_root():     # root writes through permission bits: only a read-only mount stops it
            with small_tmpfs(tmp_path / "ro", read_only=True) as place:
                yield place
        else:
            place = tmp_path / "ro"
            place.mkdir()
            place.chmod(0o555)
            try:
                yield place
            finally:
                place.chmod(0o755)
    else:
        with small_tmpfs(tmp_path / "full") as place:
            fill(place)
            yield place


def as_nobody(*argv):
    """Run ``argv`` as the unprivileged user ``nobody`` (another local user, for the link tests)."""
    subprocess.run(list(map(str, argv)), user=NOBODY, group=NOBODY, check=True, capture_output=True)


@contextlib.contextmanager
def shared_temp_dir(mode):
    """A directory every local user can write to, like /tmp (``mode`` 0o1777) or one without the
    sticky bit (0o777), made in the real temp dir (a test's own tmp_path is closed to others)."""
    if not is_root():
        pytest.skip("another user planting links needs root to act as nobody")
    path = tempfile.mkdtemp(prefix="autopatch-test-shared-")
    os.chmod(path, mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
