"""Cache entries that say whether they are what this user wrote under this name.

An entry is ``MAGIC, stamp length, stamp, MAC, payload``. The stamp says which version of the
data the entry holds (the dataset's signature, and where it was loaded: ``CacheLoader``); the MAC
is HMAC-SHA256, truncated to 16 bytes, of the entry's name, its stamp and its payload under a key
derived from the user's key (``user_key``). Opening an entry gives its payload, ``STALE`` for
another version's (a plain miss), or ``DAMAGED`` for anything else: a flipped byte, a cut entry,
an entry moved to another name, one written by someone without the key.
"""

import hashlib
import hmac

__all__ = ["Seal", "STALE", "DAMAGED"]

MAGIC = b"ap\x01"
MAC_BYTES = 16
STALE, DAMAGED = "stale", "damaged"


class Seal:
    def __init__(self, key):
        self.key = key

    def _mac(self, name, head, payload):
        h = hmac.new(self.key, name + b"\0" + head, hashlib.sha256)
        h.update(payload)
        return h.digest()[:MAC_BYTES]

    def close(self, name, stamp, payload):
        """The entry for ``payload`` (bytes) under ``name`` (bytes) and ``stamp`` (bytes)."""
        head = MAGIC + bytes([len(stamp)]) + stamp
        return b"".join((head, self._mac(name, head, payload), payload))

    def open(self, name, stamp, entry):
        """The payload of ``entry`` as a memoryview, or STALE, or DAMAGED."""
        view = memoryview(entry)
        if len(view) < len(MAGIC) + 1 + MAC_BYTES or view[:len(MAGIC)] != MAGIC:
            return DAMAGED
        head_len = len(MAGIC) + 1 + view[len(MAGIC)]
        if len(view) < head_len + MAC_BYTES:
            return DAMAGED
        payload = view[head_len + MAC_BYTES:]
        mac = self._mac(name, bytes(view[:head_len]), payload)
        if not hmac.compare_digest(mac, view[head_len:head_len + MAC_BYTES]):
            return DAMAGED
        return payload if view[len(MAGIC) + 1:head_len] == stamp else STALE
