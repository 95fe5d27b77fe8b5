"""One conformance case: a script run unpatched, then under one autopatch configuration, compared.

A case fails with every finding listed, each under a category ("weights differ", "torch function
modes on the stack after the last step()", ...), so one case shows every way it went wrong. Where
autopatch left the optimizer unpatched and said why, that is recorded (``UNPATCHED``), not failed:
the results must be identical all the same.
"""

import collections
import gc
import json
import os
import warnings
from dataclasses import dataclass, field

import pytest
import torch

from autopatch.modes.chooser import FIRST_STEP

from . import state
from .optim_cases import stable_hash, torch_rejects, torch_skip
from .scenarios import SCENARIOS, Ctx, applies, scenario_args

SHORT_STEPS = 3     # per phase: fewer than the default fusion.observe_steps (3) + 1
LONG_STEPS = 6      # per phase: enough for auto to watch one step, then race and switch modes
FAST_MARGIN = 4     # policy fast: allowed relative deviation = max_deviation x steps x FAST_MARGIN


@dataclass(frozen=True)
class Config:
    name: str
    policy: str = None
    overrides: tuple = ()           # (key, value) pairs for enable(); fusion values as tuples
    long: bool = False
    doc: str = ""

    @property
    def steps(self):
        return LONG_STEPS if self.long else SHORT_STEPS

    def kwargs(self):
        return {k: dict(v) if isinstance(v, tuple) else v for k, v in self.overrides}

    def enable(self, ap):
        return ap.enable(self.policy, **self.kwargs())

    def tolerance(self, session, steps):
        """None (bit for bit), or policy fast's bound: its fusion.max_deviation per step, over the
        steps the run took, with a margin for the few steps a deviation may grow over."""
        fusion = session.policy.fusion
        if getattr(fusion, "exact", "bitwise") == "bitwise":
            return None
        return fusion.max_deviation * max(steps, 1) * FAST_MARGIN


OBSERVE_ONE = ("fusion", (("observe_steps", 1),))
CONFIGS = {c.name: c for c in [
    Config("off", overrides=(("mode", "off"),), doc="intercept and report only"),
    Config("multi_layer", overrides=(("mode", "multi_layer"),)),
    Config("backward", overrides=(("mode", "backward"),), doc="multi_layer while the first 3 steps are watched"),
    Config("backward-observe1", overrides=(("mode", "backward"), OBSERVE_ONE), doc="backward once one step was watched"),
    Config("forward", overrides=(("mode", "forward"),)),
    Config("forward-observe1", overrides=(("mode", "forward"), OBSERVE_ONE)),
    Config("auto", doc="the default policy"),
    Config("auto-race", overrides=(("fusion", (("observe_steps", 1), ("measure_steps", 16))),), long=True,
           doc="auto racing off and every mode, switching between them"),
    Config("fast", policy="fast", long=True, doc="policy fast: fusion.exact rounding"),
]}

# The unpatched runs last used: a variant's scenario is checked in every configuration one after
# the other, and the configurations of one step count share the unpatched run.
_REFERENCES = {}
UNPATCHED = collections.Counter()     # (class, reason) -> cases where autopatch left it unpatched
FINDINGS_FILE = os.environ.get("CONFORMANCE_FINDINGS")    # JSON lines, one per failing case


@dataclass
class Case:
    variant: object
    scenario: str
    config: Config
    findings: list = field(default_factory=list)

    @property
    def id(self):
        return f"{self.variant.id}-{self.scenario}-{self.config.name}"

    def found(self, category, detail):
        self.findings.append((category, detail))


TORCH_DIR = os.path.dirname(torch.__file__)


def raised_by_torch(error):
    """True when ``error`` was raised inside torch (its innermost frame is torch's code)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(TORCH_DIR)


def _run(case, steps, inject=None, lr_factor=None):
    ctx = Ctx(case.variant, steps, inject=inject, lr_factor=lr_factor)
    args = scenario_args(case.scenario, case.variant)
    return SCENARIOS[case.scenario](ctx, **args)


def _compare(case, ref, got, tol, what):
    cmp = state.Comparison(tol)
    for label, params in ref.models.items():
        d = cmp.diff(params, got.models.get(label), f"{label} parameters")
        if d:
            case.found("weights differ", f"{what}: {d}")
    for label, raw in ref.raw_states.items():
        d = cmp.diff(raw, got.raw_states.get(label), f"{label}.state")
        if d:
            case.found("opt.state differs (read right after the last step())", f"{what}: {d}")
    for label, sd in ref.state_dicts.items():
        d = cmp.diff(sd, got.state_dicts.get(label), f"{label}.state_dict()")
        if d:
            case.found("state_dict() differs", f"{what}: {d}")
    if ref.checkpoint is not None:
        d = cmp.diff(ref.checkpoint, got.checkpoint, "mid-run checkpoint")
        if d:
            case.found("state_dict() differs", f"{what}: {d}")
    if ref.records != got.records:
        first = next(i for i, (a, b) in enumerate(zip(ref.records + [None], got.records + [None])) if a != b)
        case.found("what the script saw differs", f"{what}: at record {first}: {got.records[first:first + 1]} "
                                                  f"vs {ref.records[first:first + 1]} unpatched")
    if ref.hook_calls != got.hook_calls:
        extra = collections.Counter(got.hook_calls) - collections.Counter(ref.hook_calls)
        missing = collections.Counter(ref.hook_calls) - collections.Counter(got.hook_calls)
        case.found("hook calls differ", f"{what}: {len(got.hook_calls)} calls vs {len(ref.hook_calls)} unpatched; "
                                        f"extra {dict(extra)}, missing {dict(missing)}")
    return cmp.worst


STACKS = ("torch function modes on the stack", "torch dispatch modes on the stack")


def _leaks(case, before, now, when, only=None):
    for key, n in now.items():
        if n != before.get(key) and (only is None or key in only):
            case.found(f"{key} {when}", f"{before.get(key)} before, {n} {when}")


def _alive(case, refs, when):
    alive = [label for label, ref in refs if ref() is not None]
    if alive:
        case.found(f"optimizer not garbage-collectable {when}", f"{', '.join(alive)} still alive {when}")


def _grad_hooks(case, held, when):
    left = state.grad_hooks(held)
    if left:
        case.found(f"gradient hooks left on parameters {when}",
                   f"{sum(n for _, n in left)} hooks on {len(left)} of {len(held)} parameters {when}")


def _check_clean(before, out, what):
    """The unpatched run leaves nothing behind: else the script, not autopatch, is at fault."""
    gc.collect()
    assert state.global_state() == before, f"{what} changed torch's global state: the script is wrong"
    assert all(ref() is None for _, ref in out.refs), f"{what} keeps an optimizer alive: the script is wrong"
    assert not state.grad_hooks(out.held), f"{what} left gradient hooks: the script is wrong"


def _patched(case, steps, before, enabled, lr_factor, inject=None, what="patched run"):
    """Run the script under autopatch; check what it leaves while autopatch stays enabled.
    ``before``: torch's global state before enable(); ``enabled``: right after it (the runtime's
    one global step pre-hook, which takes in optimizers built before enable(), is no leak)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _run(case, steps, inject=inject, lr_factor=lr_factor)
    except Exception as e:
        case.found("patched run raised", f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        return None
    # Right after the last step() only the mode stacks are checked: mode forward's module pre-hook
    # and mode backward's gradient hooks belong to an optimizer that is still alive there.
    _leaks(case, before, got.after_last_step, "after the last step()", only=STACKS)
    for label in got.dropped_alive:
        case.found("optimizer not garbage-collectable after the script dropped it",
                   f"{what}: {label} alive right after del + gc.collect()")
    gc.collect()
    _alive(case, got.refs, "once the script returned")
    _leaks(case, enabled, state.global_state(), "once the script returned")
    _grad_hooks(case, got.held, "once the script returned")
    return got


# Reasons for "off" that are no refusal: the policy says off, auto is watching or racing right now.
TRANSIENT = ("policy sets fusion.mode: off", "auto: unpatched while watching", FIRST_STEP, "auto: racing")


def _record_report(case, report, record_property):
    modes = []
    for entry in report.get("optimizers", []):
        modes.append(f"{entry.get('class')}: {entry.get('mode')}")
        reason = entry.get("reason") or ""
        if entry.get("mode") == "off" and not reason.startswith(TRANSIENT) and case.config.name != "off":
            UNPATCHED[(entry.get("class"), reason.split(";")[0][:160])] += 1
    record_property("autopatch_modes", "; ".join(modes))


def run_case(case, ap, record_property):
    """The whole check of one case; returns it with its findings (``fail_on_findings`` fails the
    test from the test's own frame, so a failing case's report keeps none of its tensors alive)."""
    variant, config = case.variant, case.config
    why = applies(case.scenario, variant) or torch_rejects(variant)
    if why:
        pytest.skip(f"not a case: {why}")
    why = torch_skip(variant, case.scenario)
    if why:
        pytest.skip(why)
    steps = config.steps
    lr_factor = None
    if case.scenario == "hooks":
        lr_factor = 1.0 + (1 + stable_hash("lr", case.id) % 100003) * 2.0 ** -24

    keys, before, objects = state.hook_keys(), state.global_state(), state.patchable_objects()
    depth = before["torch function modes on the stack"]
    patched_checkpoint = tol = None
    try:
        key = (variant, case.scenario, steps, lr_factor)
        ref = _REFERENCES.get(key)
        if ref is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ref = _run(case, steps, lr_factor=lr_factor)
            except Exception as e:
                if not raised_by_torch(e):
                    raise       # the script's own error, not a combination torch refuses
                pytest.skip(f"torch rejects it unpatched: {type(e).__name__}: {e}"[:300])
            _check_clean(before, ref, "the unpatched run")
            _REFERENCES[key] = ref
            while len(_REFERENCES) > 2:
                _REFERENCES.pop(next(iter(_REFERENCES)))

        session = config.enable(ap)
        enabled = state.global_state()
        tol = config.tolerance(session, ref.steps)
        del session
        got = _patched(case, steps, before, enabled, lr_factor)
        refs, held = [], []
        if got is not None:
            _compare(case, ref, got, tol, "patched run")
            patched_checkpoint, refs, held = got.checkpoint, got.refs, got.held
        del got
        if case.scenario == "state_dict":
            cross = _patched(case, steps, before, enabled, lr_factor, inject=lambda own: ref.checkpoint,
                             what="patched run loading the unpatched checkpoint")
            if cross is not None:
                _compare(case, ref, cross, tol, "patched run loading the unpatched checkpoint")
            del cross
        _record_report(case, ap.report(), record_property)
        ap.disable()
        gc.collect()
        _leaks(case, before, state.global_state(), "after autopatch.disable()")
        _grad_hooks(case, held, "after autopatch.disable()")
        _alive(case, refs, "after autopatch.disable()")
        changed = state.changed_objects(objects)
        if changed:
            case.found("not restored by autopatch.disable()", ", ".join(changed[:8]))
    finally:
        ap.disable()
        state.restore_globals(keys, depth)
    if patched_checkpoint is not None:
        # autopatch is off again: an unpatched run loads the checkpoint the patched run saved
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = _run(case, steps, inject=lambda own: patched_checkpoint, lr_factor=lr_factor)
        except Exception as e:
            case.found("unpatched run cannot load the patched checkpoint", f"{type(e).__name__}: {e}"[:300])
        else:
            _compare(case, ref, back, tol, "unpatched run loading the patched checkpoint")
    return case


def fail_on_findings(case):
    if not case.findings:
        return
    if FINDINGS_FILE:
        with open(FINDINGS_FILE, "a") as f:
            f.write(json.dumps({"case": case.id, "optim": case.variant.optim, "variant": case.variant.id,
                                "scenario": case.scenario, "config": case.config.name,
                                "findings": case.findings}) + "\n")
    lines = [f"- {cat}: {detail}" for cat, detail in case.findings]
    pytest.fail(f"{case.id}: {len(case.findings)} finding(s)\n" + "\n".join(lines), pytrace=False)
