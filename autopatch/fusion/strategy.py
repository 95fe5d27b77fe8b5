"""The contract every fusion mode keeps, so the one that holds it never has to ask what it is.

A strategy runs one optimizer's steps in one mode. The active mode (modes/active.py) holds one at
a time and calls only these members; switching modes between steps deactivates one (applying
anything pending) and builds another over the same per-parameter optimizer state, so a switch
never changes results. Members that only some modes need have a default here that says "nothing
of the kind": only backward fusion updates before ``step()``, only forward fusion defers.
"""

import weakref
from typing import Protocol


class WeakOptimizer:
    """The ``opt`` of a strategy or planner, held weakly: autopatch keeps its strategies for the
    report, and must never keep a dropped optimizer (or, through it, its model) alive."""

    def __set_name__(self, owner, name):
        self.slot = f"_{name}_ref"

    def __get__(self, obj, objtype=None):
        return self if obj is None else obj.__dict__[self.slot]()

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = weakref.ref(value)


class NotFusable(RuntimeError):
    """The optimizer's state after a fused step has no per-parameter form."""


class Strategy(Protocol):
    def before_step(self, closure):
        """At ``step()``, before the optimizer's own body runs: prepare the fused step. Returns
        the closure the optimizer should call instead of ``closure``, or None."""

    def after_step(self):
        """After the optimizer's body: the user's params lists and per-parameter state are back."""

    def flush(self):
        """Apply anything pending and mirror fused state per parameter, so it can be read."""

    def invalidate(self):
        """Params or state were replaced from outside (a loaded checkpoint): plan again."""

    def deactivate(self):
        """This mode is left: apply everything; its buffers may go, the params and state stay."""

    def set_chunk_bytes(self, chunk_bytes):
        """Use chunks of about ``chunk_bytes`` from the next update on."""

    def activated(self):
        """Just built as the active mode, between two steps: get ready for the next backward."""

    def outlived(self):
        """Its optimizer was freed; the strategy goes next (nothing can be applied any more)."""

    def hand_over(self, exchange):
        """Before ``deactivate()``, when the next mode shards the state over ``exchange`` too:
        what it may take as it is (sharded_step.py's ``Shards``), or None to gather the state
        back as usual."""
        return None

    def describe(self):
        """The report's ``fusion`` entry: the plan's layout keys and this mode's counters."""

    def chunk_bytes_in_use(self):
        """The chunk size its steps use (after any cap and the memory bound), or None."""
        return None

    def packed_state(self, state_dict):
        """``state_dict()``'s result, once torch packed ``optimizer.state``: None when it is
        whole (only sharded state is gathered here, from every rank)."""
        return None

    # -- backward fusion: part of a step's update may run before step() ------------------------
    unsafe = None     # why fusion stopped inside this step (not strict): the caller leaves the mode

    def updated_before_step(self):
        """True when some of this step's update already ran (inside backward)."""
        return False

    # -- forward fusion: updates wait for their module's next forward -----------------------------
    def has_pending(self):
        return False

    def apply_for(self, module):
        """Apply the pending updates of ``module``'s own parameters (it is about to run)."""

    def holds_pending(self, param):
        return False

    def apply_param(self, param):
        """Apply the pending update of the chunk holding ``param`` (it is about to be read)."""


class PlannedStrategy(Strategy):
    """A strategy that steps the runs of a flat planner (``self.planner``, planner.py): whatever
    is pending is applied before the plan changes."""

    def invalidate(self):
        self.flush()
        self.planner.mark_stale()

    def set_chunk_bytes(self, chunk_bytes):
        self.flush()
        self.planner.set_chunk_bytes(chunk_bytes)

    def chunk_bytes_in_use(self):
        return self.planner.chunk_bytes_in_use
