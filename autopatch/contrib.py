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
from .fusion.chunking import default_chunk_bytes
from .fusion.eligibility import foreign_memory
from .fusion.flat import FlatRun, state_signature
from .fusion.multi_layer import MultiLayerStep, _GroupPlan, unfusable_param
from .fusion.probe import probe

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]

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
        self.flat = _FlatStep(opt, default_chunk_bytes(opt), move_params=do_flatten)
        self.probed_groups = 0
        self.unfusable = None     # the probe's reason, once a param group failed it
        self.warned = False
        self.released = None      # the runtime controller whose hooks were taken off
        self.fusing = False
        # Scalar state (Adam's step) lives in the chunks between fused steps: an ordinary step()
        # or a loaded checkpoint moves the per-parameter state on, so the chunks are rebuilt.
        self._handles = [opt.register_step_post_hook(self._after_step),
                         opt.register_load_state_dict_post_hook(lambda _: self.flat.invalidate())]
        self._probe_new_groups()
        self._take_from_runtime()
        if do_flatten and self.unfusable is None:
            self.flat.plan()
        self.flat.move_params = do_flatten and check_flatten

    def fuse_step(self, closure=None):
        """Perform a fused parameter update; a plain ``step()`` where fusing would change results.

        ``closure`` re-evaluates the model and returns the loss, as for ``step()``.
        """
        opt = self.opt
        self._probe_new_groups()
        self._take_from_runtime()
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
            def closure_then_fuse():
                # The closure computes the grads: gather them once they exist, before the update.
                loss = closure()
                flat.swap_in()
                return loss
            args = (closure_then_fuse,)
        self.fusing = True
        try:
            return opt.step(*args)   # the instance's step: LR schedulers' and hooks' wrappers run
        finally:
            self.fusing = False
            if flat.swapped:
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

    def _take_from_runtime(self):
        """An enabled runtime also hooks this optimizer's step(): take its hooks off, so that a
        fuse_step() is fused once, by us, and step() stays the ordinary step."""
        runtime = autopatch._runtime
        if runtime is None:
            return
        for ctrl in runtime.controllers:
            if ctrl.ref() is self.opt and ctrl is not self.released:
                ctrl.release()
                ctrl.mode, ctrl.reason = "off", LEFT_TO_FUSE_STEP
                self.released = ctrl


class _FlatStep(MultiLayerStep):
    """The multi-layer step, planned so that parameters already back to back stay where they are.

    ``move_params=True``: as ``MultiLayerStep``, which moves each parameter owning its storage into
    a new flat buffer; runs already back to back in one storage (a buffer the user, or the runtime
    before us, built) are adopted as flat buffers of ours rather than left out.
    ``move_params=False``: only such runs are fused, and no parameter is ever moved.
    """

    def __init__(self, opt, chunk_bytes, move_params):
        super().__init__(opt, chunk_bytes)
        self.move_params = move_params

    def plan(self):
        runs, why_not = self._runs_in_place()
        if self.move_params:
            self.owned.update(ptr for ptr, _, _ in runs)
            super().plan()
            return
        self.restore()
        plans = [_GroupPlan(g) for g in self.opt.param_groups]
        for _, gi, run in runs:
            params = [p for p, _ in run]
            states = [self.opt.state[p] for p in params] if run[0][1] else None
            elems = max(1, self.chunk_bytes // params[0].element_size())
            plans[gi].runs.append(FlatRun(params, states, elems, **self.run_options))
        fused = {id(p) for _, _, run in runs for p, _ in run}
        self.excluded = {}
        for plan, group in zip(plans, self.opt.param_groups):
            for p in group["params"]:
                if id(p) not in fused:
                    plan.rest.append(p)
                    why = why_not.get(id(p), "not back to back with another parameter (do_flatten=False)")
                    self.excluded[why] = self.excluded.get(why, 0) + 1
        self.plans = plans
        self.dirty = False
        self.replans += 1

    def _runs_in_place(self):
        """Runs of two or more parameters of one group already back to back in one storage, as
        [(storage ptr, group index, [(param, state signature)])], and {id(param): why not}."""
        groups = self.opt.param_groups
        why_not, shared = _overlapping(groups)
        runs = []
        for gi, group in enumerate(groups):
            candidates = []
            for p in group["params"]:
                why = why_not.get(id(p)) or unfusable_param(p)
                sig = None if why else state_signature(p, self.opt.state.get(p, {}))
                if why is None and sig is None:
                    why = "optimizer state is not elementwise"
                if why:
                    why_not[id(p)] = why
                else:
                    candidates.append((p, sig))
            runs += [(ptr, gi, run) for ptr, run in _back_to_back(candidates)
                     if len(run) > 1 and ptr not in shared]
        return runs, why_not


def _overlapping(groups):
    """Parameters whose memory overlaps another's, as {id(param): reason}, and their storages:
    such storages are never adopted, as moving one of those parameters would split an alias."""
    spans = []   # (storage ptr, first byte, bytes spanned, param)
    for g in groups:
        for p in g["params"]:
            if p.numel() and not foreign_memory(p):   # never read a storage that is not there
                elems = 1 + sum((n - 1) * s for n, s in zip(p.shape, p.stride()))
                size = p.element_size()
                spans.append((p.untyped_storage().data_ptr(), p.storage_offset() * size, elems * size, p))
    spans.sort(key=lambda s: s[:3])
    out, storages, last = {}, set(), None   # last: (ptr, end, param) of the span reaching furthest so far
    for ptr, start, extent, p in spans:
        if last is not None and last[0] == ptr and start < last[1]:
            out[id(p)] = out[id(last[2])] = "overlaps another parameter's memory"
            storages.add(ptr)
        if last is None or last[0] != ptr or start + extent > last[1]:
            last = (ptr, start + extent, p)
    return out, storages


def _back_to_back(candidates):
    """Split ``[(param, sig)]`` into maximal runs, in storage order, of contiguous parameters
    that follow each other in one storage with equal dtype and state signature."""
    runs = []   # [ptr, end offset or None when it cannot grow, dtype, sig, [(param, sig)]]
    key = lambda c: (c[0].untyped_storage().data_ptr(), c[0].storage_offset())
    for p, sig in sorted(candidates, key=key):
        ptr, start = key((p, sig))
        r = runs[-1] if runs else None
        if (r is not None and r[0] == ptr and r[1] == start and r[2] == p.dtype and r[3] == sig
                and p.is_contiguous()):
            r[1] += p.numel()
            r[4].append((p, sig))
        else:
            runs.append([ptr, start + p.numel() if p.is_contiguous() else None, p.dtype, sig, [(p, sig)]])
    return [(r[0], r[4]) for r in runs]
