"""autopatch.contrib: Bagua's fuse_optimizer / fuse_step, equal bit for bit to the unfused run."""

import copy
import json
import types
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_
from torch.optim import Optimizer

from autopatch.contrib import LEFT_TO_FUSE_STEP, fuse_optimizer, fuse_step, is_fused_optimizer
from spawn import run_python
from training import assert_same, assert_state_equal, batches, clone, mlp, train, weights


def warmup_linear(x, warmup=0.002):
    if x < warmup:
        return x / warmup
    return max((x - 1.0) / (warmup - 1.0), 0)


class BertAdam(Optimizer):
    """BERT's Adam as pytorch_pretrained_bert shipped it (the optimizer of Bagua's example):
    ``.data`` arithmetic, an int step, a warmup schedule and per-parameter gradient clipping."""

    def __init__(self, params, lr, warmup=-1, t_total=-1, schedule="warmup_linear", b1=0.9,
                 b2=0.999, e=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        defaults = dict(lr=lr, schedule=schedule, warmup=warmup, t_total=t_total, b1=b1, b2=b2,
                        e=e, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["next_m"] = torch.zeros_like(p.data)
                    state["next_v"] = torch.zeros_like(p.data)
                next_m, next_v = state["next_m"], state["next_v"]
                beta1, beta2 = group["b1"], group["b2"]
                if group["max_grad_norm"] > 0:
                    clip_grad_norm_(p, group["max_grad_norm"])
                next_m.mul_(beta1).add_(grad, alpha=1 - beta1)
                next_v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = next_m / (next_v.sqrt() + group["e"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p.data
                if group["t_total"] != -1:
                    progress = state["step"] / group["t_total"]
                    lr_scheduled = group["lr"] * warmup_linear(progress, group["warmup"])
                else:
                    lr_scheduled = group["lr"]
                p.data.add_(-lr_scheduled * update)
                state["step"] += 1
        return loss


class TinyBert(nn.Module):
    def __init__(self, vocab=40, width=16, classes=3):
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = nn.Embedding(vocab, width)
        self.LayerNorm = nn.LayerNorm(width)
        self.dense = nn.Linear(width, width)
        self.classifier = nn.Linear(width, classes)

    def forward(self, ids):
        h = self.LayerNorm(self.embeddings(ids)).mean(dim=1)
        return self.classifier(torch.tanh(self.dense(h)))


def bert_batches(n, vocab=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def train_bert(fused, max_grad_norm, steps=10):
    """Bagua's example: BertAdam over BERT's decay / no-decay groups, fuse_step() in the loop."""
    model = TinyBert()
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    named = list(model.named_parameters())
    parameters = [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = BertAdam(parameters, lr=5e-3, warmup=0.1, t_total=steps, max_grad_norm=max_grad_norm)
    if fused:
        optimizer = fuse_optimizer(optimizer, do_flatten=True)
    losses = []
    for ids, labels in bert_batches(steps):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        if fused:
            optimizer.fuse_step()
        else:
            optimizer.step()
        losses.append(loss.item())
    return losses, weights(model), optimizer


def flat_of(opt):
    return opt.fuse_step.__self__.flat


def test_bert_adam_example_fuses_and_equals_unfused():
    ref_losses, ref_w, ref_opt = train_bert(False, max_grad_norm=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses, w, opt = train_bert(True, max_grad_norm=-1)
    assert_same(losses, ref_losses)
    assert_same(w, ref_w)
    assert_state_equal(opt.state_dict(), ref_opt.state_dict())
    layout = flat_of(opt).describe()
    assert layout["fused_steps"] == 10 and layout["fused_params"] == 7 and layout["runs"] >= 2   # a run per group at least


def test_bert_adam_with_per_tensor_clipping_falls_back_to_step_and_says_why():
    """BERT's default max_grad_norm clips each tensor by its own norm: not elementwise, so fusing
    would change results (Bagua silently did). The probe sees it; fuse_step warns once."""
    ref_losses, ref_w, _ = train_bert(False, max_grad_norm=1.0)
    with pytest.warns(RuntimeWarning, match="BertAdam is stepped unfused: per-tensor") as caught:
        losses, w, opt = train_bert(True, max_grad_norm=1.0)
    assert len([c for c in caught if "stepped unfused" in str(c.message)]) == 1
    assert_same(losses, ref_losses)
    assert_same(w, ref_w)
    assert flat_of(opt).fused_steps == 0


def as_fused(opt):
    """The optimizer as the shared training loop sees it, stepping with fuse_step()."""
    return types.SimpleNamespace(step=opt.fuse_step, zero_grad=opt.zero_grad)


@pytest.mark.filterwarnings("error")   # e.g. the scheduler's "lr_scheduler.step() before optimizer.step()"
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("closure", [False, True])
def test_adadelta_as_in_the_api_doc(set_to_none, closure):
    def run(fused):
        model = mlp()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        if fused:
            before = {p.untyped_storage().data_ptr() for p in model.parameters()}
            optimizer = fuse_optimizer(optimizer, do_flatten=True)
            storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
            assert not storages & before, "do_flatten moves every parameter into flat buffers up front"
            assert len(storages) <= 2, "one buffer for the smallest parameters, one for the rest"
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        loop_opt = as_fused(optimizer) if fused else optimizer
        losses = train(model, loop_opt, batches(8), sched, set_to_none=set_to_none, closure=closure)
        return losses, weights(model), optimizer
    ref_losses, ref_w, ref_opt = run(False)
    losses, w, opt = run(True)
    assert_same(losses, ref_losses)
    assert_same(w, ref_w)
    assert_state_equal(opt.state_dict(), ref_opt.state_dict())
    assert flat_of(opt).fused_steps == 8


def test_step_keeps_its_ordinary_behaviour_between_fused_steps():
    def run(fused):
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if fused:
            fuse_optimizer(opt)
        for i, (x, y) in enumerate(batches(8)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            (opt.fuse_step if fused and i % 2 else opt.step)()
        return weights(model), opt
    ref_w, _ = run(False)
    w, opt = run(True)
    assert_same(w, ref_w)
    assert flat_of(opt).fused_steps == 4


@pytest.mark.parametrize("check_flatten", [True, False])
def test_reassigned_param_data_is_detected(check_flatten):
    """``param.data = ...`` takes a parameter out of the flat buffer. check_flatten=True puts it
    back (Bagua only warned); False steps it unfused. Either way results stay equal."""
    def run(fused):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if fused:
            fuse_optimizer(opt, check_flatten=check_flatten)
        loop_opt = as_fused(opt) if fused else opt
        data = batches(8)
        train(model, loop_opt, data[:4])
        model[0].weight.data = model[0].weight.data.clone()
        train(model, loop_opt, data[4:])
        return weights(model), opt, model
    ref_w, _, _ = run(False)
    w, opt, model = run(True)
    assert_same(w, ref_w)
    layout = flat_of(opt).describe()
    assert layout["replans"] >= 2 and layout["fused_steps"] == 8
    moved = model[0].weight.untyped_storage().data_ptr()
    flat = {q.untyped_storage().data_ptr() for q in model.parameters() if q is not model[0].weight}
    if check_flatten:
        assert layout["fused_params"] == 14 and moved in flat
    else:
        assert layout["fused_params"] == 13 and moved not in flat


def user_flattened(model, groups):
    """Lay the parameters out back to back in one buffer of the user's, group after group."""
    params = [p for g in groups for p in g]
    buf = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = buf[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return buf


@pytest.mark.parametrize("layout", ["by_group", "interleaved", "separate"])
def test_do_flatten_false_fuses_only_what_is_already_back_to_back(layout):
    def run(fused):
        model = mlp()
        decay = [p for p in model.parameters() if p.dim() > 1]
        no_decay = [p for p in model.parameters() if p.dim() <= 1]
        if layout != "separate":
            user_flattened(model, [decay, no_decay] if layout == "by_group" else [list(model.parameters())])
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-3}, {"params": no_decay}],
                              lr=0.05, momentum=0.9)
        if fused:
            fuse_optimizer(opt, do_flatten=False)
        ptrs = [p.data_ptr() for p in model.parameters()]
        train(model, as_fused(opt) if fused else opt, batches(6))
        assert [p.data_ptr() for p in model.parameters()] == ptrs, "do_flatten=False never moves a parameter"
        return weights(model), opt
    ref_w, _ = run(False)
    w, opt = run(True)
    assert_same(w, ref_w)
    fused_params = flat_of(opt).describe()["fused_params"]
    assert fused_params == {"by_group": 14, "interleaved": 0, "separate": 0}[layout]


@pytest.mark.parametrize("do_flatten", [True, False])
def test_parameters_aliasing_one_buffer_are_never_fused(do_flatten):
    """Two parameters viewing overlapping memory must stay aliased and be stepped one by one
    (Bagua built overlapping views over such buffers)."""
    def run(fused):
        buf = torch.linspace(-1, 1, 40)
        a, b, c = (nn.Parameter(buf[s:e]) for s, e in ((0, 20), (10, 30), (30, 40)))
        opt = torch.optim.SGD([a, b, c], lr=0.1, momentum=0.9)
        if fused:
            fuse_optimizer(opt, do_flatten=do_flatten)
        for i in range(4):
            opt.zero_grad()
            ((a * (i + 1)).sum() + (b ** 2).sum() + c.sum()).backward()
            (opt.fuse_step if fused else opt.step)()
        assert a.data_ptr() + 10 * a.element_size() == b.data_ptr(), "a and b still alias"
        return [a.detach().clone(), b.detach().clone(), c.detach().clone()], opt
    ref, _ = run(False)
    got, opt = run(True)
    assert_same(got, ref)
    assert flat_of(opt).describe()["fused_params"] == 0


def test_is_fused_optimizer_and_fusing_twice():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not is_fused_optimizer(opt)
    with pytest.raises(TypeError, match="call fuse_optimizer"):
        fuse_step(opt)
    assert fuse_optimizer(opt) is opt and is_fused_optimizer(opt)
    bound = opt.fuse_step
    assert fuse_optimizer(opt, do_flatten=False) is opt and opt.fuse_step == bound
    assert not is_fused_optimizer(copy.deepcopy(opt)), "copies carry neither fuse_step nor flat buffers"
    ((x, y),) = batches(1)
    nn.functional.cross_entropy(model(x), y).backward()
    fuse_step(opt)   # Bagua's function form
    assert flat_of(opt).fused_steps == 1


@pytest.mark.parametrize("direction", ["fused_to_plain", "plain_to_fused"])
def test_state_dict_round_trip_between_fused_and_plain(direction):
    """A checkpoint moves freely: fused and plain optimizers write and read the same state_dict
    (Adam: a 0-dim step tensor per parameter, which Bagua's flattening could not narrow)."""
    data = batches(10)
    ref_model = mlp()
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    train(ref_model, ref_opt, data[:5])
    mid_state = copy.deepcopy(ref_opt.state_dict())
    train(ref_model, ref_opt, data[5:])

    first_fused = direction == "fused_to_plain"
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if first_fused:
        fuse_optimizer(opt)
    train(model, as_fused(opt) if first_fused else opt, data[:5])
    saved = opt.state_dict()
    assert_state_equal(saved, mid_state)

    resumed_model = clone(model)
    resumed_opt = torch.optim.Adam(resumed_model.parameters(), lr=1e-2)
    if not first_fused:
        fuse_optimizer(resumed_opt)
    resumed_opt.load_state_dict(copy.deepcopy(saved))
    train(resumed_model, resumed_opt if first_fused else as_fused(resumed_opt), data[5:])
    assert_same(weights(resumed_model), weights(ref_model))
    assert_state_equal(resumed_opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("order", ["enable_first", "fuse_first", "runtime_stepped_first"])
def test_under_enable_each_step_is_fused_once(ap, order):
    """With autopatch.enable() active too, fuse_step() fuses (once: the runtime stops fusing that
    optimizer, and still hears of its steps), step() stays ordinary, and the report says who fuses it."""
    def adam(model):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = batches(10)
    ref_model = mlp()
    ref_opt, ref_sched = adam(ref_model)
    train(ref_model, ref_opt, data, ref_sched)
    del ref_opt, ref_sched   # only the optimizer under test is adopted by enable()

    model = mlp()
    if order != "fuse_first":
        ap.enable(mode="multi_layer", chunk_bytes=4096)
    opt, sched = adam(model)
    done = 0
    if order == "runtime_stepped_first":
        train(model, opt, data[:2], sched)   # the runtime fuses these and flattens the params
        done = 2
    fuse_optimizer(opt)
    if order == "fuse_first":
        ap.enable(mode="multi_layer", chunk_bytes=4096)
    train(model, as_fused(opt), data[done:6], sched)
    (entry,) = ap.report()["optimizers"]
    assert entry["reason"] == LEFT_TO_FUSE_STEP and entry["steps"] == 6 and entry["mode"] == "off"
    ap.disable()
    train(model, as_fused(opt), data[6:], sched)
    assert_same(weights(model), weights(ref_model))
    layout = flat_of(opt).describe()
    assert layout["fused_steps"] == 10 - done and layout["fused_params"] == 14


def test_reachable_as_an_attribute_of_the_package_after_import_autopatch():
    """``import autopatch; autopatch.contrib.fuse_optimizer(...)``, in a fresh interpreter: the
    subpackage is imported on first use, and ``import autopatch`` alone still loads no torch."""
    code = """if True:
        import json, sys
        import autopatch
        torch_at_import = "torch" in sys.modules
        import torch
        model = torch.nn.Linear(4, 4)
        opt = autopatch.contrib.fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(2, 4)).sum().backward()
        before = model.weight.detach().clone()
        opt.fuse_step()
        print(json.dumps({"torch_at_import": torch_at_import,
                          "fused": autopatch.contrib.is_fused_optimizer(opt),
                          "stepped": not torch.equal(before, model.weight),
                          "same_module": autopatch.contrib is sys.modules["autopatch.contrib"]}))
    """
    out = run_python(["-c", code])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"torch_at_import": False, "fused": True, "stepped": True,
                                      "same_module": True}
