"""This user's secret for the sample cache, and what is derived from it.

The key is 32 random bytes in ``$XDG_CACHE_HOME/autopatch/key`` (``~/.cache``): a 0600 file in a
0700 directory (``private_files``), never in a command line, an environment or the process
group's store. It authenticates every cache entry (``entry_seal``), and the password of the Redis
servers autopatch starts is derived from it, so ranks find it without anything being sent. Every
rank of this user reads the same file: ranks on nodes that share the home directory agree; where
they do not, ``fingerprint`` differs and the cache stays off (see ``redis_store``).

The first process to need the key writes it to a file of its own and links it into place, so ranks
starting together end with one key.
"""

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from ...private_files import NotPrivate, create_exclusive, private_dir, private_file

__all__ = ["user_key", "derived", "fingerprint", "cache_root", "KeyUnusable"]

KEY_BYTES = 32
_keys = {}   # key file -> its bytes, read once per process


class KeyUnusable(RuntimeError):
    """The key file cannot be made or trusted."""


def cache_root():
    """``$XDG_CACHE_HOME/autopatch`` (``~/.cache/autopatch``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autopatch"


def user_key():
    """This user's 32-byte key, made on first use. KeyUnusable with the reason otherwise."""
    try:
        root = private_dir(cache_root())
    except OSError as e:
        raise KeyUnusable(f"no private directory for the cache's key: {e}") from None
    path = os.path.join(root, "key")
    known = _keys.get(path)
    if known is None:
        known = _keys[path] = _read_or_make(path)
    return known


def _read_or_make(path):
    try:
        try:
            private_file(path)
        except FileNotFoundError:
            own = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
            create_exclusive(own, secrets.token_bytes(KEY_BYTES))
            try:
                os.link(own, path)   # fails if another process linked its key first: that one counts
            except FileExistsError:
                pass
            finally:
                os.unlink(own)
            private_file(path)
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
            key = f.read(KEY_BYTES + 1)
    except NotPrivate as e:
        raise KeyUnusable(str(e)) from None
    except OSError as e:
        raise KeyUnusable(f"the cache's key {path} cannot be made or read: {e}") from None
    if len(key) != KEY_BYTES:
        raise KeyUnusable(f"the cache's key {path} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def derived(purpose):
    """A 32-byte secret for ``purpose`` (``"entries"``, ``"redis password"``) from the user's key."""
    return hmac.digest(user_key(), b"autopatch " + purpose.encode(), hashlib.sha256)


def fingerprint():
    """What ranks compare to find out whether they hold the same key (reveals nothing of it)."""
    return derived("fingerprint")[:16].hex()
