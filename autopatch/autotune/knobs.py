"""The knobs as this run sees them: which apply, their values now, and switching them.

Each knob is a record of ``tunables.py``: the handles it lives on and the attribute it reads and
sets there. Fusion knobs act on the optimizers autopatch fuses when the search starts, through
their handles (``set_mode``, ``set_chunk_bytes``: lossless between steps); the mode knob offers
only the modes every one of them allows once it has watched the run, and a mode the run later
shows it cannot use (a closure, gradient accumulation) is reported by ``newly_blocked``.
Communication knobs act on the gradient sync (``session.allreduce``) when it is in charge of a
multi-process run.
"""

from .. import dist
from ..comm.sync_owner import why_not_bucket_search
from ..tunables import ALLREDUCE, KNOBS, OPTIMIZERS


def choosing_mode(session):
    """True while an optimizer is still watching or measuring the run to choose its mode."""
    return any(o.choosing for o in session.optimizers)


class RunKnobs:
    def __init__(self, session):
        self.policy = session.policy
        self.controllers = [o for o in session.optimizers if o.fusable and o.optimizer is not None]
        self.world = dist.world_size()
        self.comm = session.allreduce if self.world > 1 else None
        self.applied = {}
        self.ruled_out = {}     # mode -> why the mode knob does not offer it
        self._blocked = self._blocked_now()

    def why_not(self, knob):
        """Why a knob does not apply to this run, or None when it does."""
        target = KNOBS[knob].target
        if target == OPTIMIZERS and not self.controllers:
            return "no optimizer is fused in this run"
        if target == ALLREDUCE:
            if self.world == 1:
                return "single-process run"
            if self.comm is None or not self.comm.active:
                return "no bucketed allreduce is in charge of this run"
            if knob == "bucket_size_2p":
                return why_not_bucket_search(self.world, self.policy.fusion.exact)
        return None

    def bounds(self):
        """(knob -> bounds for the knobs that apply, knob -> reason for those left out)."""
        bounds, left_out = {}, {}
        for knob in self.policy.autotune.knobs:
            why = self.why_not(knob)
            if why:
                left_out[knob] = why
                continue
            bounds[knob] = self.policy.autotune.bounds_of(knob)
        if "mode" in bounds:
            bounds["mode"] = tuple(m for m in bounds["mode"] if self._allowed(m))
            if not bounds["mode"]:
                del bounds["mode"]
                left_out["mode"] = "no mode of its bounds is allowed for this run: " + "; ".join(
                    f"{m}: {why}" for m, why in self.ruled_out.items())
        return bounds, left_out

    def _allowed(self, mode):
        for c in self.controllers:
            why = c.why_not(mode)
            if why:
                self.ruled_out[mode] = f"{c.qualname}: {why}"
                return False
        return True

    def _blocked_now(self):
        return {m: f"{c.qualname}: {why}" for c in self.controllers for m, why in c.blocked.items()}

    def newly_blocked(self):
        """Modes the run showed unusable since the last call (mode -> why); they are left out
        of the mode knob from now on."""
        now = self._blocked_now()
        new = {m: why for m, why in now.items() if m not in self._blocked}
        self._blocked = now
        self.ruled_out.update(new)
        return new

    def resync(self):
        """A controller left a mode by itself: the mode in effect is its, not the last applied."""
        if "mode" in self.applied and self.controllers:
            self.applied["mode"] = KNOBS["mode"].read(self.controllers[0])

    def _handles(self, knob):
        return self.controllers if KNOBS[knob].target == OPTIMIZERS else [self.comm]

    def current(self, knobs):
        """The values in effect before any switch: the run's starting config. Before the gradient
        sync is taken over, its knobs read as the policy sets them."""
        now = {}
        for knob in knobs:
            handle = self._handles(knob)[0]
            now[knob] = KNOBS[knob].read(self.policy.allreduce if handle is None else handle)
        self.applied = dict(now)
        return now

    def apply(self, config):
        """Switch to ``config`` (call between steps); knobs already at their value are untouched,
        and the others change in the order ``tunables.KNOBS`` lists them (the chunk size before
        the mode, so a new mode plans its buffers once).

        Returns the modes in effect, which can differ from the one asked for when an optimizer
        cannot run it (its handle says so)."""
        changed = {k: v for k, v in config.items() if self.applied.get(k) != v}
        for knob in (k for k in KNOBS if k in changed):
            for handle in self._handles(knob):
                KNOBS[knob].apply(handle, changed[knob])
        self.applied.update(changed)
        return sorted({c.mode for c in self.controllers})
