"""Hand the C heap's freed pages back to the system while chunk state moves into flat buffers.

On CPU a chunk is an L2 cache's worth of elements, under glibc's mmap threshold, so the state the
optimizer makes for each chunk on the first fused step lies on the C heap. Moved into a flat buffer
(mapped apart) and let go, it stays resident until the heap is trimmed: without a trim the process
holds the whole state twice for a moment (AdamW on an 80 MiB model peaked 160 MiB above
unpatched). glibc's ``malloc_trim`` returns free heap pages to the system; doing it after every
``BATCH`` bytes moved bounds that moment to ``BATCH`` at a few milliseconds a trim, once. Where
there is no glibc this does nothing.
"""

import ctypes

BATCH = 16 << 20


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


class HeapRelease:
    """``moved(nbytes)`` after letting go of a tensor whose contents were copied elsewhere; the
    heap is trimmed every ``BATCH`` bytes, and by ``done()`` for the rest."""

    def __init__(self):
        self.pending = 0

    def moved(self, nbytes):
        self.pending += nbytes
        if self.pending >= BATCH:
            self.done()

    def done(self):
        if self.pending and _TRIM is not None:
            _TRIM(0)
        self.pending = 0
