"""A mode that was left keeps nothing: once mode auto has decided (or a switch is over), only the
mode in effect holds strategies, hooks and flat buffers, so the rest of the run costs what the
chosen mode named from the start costs; and the weights stay bitwise those of unpatched."""

import torch
from torch import nn

import autopatch
from autopatch.fusion import registry
from training import BertAdam, assert_same, batches, weights


def many_small(seed=0):
    """Residual blocks of small tensors: most of the step is per-tensor work."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(*blocks, nn.Linear(16, 3))


def iteration(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def unpatched(data):
    model = many_small()
    opt = BertAdam(model.parameters())
    for x, y in data:
        iteration(model, opt, x, y)
    return weights(model)


def grads_after_backward(model, x, y):
    """Backward fusion frees each gradient inside backward: any of its hooks left on a parameter
    would show as a missing ``.grad`` here."""
    for p in model.parameters():
        p.grad = None
    nn.functional.cross_entropy(model(x), y).backward()
    return all(p.grad is not None for p in model.parameters())


def test_auto_keeps_nothing_of_the_modes_it_raced_once_it_has_decided(ap):
    data = batches(60)
    model = many_small()
    global_hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    ap.enable(mode="auto", fusion={"observe_steps": 2, "measure_steps": 40})
    ctrl = None
    try:
        opt = BertAdam(model.parameters())
        ctrl = ap.session().optimizers[-1]
        for n, (x, y) in enumerate(data, 1):
            iteration(model, opt, x, y)
            if n > 5 and not ctrl.choosing:
                break
        assert not ctrl.choosing, "auto did not decide within its budget"
        auto = ctrl.describe()["auto"]
        assert auto["measure_steps"] > 0 and len(auto["ms_per_step"]) > 2, auto
        chosen = ctrl.mode
        for x, y in data[n:n + 3]:
            iteration(model, opt, x, y)
        steps = n + 3
        assert registry.alive(opt) == ([] if chosen == "off" else [chosen])
        forward_hook = chosen == "forward"
        assert len(torch.nn.modules.module._global_forward_pre_hooks) == global_hooks + forward_hook
        autopatch.flush()
        if chosen != "backward":
            assert grads_after_backward(model, *data[0])
    finally:
        ap.disable()
    got = weights(model)
    assert_same(unpatched(data[:steps]), got)


def test_switching_back_and_forth_keeps_only_the_mode_in_effect(ap):
    data = batches(12)
    model = many_small()
    ap.enable(mode="multi_layer", chunk_bytes=2048, fusion={"observe_steps": 1})
    try:
        opt = BertAdam(model.parameters())
        ctrl = ap.session().optimizers[-1]
        for i, mode in enumerate(["backward", "forward", "backward", "multi_layer", "backward", "off"]):
            iteration(model, opt, *data[2 * i])
            assert ctrl.set_mode(mode) == mode
            iteration(model, opt, *data[2 * i + 1])
            assert registry.alive(opt) == ([] if mode == "off" else [mode])
        assert grads_after_backward(model, *data[0])
    finally:
        ap.disable()
    assert_same(unpatched(data), weights(model))
