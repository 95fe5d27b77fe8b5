"""ModeChooser: the phases of choosing one optimizer's mode, driven step boundary by step
boundary on a real optimizer, without the rest of autopatch."""

import pytest
import torch

from autopatch import policy
from autopatch.modes.chooser import FIRST_STEP, MEASURING, NEW, SETTLED, STOPPED, WATCHING, ModeChooser
from autopatch.modes.eligibility import Eligibility
from autopatch.modes.watch import ACCUMULATION, CLOSURE
from autopatch.runtime.comm_view import CommView

QUALNAME = "torch.optim.adam.Adam"


def chooser(**fusion):
    pol = policy.load(None, overrides={f"fusion.{k}": v for k, v in fusion.items()})
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(4, 3))], lr=0.1)
    c = ModeChooser(QUALNAME, pol, Eligibility(QUALNAME, pol.fusion, CommView()))
    return c, opt


def step(opt):
    """One real iteration of the optimizer, for the watch to see."""
    p = opt.param_groups[0]["params"][0]
    (p * p).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_named_multi_layer_settles_at_the_first_step():
    c, opt = chooser(mode="multi_layer")
    assert c.phase == NEW and c.before_any_step() is None
    d = c.step_begins(opt, None, 1, "off")
    assert (d.mode, c.phase) == ("multi_layer", SETTLED) and "bit-for-bit" in d.reason
    assert c.step_ends(opt, 1, "multi_layer") is None and not c.choosing


def test_policy_off_or_a_forbidden_class_is_decided_before_any_step():
    c, _ = chooser(mode="off")
    assert c.before_any_step() == ("off", "policy sets fusion.mode: off", False, None)
    c, _ = chooser(mode="multi_layer", forbid=["Adam"])
    d = c.before_any_step()
    assert d.mode == "off" and "fusion.forbid" in d.reason and c.phase == SETTLED


def test_a_named_backward_runs_multi_layer_while_watching_then_backward_strictly():
    c, opt = chooser(mode="backward", observe_steps=2)
    d = c.step_begins(opt, None, 1, "off")
    assert (d.mode, c.phase) == ("multi_layer", WATCHING) and c.choosing
    decisions = []
    for n in range(1, 4):
        if n > 1:
            decisions.append(c.step_begins(opt, None, n, "multi_layer"))
        step(opt)
        decisions.append(c.step_ends(opt, n, "multi_layer"))
    chosen = [d for d in decisions if d is not None]
    assert len(chosen) == 1 and chosen[0].mode == "backward" and chosen[0].strict
    assert c.phase == SETTLED and "after watching 2 steps" in chosen[0].reason


def test_what_the_watch_sees_rules_a_named_mode_out():
    c, opt = chooser(mode="backward", observe_steps=1)
    c.step_begins(opt, None, 1, "off")
    p = opt.param_groups[0]["params"][0]
    (p * p).sum().backward()
    (p * p).sum().backward()          # two backward passes before one step: accumulation
    opt.step()
    opt.zero_grad()
    c.step_ends(opt, 1, "multi_layer")
    d = c.step_begins(opt, None, 2, "multi_layer")
    d = d or c.step_ends(opt, 2, "multi_layer")
    assert d.mode == "multi_layer" and ACCUMULATION in d.reason
    assert ACCUMULATION in c.eligibility.blocked["backward"]


def test_auto_leaves_the_first_step_unpatched_and_sets_nothing_up():
    """An optimizer that lives one step (a probe, a test) costs nothing: no watch, no race."""
    c, opt = chooser(observe_steps=1, auto_candidates=["multi_layer", "forward"])
    d = c.step_begins(opt, None, 1, "off")
    assert d.mode == "off" and d.reason == FIRST_STEP and c.phase == NEW and c.observation is None


def test_auto_without_watched_candidates_measures_from_the_second_step():
    c, opt = chooser(auto_candidates=["multi_layer"])
    assert c.step_begins(opt, None, 1, "off").reason == FIRST_STEP
    step(opt)
    c.step_ends(opt, 1, "off")
    assert c.step_begins(opt, None, 2, "off").mode in ("off", "multi_layer") and c.phase == MEASURING


def test_auto_watches_unpatched_then_measures_then_settles():
    c, opt = chooser(observe_steps=1, measure_steps=16, auto_candidates=["multi_layer", "forward"])
    assert c.step_begins(opt, None, 1, "off").reason == FIRST_STEP
    step(opt)
    c.step_ends(opt, 1, "off")
    assert c.step_begins(opt, None, 2, "off").mode == "off" and c.phase == WATCHING
    step(opt)
    assert c.step_ends(opt, 2, "off") is None     # the watched window is the iteration after a step
    c.step_begins(opt, None, 3, "off")
    step(opt)
    d = c.step_ends(opt, 3, "off")
    assert c.phase == MEASURING and d.mode in ("off", "multi_layer", "forward")
    current, n = d.mode, 3
    while c.phase == MEASURING:
        n += 1
        c.step_begins(opt, None, n, current)
        step(opt)
        d = c.step_ends(opt, n, current)
        if d is not None:
            current = d.mode
        assert n < 40, "the race outlived its budget"
    assert c.phase == SETTLED and current in ("off", "multi_layer", "forward") and d.measured is not None
    assert c.describe()["auto"]["chosen"] == current


def test_an_incident_leaves_the_mode_for_a_safe_one_and_stop_ends_the_choosing():
    c, opt = chooser(mode="backward", observe_steps=1)
    c.step_begins(opt, None, 1, "off")
    d = c.incident(("backward",), CLOSURE, 5, "backward")
    assert d.mode == "multi_layer" and "left backward for multi_layer at step 5" in d.reason
    assert c.describe()["incidents"][0]["what"] == CLOSURE
    c.stop("let go")
    assert c.phase == STOPPED and c.step_begins(opt, None, 6, "multi_layer") is None


@pytest.mark.parametrize("mode", ["multi_layer", "backward"])
def test_autotune_switching_is_remembered_as_such(mode):
    c, opt = chooser(mode=mode, observe_steps=1)
    c.step_begins(opt, None, 1, "off")
    c.switched_by_autotune()
    assert c.chosen_by == "autotune"
    d = c.incident(("backward",), CLOSURE, 3, "backward")
    assert d.mode == "off" and "autotune goes on without it" in d.reason
