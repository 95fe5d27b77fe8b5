"""The knobs as this run sees them: which apply, their values now, and switching them.

Fusion knobs act on the optimizers autopatch fuses when the search starts, through the
controllers' ``set_mode`` / ``set_chunk_bytes`` (lossless between steps). The mode knob offers only
the modes every one of them allows once it has watched the run, and a mode the run later shows
it cannot use (a closure, gradient accumulation) is reported by ``newly_blocked``. Communication
knobs act on the bucketed allreduce when one is in charge of a multi-process run, through its
setters.
"""

import math

from .. import dist
from ..fusion.chunking import chunk_bytes_for

COMM_KNOBS = ("bucket_size_2p", "hierarchical", "compression")


def choosing_mode(session):
    """True while an optimizer is still watching or measuring the run to choose its mode."""
    return any(o.choosing for o in session.optimizers)


def exponent(nbytes):
    """log2 of a byte count: an int for powers of two, else the exact float (so it re-applies)."""
    e = math.log2(nbytes)
    return int(e) if e.is_integer() else e


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
        if knob in ("mode", "chunk_size_2p") and not self.controllers:
            return "no optimizer is fused in this run"
        if knob in COMM_KNOBS:
            if self.world == 1:
                return "single-process run"
            if self.comm is None or not self.comm.describe()["active"]:
                return "no bucketed allreduce is in charge of this run"
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
            self.applied["mode"] = self.controllers[0].mode

    def current(self, knobs):
        """The values in effect before any switch: the run's starting config."""
        fusion, allreduce = self.policy.fusion, self.policy.allreduce
        now = {}
        if "mode" in knobs:
            now["mode"] = self.controllers[0].mode
        if "chunk_size_2p" in knobs:
            now["chunk_size_2p"] = exponent(chunk_bytes_for(self.controllers[0].optimizer, fusion.chunk_bytes))
        sync = self.comm or allreduce     # the settings in effect, or the policy's before a takeover
        if "bucket_size_2p" in knobs:
            now["bucket_size_2p"] = exponent(sync.bucket_bytes)
        if "hierarchical" in knobs:
            now["hierarchical"] = bool(sync.hierarchical)
        if "compression" in knobs:
            now["compression"] = sync.compression
        self.applied = dict(now)
        return now

    def apply(self, config):
        """Switch to ``config`` (call between steps); knobs already at their value are untouched.

        Returns the modes in effect, which can differ from the one asked for when an optimizer
        cannot run it (the controller says so)."""
        changed = {k: v for k, v in config.items() if self.applied.get(k) != v}
        if "chunk_size_2p" in changed:
            for c in self.controllers:
                c.set_chunk_bytes(int(round(2 ** changed["chunk_size_2p"])))
        if "mode" in changed:
            for c in self.controllers:
                c.set_mode(changed["mode"])
        if "bucket_size_2p" in changed:
            self.comm.set_bucket_bytes(int(round(2 ** changed["bucket_size_2p"])))
        if "hierarchical" in changed:
            self.comm.set_hierarchical(changed["hierarchical"])
        if "compression" in changed:
            self.comm.set_compression(changed["compression"])
        self.applied.update(changed)
        return sorted({c.mode for c in self.controllers})
