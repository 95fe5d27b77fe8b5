"""Which functions the other threads are in, read without touching their frames.

Walking another thread's frames (``sys._current_frames()`` and ``f_back``) from Python can crash
CPython 3.11 (a segmentation fault in ``PyFrame_GetBack`` while that thread pushes and pops
frames between two of the walker's bytecodes; the sampling profilers of Sentry and Datadog hit
the same), and can deadlock it against a ``threading.local`` being freed. ``faulthandler``
instead writes every thread's stack from C in one go, holding the interpreter's lock throughout:
the stacks are read from that text. It shows the innermost 100 frames of each thread and 100
threads; a thread with more frames, or one past those threads, is reported with its count unknown.
"""

import faulthandler
import os
import re
import tempfile
import threading

UNKNOWN = float("inf")      # a thread's stack went past what faulthandler shows

_HEADER = re.compile(r"(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'  File "(.*)", line (\S+) in (.*)')
_TRUNCATED = "  ..."           # a thread's frames past those shown
_MORE_THREADS = "..."          # threads past those shown


class FunctionsOnStacks:
    """Counts, per other thread, the frames running any of the functions given."""

    def __init__(self):
        self._where = {}            # (file, name) as faulthandler writes them -> their line numbers
        self._lock = threading.Lock()
        self._file = None
        self._pid = None            # the process the file was made in: a forked child makes its own

    def add(self, code):
        """Count the frames running ``code`` (matched by file, name and line, as written)."""
        lines = {line for _, _, line in code.co_lines() if line is not None} | {code.co_firstlineno}
        self._where.setdefault((_as_written(code.co_filename), _as_written(code.co_name)), set()).update(lines)

    def count_by_thread(self):
        """{thread ident: how many frames of the functions its stack holds (``UNKNOWN`` when its
        stack is deeper than shown and none were seen)} for every thread but the caller."""
        with self._lock:
            if self._pid != os.getpid():
                self._file, self._pid = _scratch_file(), os.getpid()
            self._file.seek(0)
            self._file.truncate()
            faulthandler.dump_traceback(self._file, all_threads=True)
            self._file.seek(0)
            text = self._file.read().decode("ascii", "replace")
        me, counts, tid, cut = threading.get_ident(), {}, None, False
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                tid = int(header.group(1), 16)
                counts[tid] = 0
            elif line == _MORE_THREADS:
                cut = True
            elif tid is None:
                continue
            elif line == _TRUNCATED:
                counts[tid] = counts[tid] or UNKNOWN
            else:
                frame = _FRAME.match(line)
                if frame and self._runs(*frame.groups()):
                    counts[tid] += 1
        if counts.get(me) is None:       # the text was cut short (the file could not take it)
            cut = True
        if cut:
            counts.update((t.ident, UNKNOWN) for t in threading.enumerate() if t.ident not in counts)
        counts.pop(me, None)
        return counts

    def _runs(self, file, line, name):
        lines = self._where.get((file, name))
        return lines is not None and (not line.isdigit() or int(line) in lines)


def _scratch_file():
    """A file in memory where the system has them (a full disk cannot cut the text short)."""
    if hasattr(os, "memfd_create"):
        return open(os.memfd_create("autopatch-stacks"), "w+b")
    return tempfile.TemporaryFile()


def _as_written(text):
    """``text`` as faulthandler writes it: ASCII as is, anything else escaped as Python escapes it
    (faulthandler escapes control characters too, which no file or function name here holds),
    cut at 500 characters."""
    return text[:500].encode("ascii", "backslashreplace").decode() + ("..." if len(text) > 500 else "")
