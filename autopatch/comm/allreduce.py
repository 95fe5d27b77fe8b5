"""Bucketed, asynchronous gradient averaging over torch.distributed, re-bucketable between steps.

A synchronised backward:

1. Each parameter's post-accumulate-grad hook writes its gradient, times 1/world, into the
   parameter's view of its bucket's buffer for this step (one multiply, or an in-place scale when
   ``.grad`` already is that view, as after ``zero_grad(set_to_none=False)``) and makes the view
   its ``.grad``. Only those views keep a bucket's buffer once it is averaged (see buckets.py).
2. Once every gradient of a bucket is in, the bucket and any full ones after it are launched, in
   bucket order, with ``async_op=True`` while backward goes on.
3. An autograd-engine callback at the end of backward (DDP's own mechanism) launches what is left
   and waits, so ``backward()`` returns averaged gradients: clipping, GradScaler and gradient
   logging between backward and ``step()`` see what they see under DDP.
4. ``on_averaged(params)``, when given, hears of every bucket as soon as its average is final, so
   backward fusion can update those parameters at once. Later gradient hooks poll the buckets in
   flight, so a bucket that completes while backward goes on is handed over then; buckets whose
   reduction takes several collectives (8-bit compression, hierarchical) are only advanced at the
   end of backward, in bucket order, because advancing one earlier would issue its next collective
   out of the order every rank shares. With ``find_unused`` nothing is handed over before the
   used-parameter bitmap says which parameters any rank used.

The first synchronised backward only records the order gradients arrive in. Rank 0's order is
broadcast, the buckets are laid out in it, and that step is reduced at its end without
overlap. A layout is checked across ranks on the synchronised backward that first uses it (the
first, and the first after a knob is applied), by a small collective of its own at that step's
first gradient; later steps add no collective (layout_check.py). Ranks whose layouts differ raise
``LayoutMismatch`` and never issue mismatched collectives, on which gloo aborts the process.

Knobs for the autotuner: ``use(settings)`` swaps a whole ``SyncSettings`` in at the next
synchronised backward. Call them on every rank
between the same two steps (e.g. rank 0 decides and broadcasts, as Bagua does); a rank that
disagrees is caught by the checksum. A bucket-size change only moves slice boundaries.

Unused parameters follow DDP's rules: with ``find_unused`` a bitmap of the parameters used since
the last synchronised step is summed across ranks, and a parameter no rank used keeps its
``.grad`` as it was (``None`` stays ``None``); without it, a parameter with no gradient is an error,
as it is in DDP.
"""

import functools

import torch
import torch.distributed as dist

from ..torch_internals import at_backward_end
from .bucket_group import BucketGroup
from .buckets import GradientLayout
from .compression import checked
from .hierarchy import node_groups
from .layout_check import LayoutCheck
from .sync_owner import changes_results
from .used_params import UsedParameters, on_any_rank
from .waiting import Waiter


class BucketedAllreduce:
    """Averages the gradients of ``params`` over ``group`` in buckets of about ``bucket_bytes``."""

    def __init__(self, params, names, group, settings, *, timeout_seconds=None, find_unused=False,
                 on_averaged=None):
        """``settings``: a ``SyncSettings`` (bucket size, compression, hierarchical reduce)."""
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.world = dist.get_world_size(group)
        self.device = self.params[0].device
        self.find_unused = find_unused
        self.on_averaged = on_averaged
        self.buckets_handed_over_early = 0   # handed to on_averaged before backward's end
        self.waiter = Waiter(timeout_seconds, "allreduce", context=lambda: f"step {self.steps + 1}")
        self.settings = _checked(settings)
        self.nodes = node_groups() if settings.hierarchical else None   # NodeGroups while hierarchical
        self._next = None          # settings to swap in at the next synchronised backward
        self.layout = None
        self.buckets = None        # the BucketGroup of the layout and settings in effect
        self.check = LayoutCheck(group, self.world, dist.get_rank(group), self.device)
        self.steps = 0
        self.layouts = 0
        self._armed = False
        self.used = UsedParameters(len(self.params), group, self.device)   # as DDP counts them
        self._reset_step()
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]

    # -- knobs ------------------------------------------------------------------------------
    def use(self, settings):
        """Run with ``settings`` (a ``SyncSettings``, whole) from the next synchronised backward on."""
        self._next = _checked(settings)

    @property
    def next_settings(self):
        """The settings the next synchronised backward runs with."""
        return self._next or self.settings

    # -- the step ---------------------------------------------------------------------------
    def arm(self, sync):
        """A forward pass ran: its backward averages gradients when ``sync`` (DDP's own rule)."""
        if self._in_backward:   # the previous backward raised before its end-of-backward callback
            self._reset_step()
        self._armed = sync

    def _reset_step(self):
        n = len(self.params)
        self._in_backward = False
        self._first_order = []
        self.used.reset()                 # since the last synchronised backward
        self._contributed = [False] * n   # in this backward
        self.check.cancel()
        if self.buckets is not None:
            self.buckets.reset()
        self._listener_error = None

    def _on_grad(self, i, param):
        self.used.mark(i)
        if not self._armed:
            return
        if not self._in_backward:
            self._begin_backward()
        if self.layout is None:
            self._first_order.append(i)
            return
        if self._contributed[i]:
            raise RuntimeError(f"autopatch allreduce: parameter '{self.names[i]}' received a gradient "
                               "twice in one synchronised backward (reentrant checkpointing, or "
                               "backward through the same graph twice); DDP does not support this either")
        self._contribute(i)
        # launch when the next bucket is full, or see whether the layout check's header has arrived
        if self.buckets.arrived(i) or not self.check.passed:
            self._launch()
        if self.buckets.inflight and self.check.passed and self._hands_over_early():
            self.buckets_handed_over_early += self.buckets.poll(self.waiter, self._finish)

    def _begin_backward(self):
        self._in_backward = True
        at_backward_end(self._end_backward)
        if self._next is not None:
            self._apply_settings()
        if self.layout is not None:
            self.check.begin(self.buckets)

    def _apply_settings(self):
        self.settings, self._next = self._next, None
        if self.settings.hierarchical and self.nodes is None:
            self.nodes = node_groups()
        if self.layout is not None:
            self._relayout()

    def _contribute(self, i):
        buckets = self.buckets
        p, view = self.params[i], buckets.views(buckets.bucket_of[i])[buckets.position[i]]
        g = p.grad
        if g is view:
            view.mul_(1.0 / self.world)
        elif g is None:
            view.zero_()
        else:
            if g.is_sparse:
                raise RuntimeError(f"autopatch allreduce: parameter '{self.names[i]}' has a sparse "
                                   "gradient, which bucketed allreduce does not reduce")
            torch.mul(g, 1.0 / self.world, out=view)
            p.grad = view
        self._contributed[i] = True

    def _end_backward(self):
        try:
            if self.layout is None:
                self._first_layout()
            missing = self._contribute_the_rest()
            self._launch(rest=True)
            launched = self.used.launch_sum() if self.find_unused else None
            # Even when raising below, every wait happens: the other ranks' collectives must match.
            self.buckets.drain(self.waiter, None if missing or self.find_unused else self._finish)
            if missing:
                raise RuntimeError(
                    f"autopatch allreduce: {len(missing)} parameter(s) received no gradient in this "
                    f"step ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}). As with "
                    "DDP, a model with unused parameters needs DistributedDataParallel(..., "
                    "find_unused_parameters=True).")
            used = on_any_rank(launched, self.waiter)
            for b in range(len(self.buckets)):
                if not self.buckets.finished[b]:
                    self._finish(b, used)
            if self._listener_error is not None:
                raise self._listener_error
            self.steps += 1
        finally:
            self._armed = False
            self._reset_step()

    # -- layout -----------------------------------------------------------------------------
    def _first_layout(self):
        """Lay the buffers out in rank 0's arrival order; params that got no gradient go last."""
        seen = dict.fromkeys(self._first_order)
        rest = [i for i in reversed(range(len(self.params))) if i not in seen]
        order = torch.tensor([*seen, *rest], dtype=torch.int64, device=self.device)
        src = dist.get_global_rank(self.group, 0)
        self.waiter.wait(dist.broadcast(order, src=src, group=self.group, async_op=True),
                         "the broadcast of rank 0's gradient order")
        self.layout = GradientLayout(self.params, order.tolist())
        self._relayout()
        self.check.begin(self.buckets)

    def _relayout(self):
        self.buckets = BucketGroup(self.params, self.layout, self.settings, self.group, self.world, self.nodes)
        self.layouts += 1

    # -- launching ------------------------------------------------------------------------------
    def _launch(self, rest=False):
        """Launch what may go now, in bucket order (with ``rest``, everything: backward is over).
        While this step's layout check is open, no bucket goes before it has passed; a hook never
        waits for the check: a later hook, or the end of backward, launches the buckets held back."""
        buckets, check = self.buckets, self.check
        if not check.passed:
            if not (rest or check.completed()):
                return
            check.finish(self.waiter.wait)
        if rest:
            buckets.start_rest()
        else:
            buckets.start_full()

    # -- the end of a synchronised backward -------------------------------------------------------
    def _contribute_the_rest(self):
        """Parameters whose hook did not fire in this backward (unused, or used under no_sync).

        Returns the names of those that DDP would reject: no gradient at all, and no
        ``find_unused_parameters`` to say that is expected. They contribute zeros meanwhile.
        """
        missing = []
        for i, p in enumerate(self.params):
            if not self._contributed[i]:
                if p.grad is None and not self.used[i] and not self.find_unused:
                    missing.append(self.names[i])
                self._contribute(i)
        return missing

    def _hands_over_early(self):
        """Buckets can be handed over while backward runs: someone listens, no bitmap to await,
        and one collective per bucket (so completing one issues nothing out of order)."""
        return self.on_averaged is not None and not self.find_unused and self.buckets.averager.single_collective

    def _finish(self, b, used=None):
        """Bucket ``b`` is averaged: its parameters' ``.grad`` become their views of it (except,
        with ``find_unused``, those no rank used, which keep their ``.grad`` as DDP leaves it)."""
        views = self.buckets.take(b)
        done = []
        for i, view in zip(self.buckets.buckets[b].params, views):
            if used is None or used[i]:
                p = self.params[i]
                if p.grad is not view:
                    p.grad = view
                done.append(p)
        del views
        if done and self.on_averaged is not None and self._listener_error is None:
            try:
                self.on_averaged(done)
            except Exception as e:    # raised once every collective of this step is waited for
                self._listener_error = e

    @property
    def wait_seconds(self):
        """Seconds spent waiting for this model's collectives so far."""
        return self.waiter.seconds

    # -- report and removal -----------------------------------------------------------------------
    def describe(self):
        s = self.settings
        return {
            "params": len(self.params),
            "bucket_bytes": s.bucket_bytes,
            "buckets": 0 if self.buckets is None else len(self.buckets),
            "compression": s.compression,
            "hierarchical": s.hierarchical,
            "changes_results": changes_results(self.world, s.compression, s.hierarchical),
            "find_unused_parameters": self.find_unused,
            "synchronised_steps": self.steps,
            "bytes_sent_per_step": 0 if self.buckets is None else self.buckets.bytes_per_step,
            "wait_seconds": round(self.wait_seconds, 6),
            "wait_seconds_per_step": round(self.wait_seconds / self.steps, 6) if self.steps else 0.0,
            "layouts": self.layouts,
            "layout_checks": self.check.checks,
            "buckets_handed_over_early": self.buckets_handed_over_early,
        }

    def remove(self):
        self.on_averaged = None
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _checked(settings):
    if settings.bucket_bytes < 1:
        raise ValueError(f"bucket size must be a positive byte count, got {settings.bucket_bytes}")
    checked(settings.compression)
    return settings
