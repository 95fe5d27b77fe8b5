"""Where autopatch's work on a step is under way, so that enable() and disable() never land in it.

A fused step swaps flat chunks into an optimizer and back, mode backward updates chunks inside
backward, mode forward applies deferred updates in a module's forward. Patching or unpatching in
the middle of one of these (a toggle from another thread, or from a signal handler that
interrupted the step on its own thread) would leave a step half fused. So each runs as a
*region* (``enter()``/``leave()``, or ``with IN_FLIGHT:``) and a toggle runs only at a moment no
region is open:

- with none open on any thread it runs at once, and regions beginning meanwhile on other threads
  wait for it to finish;
- with regions open on other threads only, the caller waits for them to close, and their threads
  wait before opening new ones, so a training loop cannot starve it (bounded: past
  ``WAIT_SECONDS`` it warns and returns, and the toggle runs when the last region closes);
- with a region open on the caller's own thread (a signal handler interrupted it), waiting would
  never end: it returns at once and the toggle runs as that thread closes its last region, before
  control goes back to the code the handler interrupted.

Entering and leaving a region cost a list append and pop on a per-thread list and the read of one
flag; no lock is taken unless a toggle is pending. A region's token is None (a ``with`` block,
always closed) or an object whose ``live(frame)`` says whether it is still open on the stack that
ends in ``frame``: a step that raised never reached the hook that closes its region, and must not
hold toggles back.
"""

import contextlib
import sys
import threading
import time
import warnings

WAIT_SECONDS = 10.0
_POLL = 0.05          # a region left open by a step that raised is noticed this often


class StepsInFlight:
    def __init__(self):
        self.pending = False      # a toggle waits or runs: regions take the slow path
        self._cond = threading.Condition(threading.Lock())
        self._local = threading.local()      # .regions: this thread's open tokens; .busy
        self._threads = {}        # thread id -> its regions list (written by that thread only)
        self._runner = None       # the thread running a toggle, or waiting to run one
        self._work = None         # (settled, reconcile) of the latest toggle

    # -- regions: the fast path ---------------------------------------------------------------
    def enter(self, token=None):
        try:
            regions = self._local.regions
        except AttributeError:
            regions = self._register()
        regions.append(token)
        if self.pending:
            self._entering(regions, token)

    def leave(self, token=None):
        regions = self._local.regions
        if regions and regions[-1] is token:
            regions.pop()
        elif token in regions:
            regions.remove(token)     # a region of a step that raised lies above it
        if self.pending:
            self._left(regions)

    def __enter__(self):
        self.enter()

    def __exit__(self, *exc):
        self.leave()

    def forget(self, token):
        """Drop ``token`` from this thread's regions: its step raised and will never close it."""
        regions = getattr(self._local, "regions", ())
        if token in regions:
            regions.remove(token)

    # -- toggles --------------------------------------------------------------------------------
    def toggle(self, settled, reconcile):
        """Call ``reconcile()`` until ``settled()`` at a moment no region is open (see the module's
        docstring). True once settled; False when it was left to run as open regions close."""
        self._work = (settled, reconcile)
        self.pending = True
        if self._busy() or self._runner == threading.get_ident() or self._live_here():
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
                    if self._quiet(me):
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

    # -- the slow path ------------------------------------------------------------------------
    def _register(self):
        """This thread's regions list, made at its first region (no lock: a handler may come
        while the thread holds it)."""
        regions = self._local.regions = []
        self._threads[threading.get_ident()] = regions
        return regions

    def _entering(self, regions, token):
        """A toggle is pending: a thread with no other region open waits while another thread
        runs it or waits to run it (bounded, as the toggle is)."""
        me = threading.get_ident()
        if len(regions) > 1 or self._runner in (None, me) or self._busy():
            return
        with self._locked():
            regions.pop()
            self._cond.notify_all()
            deadline = time.monotonic() + WAIT_SECONDS
            while self._runner not in (None, me) and time.monotonic() < deadline:
                self._cond.wait(_POLL)
            regions.append(token)

    def _left(self, regions):
        """A toggle is pending: one waiting for this region looks again; one left to run as this
        thread's regions close runs now."""
        if self._busy():
            return
        with self._locked():
            self._cond.notify_all()
        if regions and self._live_here():
            return
        try:
            self._settle(wait=False)
        except Exception as e:        # the training goes on; the toggle's caller already returned
            warnings.warn(f"autopatch: enable()/disable() failed as a step ended: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)

    def _live_here(self):
        """This thread has a region open (dropping those of steps that raised)."""
        regions = getattr(self._local, "regions", None)
        if not regions:
            return False
        top = sys._getframe()
        regions[:] = [t for t in regions if t is None or t.live(top)]
        return bool(regions)

    def _quiet(self, me):
        """No other thread has a region open (those of steps that raised, or of threads that
        ended, do not count). Under the lock."""
        frames = None
        for tid, regions in list(self._threads.items()):
            if tid == me or not regions:
                continue
            if frames is None:
                frames = sys._current_frames()
            top = frames.get(tid)
            if top is None:
                del self._threads[tid]       # the thread ended
            elif any(t is None or t.live(top) for t in list(regions)):
                return False
        return True

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
