"""The active mode of one optimizer: the one holder of its strategy.

It builds the strategy for a mode (fusion/registry.py), switches between steps (the old one is
deactivated, which applies anything pending, and the next is built over the same per-parameter
state, so a switch never changes results), runs the strategy's work around each step under the
guard, and falls back to the unpatched step for good when autopatch itself fails there.
"""

import warnings

from .. import dist
from ..fusion import registry
from ..fusion.chunking import chunk_bytes_for
from ..fusion.param_swap import ParamSwap
from ..vocabulary import BACKWARD, FORWARD, MULTI_LAYER, OFF
from . import guard


class ActiveMode:
    def __init__(self, qualname, chunk_setting, forward_reads, averager, route_of, on_switch, on_fall_back,
                 shard_of=lambda: None):
        """``chunk_setting``: the policy's fusion.chunk_bytes; ``forward_reads``: tracks the
        strategies in mode forward (modes/forward_reads.py); ``averager(opt)``: across processes,
        what averages ``opt``'s gradients inside backward; ``route_of()``: how fused chunks are
        stepped (fusion/routes.py, chosen at the first step); ``shard_of()``: the collectives over
        the ranks sharing its state under multi_layer and backward, or None (unsharded); ``on_switch()`` after every
        activation; ``on_fall_back()`` once autopatch gave this optimizer up."""
        self.qualname = qualname
        self.chunk_setting = chunk_setting
        self.forward_reads = forward_reads
        self.averager = averager
        self.route_of = route_of
        self.shard_of = shard_of
        self.on_switch, self.on_fall_back = on_switch, on_fall_back
        self.mode = OFF
        self.reason = "not stepped yet"
        self.strategy = None
        self.chunk_bytes = None
        self.owned_storages = set()   # flat buffers built for this optimizer, by any mode
        self.final_fusion = None      # the last strategy's report, once it is gone
        self.fallen = False
        self._lists = None            # the user's params lists at step(), for a fallback
        self._shown = None            # the step's own lists, while the user's are shown

    def activate(self, opt, mode, reason, strict=False):
        """Leave the current mode (applying anything pending) and build ``mode``. The old one's
        buffers go with it; the params and the state stay where they lie and the next mode's plan
        adopts them in place. ``strict``: backward fusion raises on accumulation (the user named
        the mode) instead of stepping the rest unfused and saying so."""
        shards = None
        if self.strategy is not None:
            shard = self.shard_of() if mode in (MULTI_LAYER, BACKWARD) else None
            if shard is not None:       # sharded in both modes: the shards stay where they are
                shards = self.strategy.hand_over(shard)
            self.strategy.deactivate()
            self.forward_reads.untrack(self.strategy)
        self.strategy = None if mode == OFF else self._build(opt, mode, strict, shards)
        if mode == FORWARD:
            self.forward_reads.track(self.strategy)
        if self.strategy is not None:
            self.strategy.activated()     # backward: the gradient hooks armed before the next backward
        self.mode, self.reason = mode, reason
        self.on_switch()

    def explain(self, reason):
        """The mode stays; its reason changes."""
        self.reason = reason

    def _build(self, opt, mode, strict, shards=None):
        if self.chunk_bytes is None:
            self.chunk_bytes = chunk_bytes_for(opt, self.chunk_setting)
        averaged_by = self.averager(opt) if mode == BACKWARD and dist.world_size() > 1 else None
        shard = self.shard_of() if mode in (MULTI_LAYER, BACKWARD) else None
        return registry.build(mode, opt, self.chunk_bytes, owned_storages=self.owned_storages,
                              route=self.route_of(), averaged_by=averaged_by, strict=strict, shard=shard,
                              shards=shards)

    def chunk_bytes_in_use(self, opt):
        """What the strategy steps with, else what the next one would be asked for."""
        used = self.strategy.chunk_bytes_in_use() if self.strategy is not None else None
        if used:
            return used
        if self.chunk_bytes is None and opt is not None:
            return chunk_bytes_for(opt, self.chunk_setting)
        return self.chunk_bytes

    def set_chunk_bytes(self, chunk_bytes):
        """Change the chunk size; flat buffers are re-planned before the next update."""
        self.chunk_bytes = int(chunk_bytes)
        if self.strategy is not None:
            self.strategy.set_chunk_bytes(chunk_bytes)

    # -- around a step ----------------------------------------------------------------------------
    def before_step(self, opt, closure):
        """The strategy's ``before_step`` under the guard; returns the closure the optimizer should
        call instead, or None. The replacement runs the user's closure as the user's code and the
        swap-in that follows it under the guard."""
        self._lists = ParamSwap()
        self._lists.remember(opt.param_groups)
        marked = None if closure is None else guard.as_user_code(closure)
        replacement = None
        with guard.fallback(self, opt, "preparing the fused step"):
            replacement = self.strategy.before_step(marked)
        if replacement is None:
            return None

        def guarded():
            loss = None
            with guard.fallback(self, opt, "preparing the fused step"):
                loss = replacement()
            if self.fallen and loss is None:
                loss = marked()     # it failed before the user's closure ran: run it now, once
            return loss
        return guarded

    def after_step(self, opt):
        """The strategy's ``after_step`` under the guard. Returns (why fusion stopped inside this
        step, or None; whether part of this step's update had already run before ``step()``)."""
        strategy = self.strategy
        unsafe = strategy.unsafe
        differs = bool(unsafe) and strategy.updated_before_step()
        with guard.fallback(self, opt, "restoring the optimizer after the fused step"):
            strategy.after_step()
        self._lists = None
        return unsafe, differs

    def invalidate(self, opt):
        """A state was loaded: plan again."""
        if self.strategy is not None:
            with guard.fallback(self, opt, "re-planning after load_state_dict()"):
                self.strategy.invalidate()

    def flush(self):
        if self.strategy is not None:
            self.strategy.flush()

    def show_user_lists(self):
        """Inside a step, the user's params lists in place until ``hide_user_lists()``: the
        state is being read (``state_dict()``), and must read as unpatched."""
        if self._lists is not None and self._shown is None:
            self._shown = self._lists.show_saved()

    def hide_user_lists(self):
        shown, self._shown = self._shown, None
        if shown is not None:
            shown.restore()

    def packed_state(self, state_dict):
        """``state_dict()``'s result completed by the strategy (sharded state gathered), or None.
        Not under the guard: a whole state that cannot be gathered must never pass for one."""
        return None if self.strategy is None else self.strategy.packed_state(state_dict)

    # -- giving up ----------------------------------------------------------------------------------
    def fall_back(self, opt, where, error):
        """Put ``opt`` back as unpatched and keep it so, saying why."""
        what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")[:300]
        reason = f"fell back to the unpatched step: {where} failed ({what})"
        strategy, self.strategy = self.strategy, None
        self.forward_reads.untrack(strategy)
        fusion = {}
        if strategy is not None:
            try:
                strategy.deactivate()
            except Exception as e:
                reason += f"; putting the optimizer back also failed ({type(e).__name__})"
            try:
                fusion = strategy.describe()
            except Exception:
                fusion = {}
        if self._lists is not None:
            self._lists.restore()          # whatever the strategy managed to restore
            self._lists = None
        users = {id(p) for g in opt.param_groups for p in g["params"]}
        for key in [k for k in opt.state if id(k) not in users]:
            del opt.state[key]    # chunks' state left by a half-done swap (state_dict() could not pack it)
        self.final_fusion = dict(fusion, fallback={"where": where, "error": what})
        self.mode, self.reason = OFF, reason
        self.fallen = True
        self.on_fall_back()
        warnings.warn(f"autopatch: {self.qualname}: {reason}; FUSEDOPT_STRICT=1 raises it instead",
                      RuntimeWarning, stacklevel=2)

    def release(self, reason=None):
        """Apply anything pending and let the strategy go; its report stays. With ``reason`` the
        optimizer is reported unpatched from now on, and why (else as the mode that last ran)."""
        strategy, self.strategy = self.strategy, None   # applying may free the optimizer: forget()
        if strategy is not None:
            strategy.deactivate()
            self.final_fusion = strategy.describe()
            self.forward_reads.untrack(strategy)
        if reason is not None:
            self.mode, self.reason = OFF, reason

    def forget(self):
        """The optimizer was freed: keep what its strategy reports (and the mode that ran, for
        the report), let the strategy and its flat buffers, which hold the parameters, go;
        nothing is applied, there is nothing to apply to."""
        if self.strategy is not None:
            self.strategy.outlived()
            self.final_fusion = self.strategy.describe()
            self.forward_reads.untrack(self.strategy)
        self.strategy = None

    def describe(self):
        """The report's ``fusion`` entry, or None when nothing was ever fused."""
        return self.strategy.describe() if self.strategy is not None else self.final_fusion
