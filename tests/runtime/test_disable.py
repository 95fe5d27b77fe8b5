"""disable(): every replaced object is the original again, every hook is gone, and optimizers go on
exactly as unpatched ones. enable()/disable() repeat harmlessly."""

import threading
import warnings

import pytest
import torch
import torch.distributed
import torch.nn.parallel
import torch.serialization
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.overrides import _get_current_function_mode_stack

from training import assert_same, assert_state_equal, batches, mlp, train, weights

POLICIES = ["default", "safe", "multi_layer", "backward", "forward", "distributed", "autotune"]
OPT_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
             "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
             "_optimizer_load_state_dict_post_hooks")
CLASSES = (torch.optim.Optimizer, torch.optim.SGD, torch.optim.Adam, nn.Module, torch.Tensor, nn.Parameter,
           torch.nn.parallel.DistributedDataParallel)
MODULES = (torch, torch.serialization, torch.autograd, torch.distributed, torch.nn.utils, torch.optim)


def make(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def global_hooks():
    """Every process-wide hook registry torch has for modules and optimizers, as plain dicts."""
    regs = [getattr(nn_module, n) for n in dir(nn_module) if n.startswith("_global") and n.endswith("hooks")]
    regs += [optim_module._global_optimizer_pre_hooks, optim_module._global_optimizer_post_hooks]
    return [dict(r) for r in regs]


def snapshot():
    # Run torch once unpatched first, so its own lazy set-up is not mistaken for a leftover patch.
    model = mlp()
    train(model, make(model), batches(2))
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(1))
    return ({c: dict(vars(c)) for c in CLASSES}, {m: dict(vars(m)) for m in MODULES}, global_hooks())


def assert_no_hooks(opt, model):
    for name in OPT_HOOKS:
        assert len(getattr(opt, name)) == 0, name
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None), "a gradient hook is left"
        assert not p._backward_hooks
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and not m._backward_hooks
    assert _get_current_function_mode_stack() == []


def two_jobs(policy=None, ap=None):
    """Two seeded Adam jobs, one built before enable() and one after; autopatch (if a policy is
    given) is disabled after six of their nine steps. Returns the models, optimizers and losses."""
    data = batches(9)
    early_model = mlp()
    early = make(early_model)                     # built before enable(): adopted at its next step
    if policy:
        ap.enable(policy)
    late_model = mlp(seed=3)
    late = make(late_model)
    jobs = [(early_model, early, []), (late_model, late, [])]
    for model, opt, losses in jobs:
        losses += train(model, opt, data[:6])
        opt.load_state_dict(opt.state_dict())     # a checkpoint round trip while patched
        if policy:
            assert any(len(getattr(opt, name)) for name in OPT_HOOKS)
    if policy:
        ap.disable()
    for model, opt, losses in jobs:
        losses += train(model, opt, data[6:])
    return jobs


@pytest.mark.parametrize("policy", POLICIES)
def test_disable_restores_everything_and_training_goes_on_as_unpatched(ap, policy):
    classes, modules, hooks = snapshot()
    original_init = vars(torch.optim.Optimizer)["__init__"]
    plain = two_jobs()
    jobs = two_jobs(policy, ap)

    assert vars(torch.optim.Optimizer)["__init__"] is original_init
    for cls, before in classes.items():
        after = vars(cls)
        assert after.keys() == before.keys(), (cls, after.keys() ^ before.keys())
        changed = [k for k in before if after[k] is not before[k]]
        assert not changed, (cls, changed)
    for mod, before in modules.items():
        changed = [k for k in before if vars(mod).get(k) is not before[k]]
        assert not changed, (mod.__name__, changed)
    assert global_hooks() == hooks

    for (model, opt, losses), (plain_model, plain_opt, plain_losses) in zip(jobs, plain):
        assert_no_hooks(opt, model)
        assert_same(losses, plain_losses)
        assert_same(weights(model), weights(plain_model))
        assert_state_equal(opt.state_dict(), plain_opt.state_dict())
        params = {id(p) for p in model.parameters()}
        assert {id(p) for p in opt.state} == params   # per-parameter state only, nothing of autopatch's
    assert [o["steps"] for o in ap.report()["optimizers"] if o["steps"]] == [6, 6]


def test_disable_twice_or_without_enable_is_harmless(ap):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ap.disable()
        ap.enable("safe")
        ap.disable()
        ap.disable()
    assert not ap.is_enabled()
    model = mlp()
    opt = make(model)
    train(model, opt, batches(2))
    assert_no_hooks(opt, model)


def test_enable_twice_warns_and_keeps_the_first(ap):
    original = vars(torch.optim.Optimizer)["__init__"]
    ap.enable("safe")
    with pytest.warns(RuntimeWarning, match="already enabled"):
        ap.enable("multi_layer")
    assert ap.is_enabled() and ap.report()["policy"] == "safe"
    assert vars(torch.optim.Optimizer)["__init__"].__wrapped__ is original   # wrapped once
    ap.disable()
    assert vars(torch.optim.Optimizer)["__init__"] is original


def test_concurrent_enable_installs_once(ap):
    original = vars(torch.optim.Optimizer)["__init__"]
    barrier = threading.Barrier(6)

    def racer():
        barrier.wait()
        ap.enable("safe")

    threads = [threading.Thread(target=racer) for _ in range(6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    caught = [w for w in caught if issubclass(w.category, RuntimeWarning) and "already enabled" in str(w.message)]
    assert len(caught) == 5
    assert vars(torch.optim.Optimizer)["__init__"].__wrapped__ is original
    model = mlp()
    train(model, make(model), batches(2))
    assert [o["steps"] for o in ap.report()["optimizers"] if o["steps"]] == [2]
    ap.disable()
    assert vars(torch.optim.Optimizer)["__init__"] is original
