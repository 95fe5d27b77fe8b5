"""Bagua's generic fused optimizer API, on modern PyTorch and on CPU.

``fuse_optimizer(opt)`` returns ``opt`` itself with a ``fuse_step()`` that runs the optimizer's own
``step()`` over a few flat chunks (the multi-layer fused update); ``step()`` keeps its ordinary
behaviour. Where Bagua went wrong this does not: a class whose update is not elementwise
(per-tensor norms, factored state) is caught by the fusability probe and stepped unfused with a
warning; gradients recreated by ``zero_grad(set_to_none=True)`` are gathered every step; a
parameter whose storage was replaced is flattened again instead of silently leaving fusion.

An optimizer given to ``fuse_optimizer`` is fused by its ``fuse_step()`` only: when
``autopatch.enable()`` is active, or becomes active later, the runtime's hooks are taken off that
optimizer (at ``fuse_optimizer`` and at every ``fuse_step()``), so no step is fused twice and
``step()`` stays the ordinary step; ``report()`` lists the optimizer as left to ``fuse_step()``.
"""

import warnings

import autopatch
from ..fusion.chunking import default_chunk_bytes
from ..fusion.multi_layer import MultiLayerStep
from ..fusion.param_swap import then
from ..fusion.planner import FlatPlanner
from ..fusion.fusability import probe

LEFT_TO_FUSE_STEP = "fused by its own fuse_step() (autopatch.contrib.fuse_optimizer); the runtime leaves it alone"


def fuse_optimizer(optimizer, do_flatten=True, check_flatten=True):
    """Give ``optimizer`` a ``fuse_step(closure=None)`` method and return the same object.

    ``do_flatten=True`` moves the parameters (and any optimizer state) into contiguous flat
    buffers now; gradients follow at the first ``fuse_step()`` (a parameter that never gets a
    gradient must keep ``grad=None``, or the optimizer would step it). ``do_flatten=False``
    never moves a parameter: ``fuse_step()`` fuses only parameters that already lie back to back
    in one storage and steps the others one by one. ``check_flatten=True`` (with ``do_flatten``)
    flattens a parameter again when its storage was replaced (``param.data = ...``,
    ``model.to(...)``); with ``False`` such a parameter is stepped unfused from then on. A moved
    parameter is always detected, whatever the flags: they choose only whether it moves again.

    Calling it again on a fused optimizer returns it unchanged.
    """
    if not is_fused_optimizer(optimizer):
        fused = _FusedOptimizer(optimizer, do_flatten, check_flatten)
        optimizer.fuse_step = fused.fuse_step
    return optimizer


def fuse_step(optimizer, closure=None):
    """Bagua's function form of ``optimizer.fuse_step(closure)``."""
    if not is_fused_optimizer(optimizer):
        raise TypeError(f"{type(optimizer).__qualname__} is not fused: call fuse_optimizer(optimizer) first")
    return optimizer.fuse_step(closure)


def is_fused_optimizer(optimizer):
    """True for an optimizer returned by ``fuse_optimizer``."""
    return isinstance(getattr(getattr(optimizer, "fuse_step", None), "__self__", None), _FusedOptimizer)


class _FusedOptimizer:
    """What ``fuse_step`` needs: the probe's verdict, the flat step and the runtime hand-off.

    Only a bound method of this object is stored on the optimizer, so copies of the optimizer
    (the probe's, ``copy.deepcopy``) never carry the flat buffers along.
    """

    def __init__(self, opt, do_flatten, check_flatten):
        self.opt = opt
        # Runs already back to back (a buffer the user, or the runtime before us, built) are
        # stepped where they lie; with do_flatten the other parameters move into flat buffers.
        self.planner = FlatPlanner(opt, default_chunk_bytes(opt), adopt_back_to_back=True,
                                   moves_params=do_flatten)
        self.flat = MultiLayerStep(opt, self.planner.chunk_bytes, planner=self.planner)
        self.probed_groups = 0
        self.unfusable = None     # the probe's reason, once a param group failed it
        self.warned = False
        self.fusing = False
        # Scalar state (Adam's step) lives in the chunks between fused steps: an ordinary step()
        # or a loaded checkpoint moves the per-parameter state on, so the chunks are rebuilt.
        self._handles = [opt.register_step_post_hook(self._after_step),
                         opt.register_load_state_dict_post_hook(lambda _: self.flat.invalidate())]
        self._probe_new_groups()
        self._take_from_session()
        if do_flatten and self.unfusable is None:
            self.planner.plan()
        if not check_flatten:
            self.planner.stop_moving()

    def fuse_step(self, closure=None):
        """Perform a fused parameter update; a plain ``step()`` where fusing would change results.

        ``closure`` re-evaluates the model and returns the loss, as for ``step()``.
        """
        opt = self.opt
        self._probe_new_groups()
        self._take_from_session()
        if self.unfusable is not None:
            if not self.warned:
                self.warned = True
                warnings.warn(f"fuse_step(): {type(opt).__qualname__} is stepped unfused: {self.unfusable}",
                              RuntimeWarning, stacklevel=2)
            return opt.step() if closure is None else opt.step(closure)
        flat = self.flat
        if closure is None:
            flat.swap_in()
            args = ()
        else:
            args = (then(closure, flat.swap_in),)
        self.fusing = True
        try:
            return opt.step(*args)   # the instance's step: LR schedulers' and hooks' wrappers run
        finally:
            self.fusing = False
            flat.restore()

    def _after_step(self, opt, args, kwargs):
        if not self.fusing:
            self.flat.invalidate()

    def _probe_new_groups(self):
        """Probe each param group once, including groups added after ``fuse_optimizer``."""
        groups = self.opt.param_groups
        while self.unfusable is None and self.probed_groups < len(groups):
            group = groups[self.probed_groups]
            self.probed_groups += 1
            if any(p.dtype.is_floating_point for p in group["params"]):
                result = probe(self.opt, group)
                if not result.fusable:
                    self.unfusable = result.reason

    def _take_from_session(self):
        """An enabled session also hooks this optimizer's step(): take its hooks off, so that a
        fuse_step() is fused once, by us, and step() stays the ordinary step."""
        session = autopatch.session()
        if session is not None:
            session.leave(self.opt, LEFT_TO_FUSE_STEP)
