"""Every optimizer is intercepted, however it is built or stepped, and trains bit-for-bit as unpatched.

"Intercepted" means the report counts every step of that optimizer with a mode and a reason, and
its losses, weights and state_dict equal those of the same job run without autopatch.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

import autopatch
from autopatch.reporting import json_report as telemetry
from spawn import IMPORT_PATH, clean_env, run_python
from training import assert_same, assert_state_equal, batches, mlp, train, weights

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

MODES = ("off", "multi_layer", "backward", "forward")
STEPS = 4


class HandSGD(torch.optim.Optimizer):
    """A user-written optimizer straight on torch.optim.Optimizer, closure support included."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])
        return loss


class CountingAdam(torch.optim.Adam):
    """A user subclass of a torch optimizer that overrides step."""

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "Lion": lambda ps: pytorch_optimizer.Lion(ps, lr=1e-3),
    "HandSGD": HandSGD,
}
STYLES = ("plain", "built_before_enable", "scheduler_before_enable", "scheduler_after_enable",
          "closure", "closure_keyword")
# torch hooks each class's step on its first construction; from then on a subclass whose step calls
# super().step() runs two hooked steps per call, as in any program that built an Adam before.
torch.optim.Adam([nn.Parameter(torch.zeros(1))])


def qualname(opt):
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def entry(report, cls_name):
    """The report's one entry for the optimizer that stepped (two would mean double interception)."""
    found = [o for o in report["optimizers"] if o["class"] == cls_name and o["steps"]]
    assert len(found) == 1, report["optimizers"]
    return found[0]


def jobs(makers, style, policy=None):
    """One seeded job per optimizer, all in one program; with a policy, autopatch is enabled
    where ``style`` says, and disabled after."""
    early = style in ("built_before_enable", "scheduler_before_enable")
    if policy and not early:
        autopatch.enable(policy)
    runs = []
    for make in makers:
        model = mlp()
        opt = make(model.parameters())
        sched = StepLR(opt, step_size=2, gamma=0.5) if style.startswith("scheduler") else None
        runs.append((model, opt, sched))
    if policy and early:
        autopatch.enable(policy)
    out = []
    try:
        for model, opt, sched in runs:
            losses = train_in_style(model, opt, sched, style)
            out.append({"losses": losses, "weights": weights(model), "state": opt.state_dict(),
                        "class": qualname(opt)})
        report = autopatch.report() if policy else None
    finally:
        autopatch.disable()
    for o in out:
        o["report"] = report
    return out


def train_in_style(model, opt, sched, style):
    data = batches(STEPS)
    if style != "closure_keyword":
        return train(model, opt, data, sched=sched, closure=style == "closure")
    losses = []
    for x, y in data:        # as Lightning calls it: optimizer.step(closure=closure)
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        losses.append(opt.step(closure=closure).item())
    return losses


def assert_intercepted_and_equal(patched, plain, steps=STEPS):
    assert_same(patched["losses"], plain["losses"])
    assert_same(patched["weights"], plain["weights"])
    assert_state_equal(patched["state"], plain["state"])
    e = entry(patched["report"], patched["class"])
    assert e["steps"] == steps, e
    assert e["mode"] in MODES, e
    assert e["reason"] and e["reason"] != "not stepped yet", e
    return e


def check_all(names, style, policy):
    makers = [OPTIMIZERS[n] if n in OPTIMIZERS else EXTRA[n] for n in names]
    plain, patched = jobs(makers, style), jobs(makers, style, policy)
    failures = []
    for name, a, b in zip(names, patched, plain):
        try:
            e = assert_intercepted_and_equal(a, b)
            if policy == "safe":
                assert e["mode"] == "off" and "fusion.mode" in e["reason"], e
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("policy", ["default", "safe"])
@pytest.mark.parametrize("style", STYLES)
def test_every_optimizer_is_intercepted(ap, style, policy):
    check_all(sorted(OPTIMIZERS), style, policy)


EXTRA = {"CountingAdam": lambda ps: CountingAdam(ps, lr=1e-2)}


def test_subclass_calling_super_step_is_intercepted_once():
    # In a fresh interpreter: the failure can leave autopatch's state behind in this one.
    code = "import test_interception as t; [t.check_all(['CountingAdam'], 'plain', p) for p in ('safe', 'default')]"
    res = run_python(["-c", code], env=clean_env(PYTHONPATH=f"{IMPORT_PATH}:{Path(__file__).parent}"))
    assert res.returncode == 0, res.stderr[-3000:]


def test_user_subclass_step_override_still_runs(ap):
    model = mlp()
    ap.enable("safe")
    opt = CountingAdam(model.parameters(), lr=1e-2)
    train(model, opt, batches(3))
    assert opt.calls == 3


@pytest.mark.parametrize("policy", ["default", "safe"])
def test_lbfgs_closure_called_many_times_per_step(ap, policy):
    make = lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=3)
    [patched], [plain] = jobs([make], "closure", policy), jobs([make], "closure")
    assert_same(patched["losses"], plain["losses"])
    assert_same(patched["weights"], plain["weights"])
    assert_tree_equal(patched["state"], plain["state"])    # LBFGS keeps lists of history tensors
    e = entry(patched["report"], "torch.optim.lbfgs.LBFGS")
    assert e["steps"] == STEPS and e["mode"] in MODES and e["reason"]


def assert_tree_equal(a, b, where="state_dict"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_scheduler_wraps_step_per_instance_and_is_still_seen(ap):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "step" not in vars(opt)
    sched = StepLR(opt, step_size=1, gamma=0.5)
    assert "step" in vars(opt)          # the scheduler's own wrapper, on this instance only
    ap.enable()
    train(model, opt, batches(3), sched=sched)
    assert entry(ap.report(), "torch.optim.sgd.SGD")["steps"] == 3
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3


# -- accelerate ----------------------------------------------------------------------------------

def accelerate_job(enable_at=None):
    """accelerate's prepare() wraps the optimizer (AcceleratedOptimizer) and the scheduler."""
    accelerate = pytest.importorskip("accelerate")
    model, data = mlp(), batches(STEPS)
    if enable_at == "before_prepare":
        autopatch.enable()
    acc = accelerate.Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    model, wrapped, sched = acc.prepare(model, opt, sched)
    assert isinstance(wrapped, accelerate.optimizer.AcceleratedOptimizer) and wrapped.optimizer is opt
    if enable_at == "after_prepare":
        autopatch.enable()
    losses = []
    for x, y in data:
        wrapped.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        wrapped.step()
        sched.step()
        losses.append(loss.item())
    out = {"losses": losses, "weights": weights(model), "state": wrapped.state_dict(),
           "report": autopatch.report() if enable_at else None, "class": "torch.optim.adamw.AdamW"}
    autopatch.disable()
    return out


@pytest.mark.parametrize("enable_at", ["before_prepare", "after_prepare"])
def test_accelerated_optimizer_is_intercepted(ap, enable_at):
    patched = accelerate_job(enable_at)
    assert_intercepted_and_equal(patched, accelerate_job())
    assert [o["class"] for o in patched["report"]["optimizers"]
            if "accelerate" in o["class"]] == []     # the wrapper itself has no step of its own


# -- report() ------------------------------------------------------------------------------------

def test_report_is_json_with_the_documented_fields(ap, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("fusion:\n  mode: multi_layer\n")
    ap.enable(str(path))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, batches(3))
    rep = ap.report()
    assert json.loads(json.dumps(rep)) == rep
    assert rep["version"] == 1 and rep["enabled"] is True and rep["policy"] == str(path)
    e = entry(rep, "torch.optim.sgd.SGD")
    assert e == {**e, "class": "torch.optim.sgd.SGD", "mode": "multi_layer", "params": 14, "steps": 3}
    assert isinstance(e["reason"], str) and e["reason"]
    assert isinstance(rep["timing"], dict) and rep["timing"]["steps"] >= 3
    assert rep["timing"]["wall_seconds"] >= 0
    ap.disable()
    after = ap.report()
    assert after["enabled"] is False and entry(after, "torch.optim.sgd.SGD")["steps"] == 3


def test_report_path_expands_rank_and_only_rank_0_writes_a_plain_path(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    assert telemetry.report_path(str(tmp_path / "r{rank}.json")) == str(tmp_path / "r1.json")
    assert telemetry.report_path(str(tmp_path / "plain.json")) is None
    monkeypatch.setenv("RANK", "0")
    assert telemetry.report_path(str(tmp_path / "plain.json")) == str(tmp_path / "plain.json")
    written = telemetry.write_report({"version": 1}, str(tmp_path / "sub" / "r{rank}.json"))
    assert json.loads(open(written).read()) == {"version": 1}
