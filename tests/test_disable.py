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
CLASSES = (torch.optim.Optimizer, torch.optim.SGD, torch.optim.Adam, nn.Module, torch.Tensor,
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


@pytest.mark.parametrize("policy", POLICIES)
def test_disable_restores_every_object_and_removes_every_hook(ap, policy):
    classes, modules, hooks = snapshot()
    original_init = vars(torch.optim.Optimizer)["__init__"]
    early_model = mlp()
    early = make(early_model)                     # built before enable(): adopted
    ap.enable(policy)
    assert vars(torch.optim.Optimizer)["__init__"] is not original_init
    late_model = mlp(seed=3)
    late = make(late_model)
    for model, opt in ((early_model, early), (late_model, late)):
        train(model, opt, batches(5))
        opt.load_state_dict(opt.state_dict())
        assert any(len(getattr(opt, name)) for name in OPT_HOOKS)
    ap.disable()
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
    for model, opt in ((early_model, early), (late_model, late)):
        assert_no_hooks(opt, model)


@pytest.mark.parametrize("policy", POLICIES)
def test_optimizer_trains_like_unpatched_after_disable(ap, policy):
    data = batches(9)
    model = mlp()
    opt = make(model)
    plain_losses = train(model, opt, data)
    plain = (weights(model), opt.state_dict())

    model = mlp()
    ap.enable(policy)
    opt = make(model)
    losses = train(model, opt, data[:6])
    ap.disable()
    losses += train(model, opt, data[6:])
    assert_same(losses, plain_losses)
    assert_same(weights(model), plain[0])
    assert_state_equal(opt.state_dict(), plain[1])
    params = {id(p) for p in model.parameters()}
    assert {id(p) for p in opt.state} == params      # per-parameter state only, nothing of autopatch's
    assert [o["steps"] for o in ap.report()["optimizers"] if o["steps"]] == [6]


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
