"""The files autopatch writes: never through a link someone planted, and whole or not at all.

Every file is opened with O_NOFOLLOW, so a symbolic link where the file goes is refused, not
followed (a file in a shared directory cannot be redirected onto another). A file written whole
(the report, the best config) goes to a fresh name beside it (O_EXCL, random) and is renamed
over the target: a reader never sees half a file, and a full disk leaves the old one. A file
that has no place of its own (autotune's best config and trials CSV with no directory named)
goes in a private directory, ``autopatch-<uid>`` in the temp dir: created 0700, and refused when
it exists as a link, belongs to someone else or lets others in (``private_files``). Directories
are held open while their files are made, so one renamed away meanwhile cannot be swapped for
another.
"""

import os
import secrets
import tempfile

from ..private_files import open_private_dir

_WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class Folder:
    """A directory held open; files are made in it by name. ``private``: the per-user directory,
    whose files only their owner may read."""

    def __init__(self, path, private=False, fd=None):
        """``fd``: the directory already open (and checked), else it is opened here."""
        self.path = path
        self.private = private
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY) if fd is None else fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def open(self, name, exclusive=False, append=False):
        """``name`` opened for writing (binary): created if missing, else truncated, or appended
        to; ``exclusive``: it must not exist yet. A link there is refused (OSError)."""
        flags = _WRITE | (os.O_EXCL if exclusive else os.O_APPEND if append else os.O_TRUNC)
        fd = os.open(name, flags, 0o600 if self.private else 0o666, dir_fd=self.fd)
        return os.fdopen(fd, "ab" if append else "wb")

    def create(self, prefix, suffix):
        """A new file of a name no one could guess; returns (its name, the file open for writing)."""
        while True:
            name = f"{prefix}{secrets.token_hex(6)}{suffix}"
            try:
                return name, self.open(name, exclusive=True)
            except FileExistsError:
                continue

    def write_whole(self, name, data):
        """``name`` replaced by ``data`` (bytes) at once; on any failure it is left as it was."""
        tmp, f = self.create(f".{name}.", ".tmp")
        try:
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise
        return os.path.join(self.path, name)


def folder_of(path):
    """The directory ``path`` goes in, created if missing, held open; and ``path``'s own name."""
    parent, name = os.path.split(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return Folder(parent or "."), name


def private_folder():
    """This user's private directory in the temp dir, created 0700 if missing. PermissionError
    (``NotPrivate``) when the one there is a link, is not this user's, or is open to others:
    another local user may have made it to read or redirect what goes in it."""
    path = os.path.join(tempfile.gettempdir(), f"autopatch-{os.getuid()}")
    return Folder(path, private=True, fd=open_private_dir(path, refuse_open=True))
