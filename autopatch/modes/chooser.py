"""Which mode runs one optimizer: an explicit machine of phases, each step boundary returning a
decision with its reason.

- ``new``: nothing decided. The first ``step()`` (under mode auto, the second: the first runs
  unpatched with nothing set up) probes the class, chooses how chunks are stepped (the route) and
  what runs meanwhile.
- ``watching``: backward and forward fusion are right for some training loops only, so neither
  runs before the first steps have been watched (modes/watch.py): a policy naming one of them
  gets multi_layer meanwhile, mode auto runs unpatched.
- ``measuring``: mode auto times off and every mode the run allows, in turns (modes/auto.py).
- ``settled``: a mode runs. The run is still watched for what would make it wrong (a closure
  appearing, accumulation starting): that mode is left for a safe one (an incident) and, under
  auto, measured again; so is a run that changed (a param group added, a state loaded).
- ``stopped``: autopatch gave the optimizer up (a failure of its own) or let it go: nothing more
  is decided.

Under ``fusion.shard`` an optimizer the probe accepts, in a job whose DDP models allow it, runs
``multi_layer`` over this rank's share of the state from its first step on (mode auto does not
leave its first steps unpatched then, which would make the whole state on every rank, nor
measure). Only a policy naming ``backward`` is watched: where every rank's watch allows it and
autopatch's allreduce averages the gradients, the shares are then updated inside backward.
Else ``shard_refusal`` says why not, and the rest runs as without the setting.

Autotune may also switch the mode at run time; ``chosen_by`` says who set the mode in effect.
"""

import sys
import weakref
from typing import NamedTuple, Optional

import torch

from .. import agreement, dist
from ..fusion.routes import choose as choose_route
from ..vocabulary import AUTO, BACKWARD, MULTI_LAYER, OFF, WATCHED_MODES
from .auto import AutoMode
from .watch import CLOSURE, Observation

NEW, WATCHING, MEASURING, SETTLED, STOPPED = "new", "watching", "measuring", "settled", "stopped"
# Mode auto sets nothing up before an optimizer's third step: one that lives for a step or two (a
# learning-rate finder's, a warm-up's, a test's, a throw-away copy) costs its adoption alone, where
# watching an iteration (every tensor operation on the parameters through Python) would cost more
# than the steps themselves on a small model (benchmarks/bench_short_lived.py).
UNWATCHED_STEPS = 2
FIRST_STEP = f"auto: unpatched for its first {UNWATCHED_STEPS} steps; watched from the next"


class Decision(NamedTuple):
    mode: str
    reason: str
    strict: bool = False               # backward fusion raises on accumulation (the user named it)
    measured: Optional[dict] = None    # mode auto's figures, when a measurement just ended


class ModeChooser:
    def __init__(self, qualname, policy, eligibility):
        self.qualname = qualname
        self.policy = policy
        self.fusion = policy.fusion
        self.eligibility = eligibility
        self.requested = self.fusion.mode
        self.auto = AutoMode(self.fusion) if self.requested == AUTO else None
        self.phase = NEW
        self.chosen_by = None         # who set the mode in effect: policy, auto or autotune
        self.route = None             # how fused chunks are stepped, chosen at the first step
        self.observation = None
        self.remeasure = None         # why auto measures again at the next step boundary
        self.groups = None            # param groups at the last step: one more means a re-plan
        self.incidents = []           # modes left mid-run because the run stopped suiting them
        self.shard = None             # fusion.shard granted: the collectives over the ranks sharing the state
        self.shard_refusal = "not stepped yet"    # fusion.shard asked, not granted: why not

    @property
    def decided(self):
        return self.phase != NEW

    @property
    def choosing(self):
        """True while the mode is still being chosen: watching, measuring, or about to measure."""
        return self.phase in (WATCHING, MEASURING) or self.remeasure is not None

    def before_any_step(self):
        """What the policy settles before the optimizer ever steps, or None."""
        why = None
        if not self.policy.optimizers.selects(self.qualname):
            why = "not selected by the policy's optimizers.include/exclude"
        elif self.requested == OFF:
            why = "policy sets fusion.mode: off"
            self.shard_refusal = why
        elif self.eligibility.forbidden():
            why = "class matches fusion.forbid in the policy"
        if why is None:
            return None
        self.phase = SETTLED
        return Decision(OFF, why)

    # -- step boundaries ----------------------------------------------------------------------------
    def step_begins(self, opt, closure, step, current):
        if self.phase == STOPPED:
            return None
        if self.observation is not None:
            self.observation.on_step(closure)
        if self.phase == NEW:
            if self.auto is not None and step <= UNWATCHED_STEPS and not self.fusion.shard:
                return Decision(OFF, FIRST_STEP)
            return self._first_step(opt, step, current)
        if self.observation is None and self.eligibility.fusable:
            return self._watch_run(opt, closure, step, current)
        return None

    def step_ends(self, opt, step, current):
        if self.phase == STOPPED:
            return None
        if self.observation is not None:
            if self.observation.done:
                return self._conclude(opt, step, current)
            self.observation.on_step_end()
        elif self.remeasure is not None:
            return self._measure(opt, self.remeasure, step, current)
        elif self.phase == MEASURING:
            return self._measuring(current)
        return None

    def _first_step(self, opt, step, current):
        self.phase = SETTLED   # the probe steps copies of this optimizer: never decide twice
        self.groups = len(opt.param_groups)
        why = self.eligibility.check(opt, MULTI_LAYER)
        if why:
            self.shard_refusal = f"left unfused: {why}"
            return Decision(OFF, f"left unfused: {why}")
        self.eligibility.accept()
        fusion = self.fusion
        self.route = choose_route(opt, fusion.exact, fusion.max_deviation, fusion.compile_budget_seconds)
        self.chosen_by = AUTO if self.auto else "policy"
        if fusion.shard and (sharded := self._sharded(opt)) is not None:
            return sharded
        wanted = set(self.auto.candidates if self.auto else (self.requested,)) | self._autotune_modes()
        if wanted & set(WATCHED_MODES):
            n = fusion.observe_steps
            self.observation = Observation(opt, n)
            self.phase = WATCHING
            if self.auto:
                return Decision(OFF, f"auto: unpatched while watching the first {n} steps")
            if self.requested in WATCHED_MODES:
                return Decision(MULTI_LAYER, f"{self.requested}: multi_layer while watching the first {n} steps")
            return Decision(MULTI_LAYER, self.probe_note())
        if self.auto:
            return self._auto_begin(opt, "from the first step", step, current)
        return Decision(MULTI_LAYER, self.probe_note())

    def _conclude(self, opt, step, current):
        """After watching: rule out what the run showed; a named mode is taken if allowed (else
        multi_layer), mode auto starts measuring."""
        obs, self.observation = self.observation, None
        obs.close()
        self.phase = SETTLED
        self.eligibility.watched_run(obs)
        if self.auto:
            return self._auto_begin(opt, f"after watching {obs.steps} steps", step, current)
        if self.requested not in WATCHED_MODES:
            return None                   # multi_layer named: the watch was for autotune
        ruled_out = []
        for mode in (self.requested, MULTI_LAYER):
            why = self.why_not(opt, mode)
            if mode == BACKWARD and self.shard is not None:
                why = self._everywhere(why)
            if why is None:
                detail = f" ({'; '.join(ruled_out)})" if ruled_out else ""
                if self.shard is not None:
                    detail += f"; optimizer state sharded over {self.shard.world} ranks (fusion.shard)"
                return Decision(mode, f"chose {mode} after watching {obs.steps} steps{detail}; "
                                      f"{self.probe_note()}", strict=True)
            ruled_out.append(f"not {mode}: {why}")
        return None

    def _sharded(self, opt):
        """multi_layer over this rank's share of the state, when the job allows it (backward named
        and allowed: while the first steps are watched); else None."""
        self.shard, why = self.eligibility.shard_exchange(opt)
        if self.shard is None:
            self.shard_refusal = why
            return None
        self.shard_refusal = None
        self.chosen_by = "policy"
        how = {AUTO: "auto runs multi_layer, the mode that shards it, without measuring",
               MULTI_LAYER: "multi_layer"}.get(self.requested, f"multi_layer: {self.requested} does not shard it")
        if self.requested == BACKWARD:
            why_not = self.eligibility.check(opt, BACKWARD) or self.why_not_sharded(BACKWARD)
            if why_not is None:
                n = self.fusion.observe_steps
                self.observation = Observation(opt, n)
                self.phase = WATCHING
                how = f"backward: multi_layer while watching the first {n} steps"
            else:
                how = f"multi_layer: backward cannot update shares inside backward here ({why_not})"
        return Decision(MULTI_LAYER, f"optimizer state sharded over {self.shard.world} ranks (fusion.shard): "
                                     f"{how}; {self.probe_note()}")

    def why_not(self, opt, mode):
        """None when this run may use ``mode`` now, else why not."""
        return self.eligibility.why_not(opt, mode) or self.why_not_sharded(mode)

    def why_not_sharded(self, mode):
        """With the state sharded, what rules ``mode`` out beyond the eligibility's checks: backward
        also needs what updating shares inside backward needs. None else."""
        if mode == BACKWARD and self.shard is not None:
            return self.shard.why_not_in_backward()
        return None

    def _everywhere(self, why):
        """Sharded ranks leave multi_layer together (a switch may gather the state, a collective,
        and every rank must step its share the same way): backward only where every rank's watch
        allows it."""
        try:
            verdicts = agreement.gather(f"sharded backward of {self.qualname}", why, self.shard.group)
        except Exception as e:
            return f"the ranks could not agree on it ({e})"
        return why or next((f"ruled out on another rank: {w}" for w in verdicts if w), None)

    # -- mode auto ----------------------------------------------------------------------------------
    def _autotune_modes(self):
        """The modes autotune may switch this optimizer to, when it tunes the mode."""
        tune = self.policy.autotune
        return set(tune.bounds_of("mode")) if tune.enabled and "mode" in tune.knobs else set()

    def _auto_measures(self):
        """Mode auto measures, unless autotune searches the mode itself."""
        return self.auto is not None and not self._autotune_modes() and self.shard is None

    def _auto_begin(self, opt, why, step, current):
        if self._auto_measures():
            return self._measure(opt, why, step, current)
        return Decision(OFF, "auto: autotune chooses the mode (autotune.knobs has mode), among "
                             f"those the run allows; unpatched until then ({why})")

    def _measure(self, opt, why, step, current):
        """Measure off and every mode auto may still use (every process agrees on which)."""
        self.remeasure = None
        self.chosen_by = AUTO
        self.phase = SETTLED
        if not self.auto.can_measure:
            keep = current if self.why_not(opt, current) is None else OFF
            return Decision(keep, f"auto kept {keep}: it has measured {len(self.auto.history)} "
                                  f"times in this run already ({why})")
        allowed, ruled_out = [], {}
        for mode in self.auto.candidates:
            reason = self.why_not(opt, mode)
            if reason:
                ruled_out[mode] = reason
            else:
                allowed.append(mode)
        agree = None
        group = self.eligibility.process_group(opt) if dist.world_size() > 1 else None
        if group is not None:       # a model several ranks train: they walk one schedule
            topic = f"mode auto of {self.qualname}"
            try:
                everywhere = agreement.gather(topic, allowed, group)
            except Exception as e:  # a rank that will not come: this one measures on its own
                everywhere = [allowed]
                why = f"{why}; measured on this rank alone ({e})"
            else:
                agree = self._agreeing(opt, topic, group)
            for mode in [m for m in allowed if not all(m in other for other in everywhere)]:
                allowed.remove(mode)
                ruled_out[mode] = "ruled out in another process"
        device = next((p.device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
        first = self.auto.start(allowed, ruled_out, why, step, device, agree, current=current)
        if first is None:
            return Decision(OFF, self.auto.reason())
        self.phase = MEASURING
        return Decision(first, self.auto.measuring_reason())

    def _agreeing(self, opt, topic, group):
        """Rank 0's decision on every rank of ``group``, while its ranks step together (they stop
        when the model enters a Join context: from then on each rank decides alone)."""
        opt_ref = weakref.ref(opt)

        def agree(decision):
            opt = opt_ref()
            if opt is None or self.eligibility.process_group(opt) is None:
                return decision
            return agreement.agree(topic, decision, group=group)
        return agree

    def _measuring(self, current):
        """A step boundary while measuring: switch as the schedule says, or to the choice."""
        try:
            mode = self.auto.boundary()
        except Exception as e:         # measuring must never break the run: unpatched instead
            self.auto.abandon(f"{type(e).__name__}: {e}")
            self.phase = SETTLED
            return Decision(OFF, self.auto.reason())
        if self.auto.race is not None:
            return Decision(mode, self.auto.measuring_reason()) if mode != current else None
        self.phase = SETTLED
        note = "" if mode == OFF else "; " + self.probe_note()
        return Decision(mode, self.auto.reason() + note, measured=self.auto.describe())

    # -- the run changing under a mode ----------------------------------------------------------------
    def _watch_run(self, opt, closure, step, current):
        """At each step() after the watch: what would make a mode wrong, or a measurement stale."""
        decision = None
        if closure is not None and not all(m in self.eligibility.blocked for m in WATCHED_MODES):
            decision = self.incident(WATCHED_MODES, CLOSURE, step, current)
        if len(opt.param_groups) != self.groups:
            self.groups = len(opt.param_groups)
            self.changed("a param group was added", step)
        return decision

    def switched_by_autotune(self):
        """Autotune set the mode in effect: the report says so, and an incident leaves for multi_layer."""
        self.chosen_by = "autotune"

    def changed(self, why, step):
        """The run changed (a re-plan): mode auto measures again at the next step boundary."""
        if (self._auto_measures() and self.phase in (SETTLED, MEASURING) and self.eligibility.fusable
                and self.observation is None):
            self.remeasure = f"{why} at step {step}"

    def incident(self, modes, what, step, current, differs=False):
        """The run just did something ``modes`` would get wrong: rule them out and, if one of
        them runs, leave it now (before a closure runs, or after a step: nothing is lost)."""
        new = self.eligibility.block(modes, what)
        running = current if current in modes else None
        race = self.auto.race if self.auto is not None else None
        if self._auto_measures() and (running or (race is not None and set(new) & set(race.alive))):
            self.remeasure = f"{what} at step {step}"
        if running is None:
            return None
        safe = MULTI_LAYER if self.chosen_by == "policy" else OFF
        self.incidents.append({"step": step, "left": running, "for": safe, "what": what,
                               "chosen_by": self.chosen_by, "update_differs": differs})
        if differs and sum(i["update_differs"] for i in self.incidents) == 1:
            print(f"autopatch: {self.qualname}: {what} at step {step} while mode {running} "
                  f"(chosen by {self.chosen_by}) ran: this step's update differs from unpatched, as "
                  f"part of it was already applied inside backward; switched to {safe}",
                  file=sys.stderr)
        then = {AUTO: "measuring again", "autotune": "autotune goes on without it"}.get(self.chosen_by)
        return Decision(safe, f"left {running} for {safe} at step {step}: {what}" + (f"; {then}" if then else ""))

    def stop(self, why):
        """No more choosing: autopatch gave this optimizer up, or let it go."""
        if self.observation is not None:
            self.observation.close()
            self.observation = None
        if self.phase == MEASURING:
            self.auto.abandon(why)
        self.remeasure = None
        self.phase = STOPPED

    def probe_note(self):
        return self.eligibility.probe_note(self.route)

    def describe(self):
        """The report's ``auto`` and ``incidents`` entries."""
        out = {}
        if self.auto is not None and self.eligibility.fusable:
            out["auto"] = self.auto.describe()
        if self.incidents:
            out["incidents"] = list(self.incidents)
        return out
