"""Where autopatch's work on a step is under way, so that enable() and disable() never land in it.

A fused step swaps flat chunks into an optimizer and back, mode backward updates chunks inside
backward, mode forward applies deferred updates in a module's forward. Patching or unpatching in
the middle of one of these (a toggle from another thread, or from a signal handler that
interrupted the step on its own thread) would leave a step half fused. So each runs as a
*region*, and a toggle runs only at a moment no region is open:

- with none open on any thread it runs at once, and regions beginning meanwhile on other threads
  wait for it to finish;
- with regions open on other threads only, the caller waits for them to close, and their threads
  wait at the start of their next one, so a training loop cannot starve it (bounded: past
  ``WAIT_SECONDS`` it warns and returns, and the toggle runs as the last region closes);
- with a region open on the caller's own thread (a signal handler interrupted it), waiting would
  never end: it returns at once and the toggle runs as that thread closes its last region, before
  control goes back to the code the handler interrupted.

A region is a frame on a thread's stack: a call of a function made one (``@IN_FLIGHT.region``) or
of a function whose frames count (``count_frames_of``: torch's step wrapper, from before the
step's hooks to after them). A toggle reads every thread's stack (its own from its frames, the
others' through ``thread_stacks.py``, which never touches their frames), so a step that raised, or
a thread that ended, holds nothing back. A region costs its thread the read of one flag as it
begins and one as it ends; locks and stacks are for the time a toggle is pending.
"""

import contextlib
import functools
import sys
import threading
import time
import warnings

from .thread_stacks import FunctionsOnStacks

WAIT_SECONDS = 10.0
_POLL = 0.05          # how often a waiting toggle reads the stacks again


class StepsInFlight:
    def __init__(self):
        self.pending = False      # a toggle waits or runs: regions beginning or ending look
        self._cond = threading.Condition(threading.Lock())
        self._local = threading.local()      # .busy: this thread holds (or takes) the lock
        self._codes = set()       # the code objects whose frames are regions
        self._elsewhere = FunctionsOnStacks()    # the same, as other threads' stacks show them
        self._parked = set()      # threads waiting at a region's start for a toggle to run
        self._runner = None       # the thread running a toggle, or waiting to run one
        self._work = None         # (settled, reconcile) of the latest toggle

    # -- regions ----------------------------------------------------------------------------------
    def region(self, function):
        """``function`` runs as a region."""
        @functools.wraps(function)
        def in_region(*args, **kwargs):
            if self.pending:
                self.entering()
            try:
                return function(*args, **kwargs)
            finally:
                if self.pending:
                    self.left()
        self.count_frames_of(in_region.__code__)
        return in_region

    def count_frames_of(self, code):
        """Frames running ``code`` are regions; the code that runs in them calls ``entering()``
        (when ``pending``) once it can wait for a toggle, and ``left()`` (when ``pending``) at
        its end."""
        if code not in self._codes:
            self._codes.add(code)
            self._elsewhere.add(code)

    def entering(self):
        """A toggle is pending as a region begins: with no other region open on this thread, wait
        while another thread runs it or waits to run it (bounded, as the toggle is)."""
        me = threading.get_ident()
        if self._runner in (None, me) or self._busy() or self._regions_here() > 1:
            return
        with self._locked():
            self._parked.add(me)
            self._cond.notify_all()
            deadline = time.monotonic() + WAIT_SECONDS
            while self._runner not in (None, me) and time.monotonic() < deadline:
                self._cond.wait(_POLL)
            self._parked.discard(me)

    def left(self):
        """A toggle is pending as a region ends: one waiting for it looks again, and one left to
        run as this thread's regions close runs now if this was the last."""
        if self._busy() or self._runner == threading.get_ident():
            return                    # a region inside the toggle that runs here
        with self._locked():
            self._cond.notify_all()
        if self._regions_here() > 1:
            return
        try:
            self._settle(wait=False)
        except Exception as e:        # the training goes on; the toggle's caller already returned
            warnings.warn(f"autopatch: enable()/disable() failed as a step ended: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)

    # -- toggles ----------------------------------------------------------------------------------
    def toggle(self, settled, reconcile):
        """Call ``reconcile()`` until ``settled()`` at a moment no region is open (see the module's
        docstring). True once settled; False when it was left to run as open regions close."""
        self._work = (settled, reconcile)
        self.pending = True
        if self._busy() or self._runner == threading.get_ident() or self._regions_here():
            return False
        return self._settle(wait=True)

    def _settle(self, wait):
        settled, reconcile = self._work
        while True:
            if not self._claim(settled, wait):
                return settled()
            try:
                while not settled():
                    reconcile()
            finally:
                with self._locked():
                    self._runner = None
                    self.pending = False
                    self._cond.notify_all()
            if settled():        # a handler's toggle that came while it ran sets it again
                return True
            self.pending = True

    def _claim(self, settled, wait):
        """Become the runner once no region is open on another thread; False when settled
        meanwhile, or not waiting, or past ``WAIT_SECONDS``."""
        me = threading.get_ident()
        deadline = time.monotonic() + WAIT_SECONDS
        with self._locked():
            while True:
                if self._runner is None:
                    if settled():
                        return False
                    self._runner = me
                    self.pending = True
                if self._runner == me:
                    if self._quiet():
                        return True
                    if not wait:
                        self._runner = None
                        self._cond.notify_all()
                        return False
                elif not wait:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    if self._runner == me:
                        self._runner = None
                        self._cond.notify_all()
                    warnings.warn(f"autopatch: a step is still in flight on another thread after "
                                  f"{WAIT_SECONDS:g} s; enable()/disable() takes effect when it ends",
                                  RuntimeWarning, stacklevel=4)
                    return False
                self._cond.wait(min(left, _POLL))

    # -- stacks -----------------------------------------------------------------------------------
    def _regions_here(self):
        """How many regions are open on this thread's stack."""
        n, frame = 0, sys._getframe(1)
        while frame is not None:
            n += frame.f_code in self._codes
            frame = frame.f_back
        return n

    def _quiet(self):
        """No region open on another thread but those parked at a region's start (a thread whose
        stack is too deep to read counts as open). Under the lock."""
        return not any(n and tid not in self._parked for tid, n in self._elsewhere.count_by_thread().items())

    def open_elsewhere(self):
        """True when a region is open on another thread (parked at its start or not)."""
        return any(self._elsewhere.count_by_thread().values())

    def _busy(self):
        return getattr(self._local, "busy", False)

    @contextlib.contextmanager
    def _locked(self):
        """The lock, with this thread marked busy from before it is taken to after it is let go:
        a signal handler's toggle meanwhile is left to run later instead of taking it again."""
        self._local.busy = True
        try:
            with self._cond:
                yield
        finally:
            self._local.busy = False


IN_FLIGHT = StepsInFlight()
