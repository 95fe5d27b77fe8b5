"""Mode multi_layer: training with fused chunks equals training without, bit for bit."""

import weakref

import pytest
import torch
from torch import nn

import autopatch
from training import (BertAdam, assert_same, assert_state_equal, batches, mlp, train,
                      weights)

# Chunk sizes in bytes. A parameter of at least a chunk gets chunks of its own that read its own
# .grad in place; smaller ones are grouped and their grads gathered into a flat buffer.
CHUNK = 1024           # the 16x16 weights: one chunk each, the biases grouped (the default here)
GATHERED_CHUNK = 4096  # every parameter of the 16-wide model is small: all grads gathered
WIDE = 32              # with CHUNK, a 32x32 weight is cut into 4 chunks of its own
WIDER = 64             # with CHUNK, the biases (whose grads are copied, not moved) span several chunks

TORCH_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "bertadam": lambda ps: BertAdam(ps, lr=1e-2),
}


def stepped(report):
    """The report entry of the one optimizer that stepped in this run."""
    (entry,) = [o for o in report["optimizers"] if o["steps"]]
    return entry


def two_groups(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def run(make_opt, steps=12, patched=True, set_to_none=True, closure=False, width=16, **enable):
    model = mlp(width)
    if patched:
        autopatch.enable(**dict({"mode": "multi_layer", "chunk_bytes": CHUNK}, **enable))
    try:
        opt = make_opt(two_groups(model))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        losses = train(model, opt, batches(steps, width), sched, set_to_none=set_to_none, closure=closure)
        rep = autopatch.report()
    finally:
        autopatch.disable()
    return losses, weights(model), opt.state_dict(), rep


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("chunk, width", [(GATHERED_CHUNK, 16), (CHUNK, 16), (CHUNK, WIDE), (CHUNK, WIDER)])
def test_bitwise_equal_to_unpatched(name, set_to_none, chunk, width):
    make = TORCH_OPTIMIZERS[name]
    ref = run(make, patched=False, set_to_none=set_to_none, width=width)
    got = run(make, set_to_none=set_to_none, chunk_bytes=chunk, width=width)
    entry = stepped(got[3])
    assert entry["mode"] == "multi_layer", entry["reason"]
    assert entry["fusion"]["chunks"] > 2 and entry["fusion"]["fused_steps"] == 12
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])
    assert_state_equal(ref[2], got[2])


def test_large_params_are_updated_from_their_own_grads():
    """No copy of a large parameter's gradient: the chunks read it in place and the parameter
    keeps the very tensor autograd made; small ones share chunk buffers (moved there, or for the
    smallest copied into a bounded buffer); once the user frees the grads (set_to_none) nothing
    keeps one alive."""
    model = mlp(WIDE)
    autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, batches(2, WIDE))
        x, y = batches(1, WIDE)[0]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        made = [p.grad for p in model.parameters()]
        opt.step()
        large = [p.numel() * 4 >= CHUNK for p in model.parameters()]
        kept = [p.grad is g for p, g in zip(model.parameters(), made)]
        assert all(k for k, big in zip(kept, large) if big)
        fusion = stepped(autopatch.report())["fusion"]
        assert fusion["gathered_params"] >= kept.count(False) and fusion["gathered_params"] > 0
        # only the smallest parameters' grads are copied, into a buffer of at most 1/32 of them all
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert 0 < fusion["kept_grad_bytes"] <= grad_bytes / 32
        del made
        freed = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        assert all(r() is None for r in freed)
    finally:
        autopatch.disable()


def test_closure_step_like_lightning():
    make = TORCH_OPTIMIZERS["adamw"]
    ref = run(make, patched=False, closure=True)
    got = run(make, closure=True)
    assert stepped(got[3])["mode"] == "multi_layer"
    assert_same(ref[1], got[1])
    assert_state_equal(ref[2], got[2])


@pytest.mark.parametrize("cls", ["Lion", "AdaBelief"])
def test_third_party_elementwise_optimizers_fuse(cls):
    po = pytest.importorskip("pytorch_optimizer")
    make = lambda ps: getattr(po, cls)(ps, lr=1e-3)
    ref = run(make, patched=False)
    got = run(make)
    assert stepped(got[3])["mode"] == "multi_layer"
    assert_same(ref[1], got[1])


@pytest.mark.parametrize("cls", ["Lamb", "LARS", "AdaFactor"])
def test_per_tensor_optimizers_are_left_unfused(cls):
    po = pytest.importorskip("pytorch_optimizer")
    make = lambda ps: getattr(po, cls)(ps, lr=1e-3)
    ref = run(make, patched=False)
    got = run(make)
    entry = stepped(got[3])
    assert entry["mode"] == "off"
    assert entry["reason"].startswith("left unfused")
    assert_same(ref[1], got[1])


def test_policy_forbid_and_force():
    make = TORCH_OPTIMIZERS["adam"]
    got = run(make, fusion={"forbid": ["Adam"]})
    assert stepped(got[3])["mode"] == "off"
    assert "fusion.forbid" in stepped(got[3])["reason"]
    ref = run(make, patched=False)
    got = run(make, fusion={"force": ["torch.optim.adam.*"]})
    assert stepped(got[3])["mode"] == "multi_layer"
    assert "without the probe" in stepped(got[3])["reason"]
    assert_same(ref[1], got[1])


class Branchy(nn.Module):
    """A frozen layer, a branch used only on even steps, and a tied weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.even = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.emb.weight   # tied
        self.out = nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x):
        h = torch.tanh(self.frozen(self.emb(x)))
        if self.calls % 2 == 0:
            h = h + self.even(h)
        self.calls += 1
        return self.out(self.head(h))


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "bertadam"])
def test_unused_frozen_and_tied_params(name):
    def go(patched):
        model = Branchy()
        if patched:
            autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
        try:
            opt = TORCH_OPTIMIZERS[name](model.parameters())
            losses = train(model, opt, batches(9))
            rep = autopatch.report()
        finally:
            autopatch.disable()
        return losses, weights(model), opt.state_dict(), rep
    ref, got = go(False), go(True)
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])
    assert_state_equal(ref[2], got[2])
    fusion = stepped(got[3])["fusion"]
    assert fusion["fallback_group_steps"] > 0          # odd steps: 'even' had no grad
    assert fusion["excluded_params"] == {"frozen (requires_grad=False)": 2}


def test_add_param_group_and_data_reassignment_mid_training():
    def go(patched):
        model, extra = mlp(), nn.Linear(16, 16)
        if patched:
            autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
        try:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            data = batches(12)
            train(model, opt, data[:4])
            opt.add_param_group({"params": extra.parameters(), "lr": 1e-3})
            train(lambda_model(model, extra), opt, data[4:8])
            with torch.no_grad():
                model[0].weight.data = model[0].weight.data.clone()   # user moves a param
            train(lambda_model(model, extra), opt, data[8:])
            rep = autopatch.report()
        finally:
            autopatch.disable()
        return weights(model) + weights(extra), opt.state_dict(), rep
    ref, got = go(False), go(True)
    assert_same(ref[0], got[0])
    assert_state_equal(ref[1], got[1])
    assert stepped(got[2])["fusion"]["replans"] >= 3


def lambda_model(model, extra):
    return lambda x: model(extra(x))


def test_mixed_dtypes_get_separate_runs():
    def go(patched):
        model = mlp()
        model[2].to(torch.bfloat16)
        if patched:
            autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for x, y in batches(6):
                h = model[1](model[0](x))
                h = model[2](h.bfloat16()).float()
                loss = nn.functional.cross_entropy(model[3:](h), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            rep = autopatch.report()
        finally:
            autopatch.disable()
        return weights(model), opt.state_dict(), rep
    ref, got = go(False), go(True)
    assert_same(ref[0], got[0])
    assert_state_equal(ref[1], got[1])
    assert stepped(got[2])["fusion"]["runs"] >= 2      # a flat buffer holds one dtype


@pytest.mark.parametrize("direction", ["patched_to_plain", "plain_to_patched"])
def test_checkpoint_round_trip(tmp_path, direction):
    """Half a run in one world, checkpoint through torch.save, the rest in the other."""
    data = batches(12)

    ref_model = mlp()
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    train(ref_model, ref_opt, data)

    first_patched = direction == "patched_to_plain"
    model = mlp()
    if first_patched:
        autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, data[:6])
    autopatch.disable()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")

    ckpt = torch.load(tmp_path / "ckpt.pt")
    model2 = mlp(seed=5)
    model2.load_state_dict(ckpt["model"])
    if not first_patched:
        autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["opt"])
    try:
        train(model2, opt2, data[6:])
        rep = autopatch.report()
    finally:
        autopatch.disable()
    if not first_patched:
        assert stepped(rep)["mode"] == "multi_layer"
    assert_same(weights(ref_model), weights(model2))
    assert_state_equal(ref_opt.state_dict(), opt2.state_dict())


def test_enable_and_disable_mid_training():
    data = batches(15)
    ref_model = mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    train(ref_model, ref_opt, data)

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, data[:5])
    autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)   # adopts the running optimizer
    try:
        train(model, opt, data[5:10])
        assert stepped(autopatch.report())["fusion"]["fused_steps"] == 5
    finally:
        autopatch.disable()
    train(model, opt, data[10:])
    assert_same(weights(ref_model), weights(model))
    assert_state_equal(ref_opt.state_dict(), opt.state_dict())


def test_chunk_size_and_mode_switch_between_steps():
    data = batches(16)
    ref_model = mlp()
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    train(ref_model, ref_opt, data)

    model = mlp()
    autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ctrl = autopatch.session().optimizers[-1]
        for i in range(4):
            train(model, opt, data[4 * i:4 * i + 4])
            if i == 0:
                ctrl.set_chunk_bytes(1 << 20)
            elif i == 1:
                assert ctrl.set_mode("off") == "off"
            elif i == 2:
                assert ctrl.set_mode("multi_layer") == "multi_layer"
    finally:
        autopatch.disable()
    assert_same(weights(ref_model), weights(model))
    assert_state_equal(ref_opt.state_dict(), opt.state_dict())


def test_an_unused_head_does_not_stop_the_rest_from_fusing():
    """Params that never get a gradient end up in a run of their own, which is skipped as the
    optimizer skips them, while the rest keeps fusing (no re-plan every step)."""
    def go(patched):
        torch.manual_seed(0)
        used, unused = nn.Linear(16, 16), nn.Linear(16, 16)
        if patched:
            autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
        try:
            opt = torch.optim.Adam([*used.parameters(), *unused.parameters()], lr=1e-2)
            for x, _ in batches(6):
                opt.zero_grad()
                used(x).square().mean().backward()
                opt.step()
            rep = autopatch.report()
        finally:
            autopatch.disable()
        return weights(used) + weights(unused), opt.state_dict(), rep
    ref, got = go(False), go(True)
    assert_same(ref[0], got[0])
    assert_state_equal(ref[1], got[1])
    fusion = stepped(got[2])["fusion"]
    assert fusion["fused_steps"] >= 5 and fusion["fallback_group_steps"] == 1, str(fusion)
    assert fusion["replans"] == 2


class FailsOnce(torch.optim.Adam):
    """Raises at the start of its third step(), as a bad batch or a user check might."""

    calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 3:
            raise FloatingPointError("bad batch")
        return super().step(closure)


def test_a_step_that_raises_leaves_the_optimizer_usable():
    def go(patched):
        model = mlp()
        if patched:
            autopatch.enable(mode="multi_layer", chunk_bytes=CHUNK)
        try:
            opt = FailsOnce(model.parameters(), lr=1e-2)
            for i, (x, y) in enumerate(batches(6)):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                try:
                    opt.step()
                except FloatingPointError:
                    sd = opt.state_dict()   # right after the failure: the user's params, as unpatched
                    assert len(sd["param_groups"][0]["params"]) == len(list(model.parameters()))
            rep = autopatch.report()
        finally:
            autopatch.disable()
        return weights(model), opt.state_dict(), rep
    ref, got = go(False), go(True)
    assert_same(ref[0], got[0])
    assert_state_equal(ref[1], got[1])
    assert stepped(got[2])["steps"] == 6
