"""The interface a DDP takeover drives for one model whose algorithm changes what travels.

One instance per DDP model, built on every rank of its group at the same point (constructors
may create process groups or exchange weights, so they are collectives). The takeover then calls,
on every rank:

- ``gradient_sync()`` before each training forward: should this step's backward average the
  gradients with the bucketed allreduce (``BucketedAllreduce.arm``)? True for the warm-up of
  ``async`` and ``qadam``, False whenever the algorithm exchanges weights or momentum instead.
- ``before_forward(sync)``: a training forward (grad enabled) is about to run; ``sync`` is DDP's
  ``require_backward_grad_sync`` (False inside ``no_sync()``, whose micro-batches must all see the
  same weights). The end of the backward that follows is found by the algorithm itself: its
  parameters' gradient hooks queue ``after_backward`` on the autograd engine, as DDP's reducer
  does. The takeover does not call ``after_backward``.
- ``before_step()`` / ``after_step()``: around each optimizer step over these parameters (the
  optimizer's step pre- and post-hooks). ``before_step`` is one addition to the interface:
  ``async`` holds the weights still during the step as well, so that its background update and
  the optimizer's never write the same tensor at once.
- ``describe()`` for the report, ``close()`` at the end. ``close`` is idempotent and raises
  nothing; it finishes what is in flight (every rank has the same), and for ``async`` returns
  once every rank has stopped averaging, or one has failed or gone.
- ``fits(optimizer, stepped)`` once per optimizer stepping these parameters (qadam continues
  Adam and AdamW only), ``stepped`` being the parameters its step updates (those flat chunks
  stand for, during a fused step), and, where ``takes_step_of(optimizer)``, ``step(optimizer)`` in place of the
  optimizer's own ``step()``, still between ``before_step`` and ``after_step`` (qadam once
  ``compressing``).

Every wait on a collective is bounded by ``timeout_seconds`` (default: the timeout the model's
process group was created with) and counted in ``wait_seconds``; bytes this rank sends are counted the way
``averager.py`` counts them.
"""

import datetime

import torch.distributed as dist

from ...policy import check_algorithm_setting
from ...torch_internals import at_backward_end, group_timeout
from ...vocabulary import MULTI_LAYER
from ..waiting import CommunicationError, Waiter


class BackwardEnd:
    """Queues ``callback`` on the autograd engine at the first gradient of the next backward.

    ``arm()`` after a forward; only the parameters' own hooks know that a backward through this
    model has begun, and the engine's callback runs once that whole backward is done.
    """

    def __init__(self, params, callback):
        self.callback = callback
        self.armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params
                       if p.requires_grad]

    def arm(self):
        self.armed = True

    def _on_grad(self, _param):
        if self.armed:
            self.armed = False
            at_backward_end(self.callback)

    def remove(self):
        self.armed = False
        for h in self._hooks:
            h.remove()
        self._hooks = []


def whole_number(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def quietly(fn):
    """Run ``fn`` for a shutdown that must not raise: its CommunicationError, as text, or None."""
    try:
        fn()
    except CommunicationError as e:
        return str(e)
    return None


class Algorithm:
    """What every algorithm answers; the defaults are those of plain synchronous training."""

    name = ""
    changes = ""
    # The fusion modes (besides off) that may update these parameters, and why not the others:
    # the algorithms that move weights do so at moments of their own, which an update inside
    # backward or one deferred to the next forward would cross (modes/eligibility.py asks).
    fusion_modes = (MULTI_LAYER,)
    fusion_refusal = ""
    # DDP broadcasts buffers (BatchNorm statistics) from rank 0 at each training forward, a
    # collective on the training thread; False leaves buffers local.
    syncs_buffers = True
    steps_unevenly = False   # ranks may run different numbers of steps (no collective ties them)

    def __init__(self, params, group, *, timeout_seconds=None):
        self.params = [p for p in params if p.is_floating_point()]
        if not self.params:
            raise ValueError(f"autopatch {self.name}: the model has no floating-point parameters")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = (group_timeout(group, self.params[0].device) if timeout_seconds is None
                        else datetime.timedelta(seconds=timeout_seconds))
        self.waiter = Waiter(self.timeout, self.name)
        self.timeout_seconds = self.timeout.total_seconds()
        self.steps = 0          # optimizer steps over these parameters (after_step calls)
        self.bytes_sent = 0
        self.closed = False
        self.error = None       # why communication stopped, when it failed

    def setting(self, key, value):
        """``value`` for the policy setting ``key`` of this algorithm, checked by its declaration
        (policy/settings.py), so a value means the same here as in a policy file."""
        return check_algorithm_setting(self.name, key, value, f"autopatch {self.name}")

    def gradient_sync(self):
        return False

    def before_forward(self, sync=True):
        pass

    def after_backward(self):
        pass

    def before_step(self):
        pass

    def after_step(self):
        self.steps += 1

    def settings(self):
        """The algorithm's settings, as the policy names them."""
        return {}

    def fits(self, optimizer, stepped):
        """Why this algorithm cannot go on with ``optimizer`` stepping its parameters, or None;
        asked once per optimizer, at its first step. ``stepped``: the parameters that step
        updates (the user's, also where flat chunks stand in for them)."""
        return None

    def takes_step_of(self, optimizer):
        """True when ``step(optimizer)`` replaces the optimizer's own step now."""
        return False

    def describe(self):
        return {
            "algorithm": self.name,
            "changes": self.changes,
            "settings": self.settings(),
            "steps": self.steps,
            "bytes_sent": self.bytes_sent,
            "bytes_sent_per_step": self.bytes_sent // self.steps if self.steps else 0,
            "wait_seconds": round(self.waiter.seconds, 6),
            **({"error": self.error} if self.error else {}),
            **({"closed": True} if self.closed else {}),
        }

    def close(self):
        self.closed = True
