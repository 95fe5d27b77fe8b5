"""Directories and files that only this user can reach: the data cache's key and store, and the
report's and autotune's files that have no place of their own, live there.

A directory is made with mode 0700; one that exists must be a real directory (not a link) owned by
this user. One that is wider is narrowed to 0700 where only this user could have made it so
(earlier versions made the data store 0755), and refused where another user could have put
something in it meanwhile (a directory in the shared temp dir). Files are made with
``O_EXCL | O_NOFOLLOW`` and mode 0600, so a file or link another user planted at the path is never
written through or trusted. Anything else is ``NotPrivate``, with the reason.
"""

import os
import stat

__all__ = ["NotPrivate", "private_dir", "open_private_dir", "private_file", "create_exclusive"]


class NotPrivate(PermissionError):
    """A path that another user could read or change."""


def _check(fd, path, kind, refuse_open=False):
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise NotPrivate(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if kind == "dir" and not stat.S_ISDIR(st.st_mode) or kind == "file" and not stat.S_ISREG(st.st_mode):
        raise NotPrivate(f"{path} is not a {'directory' if kind == 'dir' else 'regular file'}")
    if st.st_mode & 0o077:
        if refuse_open:
            raise NotPrivate(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, not 700): "
                             "not used, since another user could read or redirect what autopatch writes there")
        os.fchmod(fd, 0o700 if kind == "dir" else 0o600)
    return st


def open_private_dir(path, refuse_open=False):
    """A descriptor of ``path``, made (with missing parents) or checked: a directory of this user's
    with mode 0700. ``refuse_open``: one open to others is NotPrivate, not narrowed. The caller
    closes it; held open, the directory cannot be swapped for another while files are made in it."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent != path:
            os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if os.path.islink(path):
            raise NotPrivate(f"{path} is a symbolic link, not a directory of this user's: not used") from None
        raise NotPrivate(f"{path} is not a directory of this user's: {e}") from None
    try:
        _check(fd, path, "dir", refuse_open)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path):
    """``path`` as an absolute string, made (with missing parents) or checked: a directory of this
    user's with mode 0700."""
    os.close(open_private_dir(path))
    return os.path.abspath(os.fspath(path))


def private_file(path):
    """Check an existing file: a regular file of this user's, mode 0600 (narrowed if wider)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise NotPrivate(f"{path} cannot be opened as a file of this user's: {e}") from None
    try:
        _check(fd, path, "file")
    finally:
        os.close(fd)


def create_exclusive(path, data):
    """Write ``data`` to a new file at ``path`` (mode 0600); FileExistsError when anything is there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
