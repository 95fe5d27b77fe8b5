"""Modes backward, forward and auto train exactly like unpatched on the loops users write.

Every scenario runs unpatched and then patched in each mode (observing 2 steps first, then
switching, so every run also crosses a mode switch) and compares losses, weights and optimizer
state bit for bit. Where a mode would change results the run must not use it: the report says
which mode ran and why.
"""

import contextlib
import io

import pytest
import torch
from torch import nn

import autopatch
from training import assert_same, assert_state_equal, batches, mlp, weights

MODES = ["multi_layer", "backward", "forward", "auto"]
# Mode auto's order on accelerators; on CPU it is multi_layer alone, which needs no watching.
ORDER = ["backward", "forward", "multi_layer"]


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def plain(model, opt, data, sched, before_step=None, after_step=None):
    """The usual loop; ``before_step``/``after_step`` run user code around ``opt.step()``."""
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        if before_step:
            before_step()
        opt.step()
        if after_step:
            after_step()
        sched.step()
        out.append(loss.item())
    return out


def clipping(model, opt, data, sched):
    return plain(model, opt, data, sched,
                 before_step=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))


def grad_scaler(model, opt, data, sched):
    """bf16 autocast on CPU with a GradScaler; step 5 has inf grads and must be skipped."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    out = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, x, y)
        scaler.scale(loss * (float("inf") if i == 5 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        out.append(loss.item())
    return out


def accumulation(model, opt, data, sched):
    out = []
    for x, y in data:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            loss = loss_of(model, xs, ys) / 4
            loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
    return out


def closure(model, opt, data, sched):
    """Lightning's pattern: zero_grad, forward and backward inside step(closure)."""
    out = []
    for x, y in data:
        def compute():
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss
        out.append(opt.step(compute).item())
        sched.step()
    return out


def ema_after_step(model, opt, data, sched):
    """Reads every weight right after step(), as an EMA of the weights does."""
    ema = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update_ema():
        for e, p in zip(ema, model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    return plain(model, opt, data, sched, after_step=update_ema) + [e.sum().item() for e in ema]


def grad_norms_after_step(model, opt, data, sched):
    """Logs the gradient norm after step(), as many training loops do."""
    norms = []
    out = plain(model, opt, data, sched,
                after_step=lambda: norms.append(sum(p.grad.norm().item() for p in model.parameters())))
    return out + norms


class Shared(nn.Module):
    """A module used twice per forward, a frozen layer, and a branch unused on odd steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.twice = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.sometimes = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x):
        h = torch.tanh(self.twice(torch.tanh(self.twice(self.inp(x)))))
        h = self.frozen(h)
        if self.calls % 2 == 0:
            h = h + self.sometimes(h)
        self.calls += 1
        return self.out(h)


SCENARIOS = {
    "plain": (mlp, plain),
    "clipping": (mlp, clipping),
    "grad_scaler": (mlp, grad_scaler),
    "accumulation": (mlp, accumulation),
    "closure": (mlp, closure),
    "ema_after_step": (mlp, ema_after_step),
    "grad_norms_after_step": (mlp, grad_norms_after_step),
    "shared_frozen_unused": (Shared, plain),
}

# Which of backward and forward fusion cannot change each scenario's results.
SAFE = {
    "plain": {"backward", "forward"},
    "clipping": {"forward"},
    "grad_scaler": {"forward"},
    "accumulation": {"forward"},
    "closure": set(),
    "ema_after_step": {"backward"},
    "grad_norms_after_step": {"forward"},
    "shared_frozen_unused": {"backward", "forward"},
}


def expected_mode(scenario, mode):
    """auto takes the first safe one of backward, forward; a named mode is kept only if safe."""
    safe = SAFE[scenario]
    if mode == "auto":
        return next((m for m in ("backward", "forward") if m in safe), "multi_layer")
    if mode == "multi_layer":
        return mode
    return mode if mode in safe else "multi_layer"


def run(scenario, mode=None, steps=10):
    make_model, loop = SCENARIOS[scenario]
    model = make_model()
    if mode:
        autopatch.enable(mode=mode, chunk_bytes=2048, fusion={"observe_steps": 2, "auto_order": ORDER})
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        losses = loop(model, opt, batches(steps), sched)
        autopatch.flush()
        rep = autopatch.report()
    finally:
        autopatch.disable()
    return losses, weights(model), opt.state_dict(), rep


def stepped(rep):
    (entry,) = [o for o in rep["optimizers"] if o["steps"]]
    return entry


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_mode_matches_unpatched(scenario, mode):
    ref = run(scenario)
    got = run(scenario, mode)
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])
    assert_state_equal(ref[2], got[2])
    entry = stepped(got[3])
    assert entry["mode"] == expected_mode(scenario, mode), entry["reason"]
    assert entry["reason"]


@contextlib.contextmanager
def settled_in(mode):
    """A model and its optimizer two steps in, past the one step ``mode`` watches first."""
    model = mlp()
    autopatch.enable(mode=mode, chunk_bytes=2048, fusion={"observe_steps": 1})
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = batches(4)
        plain(model, opt, data[:2], torch.optim.lr_scheduler.StepLR(opt, 3))
        assert stepped(autopatch.report())["mode"] == mode
        yield model, opt, data[2]
    finally:
        autopatch.disable()


def test_backward_mode_frees_grads_and_updates_inside_backward():
    with settled_in("backward") as (model, opt, (x, y)):
        opt.zero_grad()
        before = weights(model)
        loss_of(model, x, y).backward()
        # updated during backward: weights moved, grads already released
        assert all(p.grad is None for p in model.parameters())
        assert not all(torch.equal(a, b) for a, b in zip(before, weights(model)))
        opt.step()
        assert stepped(autopatch.report())["fusion"]["chunk_updates_in_backward"] > 0


def test_backward_mode_rejects_accumulation_appearing_later():
    with settled_in("backward") as (model, opt, (x, y)):
        loss_of(model, x, y).backward()
        with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
            loss_of(model, x, y).backward()


def test_forward_mode_defers_until_the_module_runs_and_flushes_before_save():
    with settled_in("forward") as (model, opt, (x, y)):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        held = list(model.parameters())   # tensors in a variable: reading them applies nothing
        before = [p.detach().clone() for p in held]
        opt.step()
        model.zero_grad()                 # clears grads only: applies nothing either
        assert all(torch.equal(a, p) for a, p in zip(before, held))               # deferred
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)                                        # flushes
        assert not any(torch.equal(a, p) for a, p in zip(before, held))


def test_forward_mode_rejects_a_pending_gradient_changed_in_place():
    """The deferred update needs the gradients step() saw: one written in place before it runs is
    an error, not a silently different update (zero_grad(set_to_none=False) is flushed first)."""
    with settled_in("forward") as (model, opt, (x, y)):
        first = next(model.parameters())     # held: reading it later applies nothing
        opt.zero_grad(set_to_none=False)
        loss_of(model, x, y).backward()
        opt.step()
        first.grad.mul_(2.0)
        with pytest.raises(RuntimeError, match="changed in place after optimizer.step"):
            loss_of(model, x, y)


@pytest.mark.parametrize("mode", ["backward", "forward", "auto"])
def test_checkpoint_resume_mid_training(mode):
    data = batches(10)

    def go(patched):
        model = mlp()
        if patched:
            autopatch.enable(mode=mode, chunk_bytes=2048, fusion={"observe_steps": 2, "auto_order": ORDER})
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, 3)
            plain(model, opt, data[:5], sched)
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            buf.seek(0)
            ckpt = torch.load(buf)
            model2 = mlp(seed=3)
            model2.load_state_dict(ckpt["model"])
            opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
            opt2.load_state_dict(ckpt["opt"])
            sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3)
            sched2.load_state_dict(ckpt["sched"])
            losses = plain(model2, opt2, data[5:], sched2)
            autopatch.flush()
        finally:
            autopatch.disable()
        return losses, weights(model2), opt2.state_dict()
    ref, got = go(False), go(True)
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])
    assert_state_equal(ref[2], got[2])


def test_switching_modes_every_few_steps():
    data = batches(16)
    model_ref = mlp()
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=1e-2)
    ref_losses = plain(model_ref, opt_ref, data, torch.optim.lr_scheduler.StepLR(opt_ref, 3))

    model = mlp()
    autopatch.enable(mode="multi_layer", chunk_bytes=2048)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3)
        ctrl = autopatch._runtime.controllers[-1]
        losses, seen = [], []
        cycle = ["backward", "forward", "off", "multi_layer"]
        for i in range(8):
            losses += plain(model, opt, data[2 * i:2 * i + 2], sched)
            seen.append(ctrl.set_mode(cycle[i % 4]))
        autopatch.flush()
    finally:
        autopatch.disable()
    assert seen == cycle * 2
    assert_same(ref_losses, losses)
    assert_same(weights(model_ref), weights(model))
    assert_state_equal(opt_ref.state_dict(), opt.state_dict())


def test_auto_on_cpu_takes_multi_layer_at_once():
    got = run("plain", None)
    model = mlp()
    autopatch.enable(mode="auto")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = plain(model, opt, batches(10), torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5))
        entry = stepped(autopatch.report())
    finally:
        autopatch.disable()
    assert entry["mode"] == "multi_layer" and "fastest mode on CPU" in entry["reason"]
    assert entry["fusion"]["fused_steps"] == 10      # no steps spent watching
    assert_same(got[0], losses)
