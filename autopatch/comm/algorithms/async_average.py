"""Asynchronous model averaging: a background thread averages the weights on a timer.

For the first ``warmup_steps`` optimizer steps gradients are averaged as usual
(``gradient_sync()`` is True). From then on each rank trains on its own gradients while a
background thread, every ``sync_interval_ms``, runs one round on a process group of its own (a
group shared with the training thread can interleave their collectives differently on different
ranks and hang):

1. agree on stopping: an allreduce MIN of each rank's "asked to stop" flag and of each rank's
   "leaving after an error" flag (negated, one slot per rank); the rounds end only once every
   rank has asked (``abort()``, ``close()``, exit, or ``destroy_process_group``), so a rank that
   finishes early keeps averaging with the others until they finish too, and no rank is left
   waiting on a collective nobody else will join. A rank whose script dies of an exception
   (``leave()``, at exit) does not wait for the others: it says so in its next agreement and
   goes; the others stop averaging and raise at their next training step, as DDP's next
   collective would. A rank that vanishes (killed) fails the next collective, to the same end;
2. copy the weights, allreduce SUM the copy, and add ``sum / n - copy`` to the weights, which
   keeps whatever local steps were taken meanwhile.

Once all have asked, a last round sets every rank's weights to their average, so after
``abort()`` or ``close()`` the ranks hold identical weights.

The training thread holds the weights still during forward and backward (autograd saved them)
and during the optimizer step (two threads adding to one tensor can lose an update); the
update waits for those to end, and a training step that is about to start waits for an update
that is ready. The thread's waits are bounded by the timeout, and it gives up (reporting why)
when a peer is gone or torch.distributed is shut down under it; ``shutdown.py`` makes sure that
happens before the interpreter or the process group goes away. A peer gone is raised by the
training thread's next forward or step (``PeerGone``), so that no rank trains on alone.
"""

import threading
import time

import torch
import torch.distributed as dist

from . import shutdown
from ..waiting import Waiter
from .base import Algorithm, BackwardEnd
from .flat_tensors import FlatTensors


class PeerGone(RuntimeError):
    """Another rank left the averaging after an error, or vanished: this rank stops training too."""


class AsyncModelAverage(Algorithm):
    name = "async"
    changes = ("after warm-up, ranks train on their own gradients and a background thread averages "
               "the weights every sync_interval_ms, so ranks may run different numbers of steps and "
               "their weights agree only after each averaging round; buffers (BatchNorm statistics) "
               "stay each rank's own")
    fusion_refusal = ("after warm-up no gradient is averaged, which an update inside backward waits for, "
                      "and an update deferred to the next forward would land after averaging rounds meant "
                      "to follow it")
    syncs_buffers = False     # a collective in every forward would tie the ranks' steps together
    steps_unevenly = True

    def __init__(self, params, group, *, peer_selection_mode="all", sync_interval_ms=500, warmup_steps=0,
                 timeout_seconds=None):
        super().__init__(params, group, timeout_seconds=timeout_seconds)
        self.peer_selection_mode = self.setting("peer_selection_mode", peer_selection_mode)
        self.sync_interval_ms = self.setting("sync_interval_ms", sync_interval_ms)
        self.warmup_steps = self.setting("warmup_steps", warmup_steps)
        self.thread_group = _own_group(group, self.waiter.timeout)
        self.groups = (group, self.thread_group)
        self.flat = FlatTensors(self.params, keep=True)
        self.background = Waiter(self.timeout, self.name)
        self.rounds = 0
        self.rounds_applied = 0
        self.rounds_dropped = 0      # updates that found the weights held for half the timeout
        self._cond = threading.Condition()
        self._held = False           # the training thread is in forward, backward or a step
        self._update_ready = False   # the background thread waits to update the weights
        self._stop = threading.Event()
        self._thread = None
        self._aborted = False        # by the user, until resume()
        self._leaving = False        # this rank is going away after an error: it waits for no one
        self._gone = None            # why the background averaging failed, for the training thread
        self._open = self.warmup_steps == 0    # this rank owes the others a stop agreement
        self._backward = BackwardEnd(self.params, self.after_backward)
        shutdown.register(self)

    def settings(self):
        return {"peer_selection_mode": self.peer_selection_mode, "sync_interval_ms": self.sync_interval_ms,
                "warmup_steps": self.warmup_steps}

    # -- the training thread's hooks ------------------------------------------------------------
    def gradient_sync(self):
        return self.steps < self.warmup_steps

    def before_forward(self, sync=True):
        self._raise_if_gone()
        if self._open and self._thread is None:
            self._start()
        if self._running():
            self._hold()
            self._backward.arm()

    def after_backward(self):
        self._release()

    def before_step(self):
        self._raise_if_gone()
        if self._running():
            self._hold()

    def after_step(self):
        super().after_step()
        self._release()
        if self.steps == self.warmup_steps and not self._aborted:
            self._open = True

    def _raise_if_gone(self):
        if self._gone is not None:
            raise PeerGone(f"autopatch {self.name} on rank {self.rank}: {self.error}") from self._gone

    def _running(self):
        return self._thread is not None and self._thread.is_alive()

    def _hold(self):
        with self._cond:
            if not self._held:
                start = time.perf_counter()
                self._cond.wait_for(lambda: not self._update_ready, timeout=self.timeout_seconds)
                self.waiter.waited(time.perf_counter() - start)
            self._held = True

    def _release(self):
        with self._cond:
            self._held = False
            self._cond.notify_all()

    # -- starting and stopping ------------------------------------------------------------------
    # Rounds run in epochs: one opens when warm-up ends or ``resume()`` follows an abort, and ends
    # with a stop agreement that every rank joins exactly once, from its running thread, or, for a
    # rank that never started one (it stopped training as warm-up ended), from ``abort``/``close``.
    def _start(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autopatch-async-average", daemon=True)
        self._thread.start()

    def abort(self):
        """Stop averaging; returns once every rank has asked to stop. Collective, idempotent."""
        self._aborted = True
        self._end_epoch()

    def resume(self):
        """Average again (from the end of warm-up) after ``abort()``. Collective, idempotent."""
        if not self._aborted or self.closed or self.error is not None:
            return
        self._aborted = False
        if self.steps >= self.warmup_steps:
            self._open = True
            self._start()

    def _end_epoch(self):
        if not self._open:
            return
        self._open = False
        if self.error is not None:
            return
        self._release()          # abort() and close() run outside forward, backward and step
        if self._thread is None:
            self._start()
        self._stop.set()
        self._thread.join()      # each collective is bounded; the rounds end once every rank has
        self._thread = None      # asked, or a peer failed

    def leave(self):
        """This rank is going away after an error: close without waiting for the others to stop.
        Its next stop agreement tells them, and their training raises ``PeerGone``."""
        self._leaving = True
        self.close()

    def close(self):
        """Stop averaging (agreed with the other ranks, as ``abort``) and unhook. Idempotent."""
        if self.closed:
            return
        self._aborted = True
        self._end_epoch()
        self.closed = True
        self._backward.remove()
        shutdown.unregister(self)

    # -- the background thread ------------------------------------------------------------------
    def _run(self):
        try:
            with torch.no_grad():
                while self._everyone_continues():
                    self._round()
                    self._stop.wait(self.sync_interval_ms / 1000)
                if not self._leaving:
                    self._round(last=True)
        except Exception as e:       # a peer is gone or the group was shut down: stop, say why
            self.error = f"background averaging stopped: {e}"
            if dist.is_initialized() and not self._leaving:
                self._gone = e       # not shut down here: a peer left or vanished
        finally:
            with self._cond:
                self._update_ready = False
                self._cond.notify_all()

    def _collective(self, work, what):
        self.background.wait(work, what, cancelled=lambda: not dist.is_initialized())

    def _everyone_continues(self):
        """False once every rank asked to stop, or this one is leaving; ``PeerGone`` when another
        is leaving after an error."""
        flags = torch.zeros(1 + self.world, dtype=torch.int32, device=self.params[0].device)
        flags[0] = int(self._stop.is_set())
        flags[1 + self.rank] = -int(self._leaving)
        self._collective(dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.thread_group, async_op=True),
                         "the stop agreement")
        gone = [r for r in range(self.world) if flags[1 + r] < 0 and r != self.rank]
        if gone and not self._leaving:
            raise PeerGone(f"rank(s) {gone} of its group left after an error")
        return not self._leaving and flags[0].item() == 0

    def _round(self, last=False):
        """One average. The last one, agreed by every rank, finds every training thread stopped
        in ``abort`` or ``close``: the weights become the average itself, identical everywhere."""
        copies = self.flat.gather()
        sums = [c.clone() for c in copies]
        for s in sums:
            self._collective(dist.all_reduce(s, group=self.thread_group, async_op=True), "a weight average")
        n = self.world
        self.bytes_sent += 2 * (n - 1) * 4 * (1 + n) // n + sum(2 * (n - 1) * s.numel() * s.element_size() // n for s in sums)
        self.rounds += 1
        for s in sums:
            s.div_(n)
        if last:
            self.flat.scatter(sums)
            return
        for s, c in zip(sums, copies):
            s.sub_(c)
        self._update(sums)

    def _update(self, deltas):
        with self._cond:
            self._update_ready = True
            free = self._cond.wait_for(lambda: not self._held, timeout=self.timeout_seconds / 2)
            if free:
                self.flat.add(deltas)
                self.rounds_applied += 1
            else:
                self.rounds_dropped += 1
            self._update_ready = False
            self._cond.notify_all()

    def describe(self):
        state = ("stopped: " + self.error if self.error else "closed" if self.closed
                 else "averaging" if self._running() else "aborted" if self._aborted
                 else "warm-up" if self.steps < self.warmup_steps else "starting at the next forward")
        return dict(super().describe(), state=state, averaging_rounds=self.rounds,
                    rounds_applied=self.rounds_applied, rounds_dropped=self.rounds_dropped,
                    background_wait_seconds=round(self.background.seconds, 6))


def _own_group(group, timeout):
    """A new group of ``group``'s ranks. Over the whole world every rank creates it, as
    ``new_group`` wants; for a smaller group only its members are here, so they synchronise
    among themselves (which hangs in torch 2.13 once an earlier group left some ranks out)."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks, timeout=timeout)
    return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
