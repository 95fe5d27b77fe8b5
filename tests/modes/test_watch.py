"""The watch over an optimizer's first steps leaves nothing behind: no torch function mode, no
global hook, no tensor of another class, no optimizer kept alive, whatever the number of steps;
and it still sees what would make backward or forward fusion wrong."""

import gc
import json
import weakref

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

from autopatch.modes.watch import COMPILED, GRAD_READ, PARAM_READ_EARLY
from spawn import run_python

MODE_STACK = torch._C._len_torch_function_stack


def global_hooks():
    m = torch.nn.modules.module
    return (len(m._global_forward_pre_hooks), len(m._global_forward_hooks),
            len(m._global_backward_hooks), len(optimizer_module._global_optimizer_pre_hooks))


def one_step(model, opt):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


@pytest.mark.parametrize("policy", [{}, {"mode": "backward"}, {"mode": "forward"}])
def test_an_optimizer_stepped_once_leaves_no_mode_no_hook_and_no_other_class(ap, policy):
    before = (MODE_STACK(), global_hooks())
    ap.enable(**policy)
    enabled = (MODE_STACK(), global_hooks())      # the runtime's step pre-hook, for optimizers built earlier
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_step(model, opt)
    assert (MODE_STACK(), global_hooks()) == enabled           # after step() returns
    model(torch.randn(3, 4)).sum().backward()                  # a backward with no step after it
    assert MODE_STACK() == before[0]
    assert type(model.weight) is nn.Parameter or type(model.weight).__name__ == "WatchedParameter"
    ap.disable()
    assert (MODE_STACK(), global_hooks()) == before
    assert type(model.weight) is nn.Parameter and type(model.weight.grad) is torch.Tensor
    assert not model.weight._post_accumulate_grad_hooks


def test_dropped_optimizers_are_freed_with_their_hooks(ap):
    ap.enable(mode="backward", fusion={"observe_steps": 1})
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    refs = []
    for _ in range(20):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(3):
            one_step(model, opt)
            opt.zero_grad()
        refs.append(weakref.ref(opt))
        del opt
        gc.collect()
    assert all(r() is None for r in refs)
    assert all(type(p) is nn.Parameter and not p._post_accumulate_grad_hooks for p in model.parameters())
    report = ap.report()["optimizers"]
    assert len(report) == 20 and all(o["freed"] and o["steps"] == 3 for o in report), report


def test_a_freed_model_is_freed_too(ap):
    ap.enable(mode="multi_layer")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_step(model, opt)
    ref = weakref.ref(model.weight)
    del model, opt
    gc.collect()
    assert ref() is None


def test_a_replaced_optimizer_that_is_kept_stops_updating_inside_backward(ap):
    """The user re-creates the optimizer and keeps the old one: its gradient hooks must not fire
    in the next backward (they used to raise AccumulationError from loss.backward())."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    data = [torch.randn(3, 4) for _ in range(8)]

    def train(patched):
        model.load_state_dict(ref)
        if patched:
            ap.enable(mode="backward", fusion={"observe_steps": 1})
        old = torch.optim.AdamW(model.parameters(), lr=0.01)
        for x in data[:4]:
            model(x).sum().backward()
            old.step()
            old.zero_grad()
        new = torch.optim.AdamW(model.parameters(), lr=0.01)
        for x in data[4:]:
            model(x).sum().backward()
            new.step()
            new.zero_grad()
        out = [p.detach().clone() for p in model.parameters()]
        if patched:
            reasons = [o["reason"] for o in ap.report()["optimizers"] if o["steps"]]
            ap.disable()
            assert len(reasons) == 2 and all("shared with another optimizer" in r for r in reasons), reasons
        return out

    unpatched = train(False)
    patched = train(True)
    assert all(torch.equal(a, b) for a, b in zip(unpatched, patched))


def test_global_optimizer_hooks_see_the_users_steps_only(ap):
    """The probe steps throw-away copies of a class not probed yet: those steps are not the user's."""
    calls = []
    pre = optimizer_module.register_optimizer_step_pre_hook(lambda o, a, k: calls.append("pre"))
    post = optimizer_module.register_optimizer_step_post_hook(lambda o, a, k: calls.append("post"))
    try:
        class FreshSGD(torch.optim.SGD):       # a class the probe has not seen in this process
            pass
        ap.enable(mode="multi_layer")
        p = nn.Parameter(torch.randn(6))
        opt = FreshSGD([p], lr=0.1)
        for _ in range(2):
            p.grad = torch.randn(6)
            opt.step()
        assert ap.session().optimizer(opt).mode == "multi_layer"
        assert calls == ["pre", "post"] * 2
    finally:
        pre.remove()
        post.remove()


def test_state_the_class_creates_up_front_does_not_stop_the_probe(ap):
    """Some releases' Adagrad create their state in __init__ and only read it in step()."""
    class UpFront(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, dict(lr=lr))
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["sum"] = torch.zeros_like(p)

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        s = self.state[p]["sum"]          # never created here
                        s.addcmul_(p.grad, p.grad)
                        p.addcdiv_(p.grad, s.sqrt().add_(1e-8), value=-group["lr"])

    ap.enable(mode="multi_layer")
    ps = [nn.Parameter(torch.randn(5)) for _ in range(3)]
    opt = UpFront(ps)
    for p in ps:
        p.grad = torch.randn(5)
    opt.step()
    assert ap.session().optimizer(opt).mode == "multi_layer", ap.session().optimizer(opt).reason


WATCH_IN_A_FRESH_PROCESS = """
import json, sys, torch, autopatch
from torch import nn
compiled = sys.argv[1] == "compiled"
autopatch.enable(fusion={"observe_steps": 2, "measure_steps": 16})
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
run = torch.compile(model, backend="eager") if compiled else model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
held = list(model.parameters())          # an EMA over a list taken once
ema = [p.detach().clone() for p in held]
for _ in range(6):                       # 2 steps unpatched, 2 watched, 2 more
    run(torch.randn(3, 4)).sum().backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    for e, p in zip(ema, held):
        e.mul_(0.9).add_(p.detach(), alpha=0.1)
print(json.dumps({"blocked": autopatch.session().optimizer(opt).blocked,
                  "stack": torch._C._len_torch_function_stack()}))
"""


@pytest.mark.parametrize("program", ["eager", "compiled"])
def test_the_watch_still_sees_grad_reads_and_early_param_reads(tmp_path, program):
    """Clipping between backward and step() rules backward out, an EMA over a list of the weights
    taken once rules forward out; a compiled program rules forward out and is still watched for
    what happens between backward and step(). In a fresh interpreter: whether anything was
    compiled in the process matters."""
    res = run_python(["-c", WATCH_IN_A_FRESH_PROCESS, program])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert GRAD_READ in out["blocked"]["backward"] and out["stack"] == 0, out
    assert (COMPILED if program == "compiled" else PARAM_READ_EARLY) in out["blocked"]["forward"], out
