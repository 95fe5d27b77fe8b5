"""Short training scripts, each run once unpatched and once under autopatch, and what they leave.

Every script trains a small model (``Net``): one ``Leaf`` module per parameter, each adding
``sum(w * coef) * scale + sum(w * w * curv) / 2`` to the loss, so gradients come from a real
backward pass, depend on the weights (a wrong update shows up in every later step) and are the same
in every run (coefficients from a seeded generator, the scale a fixed function of the step number).
Complex parameters enter through ``view_as_real``; sparse ones are embedding tables read with
``F.embedding(..., sparse=True)``, whose gradients are sparse; non-contiguous ones are strided
slices and transposes registered as parameters. Each parameter lives on the module whose forward
reads it, as in a real model (mode forward applies updates in that module's forward pre-hook).

A script ends with ``ctx.finish(...)``, which takes everything compared afterwards: the global state
right after the last ``step()``, each optimizer's raw ``opt.state`` (read first, as a script that
logs it would), its ``state_dict()``, the models' parameters. The runner keeps only that record,
weak references to the optimizers and the parameters a script would still hold, so every optimizer
the script built must be garbage once the script returns.
"""

import copy
import functools
import gc
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler, swa_utils
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from . import state
from .optim_cases import INFOS, fused_on_cpu, stable_hash, torch_rejects, variants

SHAPES = [(7, 5), (13,), (3, 4, 5), (1,), (33, 2), (4, 4)]
MATRIX_SHAPES = [(7, 5), (33, 2), (4, 4), (5, 6)]
TABLE_SHAPES = [(10, 3), (7, 4), (12, 2), (5, 5)]


def _param(shape, kind, gen, i):
    if kind == "complex":
        return nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.complex64))
    if kind == "noncontig":
        if i % 3 == 0:        # every other element of a larger buffer: Parameter(randn(..., 2)[..., 0])
            return nn.Parameter(torch.randn(*shape, 2, generator=gen)[..., 0])
        if i % 3 == 1:        # a transpose (dense, not contiguous), or a strided 1-D slice
            if len(shape) > 1:
                dims = tuple(reversed(range(len(shape))))
                return nn.Parameter(torch.randn(tuple(reversed(shape)), generator=gen).permute(dims))
            return nn.Parameter(torch.randn(3 * shape[0], generator=gen)[1::3])
    return nn.Parameter(torch.randn(shape, generator=gen))


def step_scale(step_no):
    return 1.0 + ((step_no * 7) % 5) / 4


class Leaf(nn.Module):
    def __init__(self, weight, kind, gen):
        super().__init__()
        self.weight = weight
        self.kind = kind
        real = torch.view_as_real(weight.detach()) if weight.is_complex() else weight.detach()
        shape = (4, weight.shape[1]) if kind == "sparse" else real.shape
        self.register_buffer("coef", torch.randn(shape, generator=gen))
        self.register_buffer("curv", 0.1 + torch.rand(shape, generator=gen))

    def forward(self, step_no):
        w = self.weight
        if self.kind == "sparse":
            rows = torch.tensor([(step_no * 3 + k) % w.shape[0] for k in range(4)])
            w = F.embedding(rows, w, sparse=True)
        elif w.is_complex():
            w = torch.view_as_real(w)
        return (w * self.coef).sum() * step_scale(step_no) + 0.5 * (w * w * self.curv).sum()


class Net(nn.Module):
    def __init__(self, variant, seed, leaves=None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        kind = variant.kind
        shapes = TABLE_SHAPES if kind == "sparse" else MATRIX_SHAPES if variant.matrix_only else SHAPES
        shapes = shapes[:leaves]
        self.leaves = nn.ModuleList(Leaf(_param(s, kind, gen, i), kind, gen) for i, s in enumerate(shapes))

    def forward(self, step_no):
        return sum(leaf(step_no) for leaf in self.leaves)

    def halves(self):
        params = list(self.parameters())
        return params[:len(params) // 2], params[len(params) // 2:]

    def train_step(self, opts, closures, step_no=0):
        """zero_grad, forward, backward, step for each optimizer (through a closure where its
        step needs one: the closure recomputes the loss and the gradients of every optimizer)."""
        def closure():
            for o in opts:
                o.zero_grad()
            loss = self(step_no)
            loss.backward()
            return loss
        if isinstance(closures, bool):
            closures = [closures] * len(opts)
        loss = None
        if not any(closures):
            loss = closure()
        for o, needs in zip(opts, closures):
            if needs:
                loss = o.step(closure)
            else:
                o.step()
        return float(loss.detach())


class Outcome:
    """What one run of a script leaves: compared afterwards, and nothing that keeps it alive."""

    def __init__(self):
        self.models = {}           # label -> [(name, parameter clone)]
        self.raw_states = {}       # label -> raw opt.state, by parameter position
        self.state_dicts = {}      # label -> deep copy of opt.state_dict()
        self.checkpoint = None     # a state_dict taken mid-run (the state_dict scenario)
        self.hook_calls = []
        self.records = []          # what the script itself observed along the way
        self.after_last_step = None
        self.refs = []             # (label, weak reference to an optimizer the script built)
        self.dropped_alive = []    # optimizers still alive right after the script dropped them
        self.held = []             # parameters a script would still hold (its model's)
        self.steps = 0


class Ctx:
    """One run of a script: the variant, the step counts, the record."""

    def __init__(self, variant, steps, inject=None, lr_factor=None):
        self.variant = variant
        self.n = steps
        self.inject = inject       # checkpoint -> the checkpoint phase 2 loads (cross-loading)
        self.lr_factor = lr_factor
        self.out = Outcome()
        self.step_no = 0
        self.labels = {}

    # -- building ----------------------------------------------------------------------------
    def net(self, seed=0):
        net = Net(self.variant, seed)
        self.out.held.extend(net.parameters())
        return net

    def build(self, params, label, variant=None, **overrides):
        variant = variant or self.variant
        if self.lr_factor is not None:
            lr = variant.kwargs().get("lr", None)
            base = float(lr) if lr is not None else None
            if base is None:
                from .optim_cases import default_lr
                base = default_lr(variant.info.optim_cls)
            new = base * self.lr_factor
            overrides.setdefault("lr", torch.tensor(new) if isinstance(lr, torch.Tensor) else new)
        opt = variant.build(params, **overrides)
        self.track(opt, label)
        return opt

    def track(self, opt, label):
        self.labels[id(opt)] = label
        self.out.refs.append((label, weakref.ref(opt)))

    def label_of(self, opt):
        return self.labels.get(id(opt), f"an optimizer the script never built ({type(opt).__qualname__})")

    # -- training -----------------------------------------------------------------------------
    def train(self, net, opts, steps=None, after_each=None, variants_=None):
        closures = [(v or self.variant).needs_closure for v in (variants_ or [None] * len(opts))]
        for _ in range(self.n if steps is None else steps):
            loss = net.train_step(opts, closures, step_no=self.step_no)
            self.step_no += 1
            self.out.steps += 1
            if after_each is not None:
                after_each(loss)

    def train_side_by_side(self, *pairs):
        """Each (net, optimizer) of ``pairs`` steps once per script step on the same batch."""
        for _ in range(self.n):
            for net, opt in pairs:
                self.train(net, [opt], steps=1)
                self.step_no -= 1
            self.step_no += 1

    def dropped(self, label):
        """Right after the script dropped optimizer ``label`` (del + gc.collect())."""
        gc.collect()
        for lab, ref in self.out.refs:
            if lab == label and ref() is not None:
                self.out.dropped_alive.append(label)

    # -- the record -----------------------------------------------------------------------------
    def finish(self, opts, models):
        self.out.after_last_step = state.global_state()
        for label, opt in opts.items():       # raw state first: reading it applies nothing
            self.out.raw_states[label] = state.raw_state(opt)
        for label, opt in opts.items():
            self.out.state_dicts[label] = state.clone_tree(opt.state_dict())
        for label, model in models.items():
            self.out.models[label] = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        return self.out


# -- the scripts -------------------------------------------------------------------------------------
def plain(ctx):
    net = ctx.net()
    opt = ctx.build(net.parameters(), "opt")
    ctx.train(net, [opt], steps=2 * ctx.n)
    return ctx.finish({"opt": opt}, {"net": net})


def add_group(ctx):
    """Fine-tuning: the second half of the model is frozen, then unfrozen and added as a group."""
    net = ctx.net()
    first, second = net.halves()
    for p in second:
        p.requires_grad_(False)
    opt = ctx.build(first, "opt")
    ctx.train(net, [opt])
    for p in second:
        p.requires_grad_(True)
    lr = opt.param_groups[0]["lr"]
    opt.add_param_group({"params": second, "lr": lr * 0.5 if isinstance(lr, float) else torch.tensor(float(lr) * 0.5)})
    ctx.train(net, [opt])
    return ctx.finish({"opt": opt}, {"net": net})


def state_dict(ctx, named_first, named_second):
    """torch's test_state_dict_deterministic and test_can_load_from_to_named_state_dict: train,
    checkpoint, load the checkpoint into a new optimizer over copies of the weights (with or without
    parameter names on either side), train both side by side. With ``ctx.inject`` the new
    optimizer loads another run's checkpoint instead (unpatched into patched and back)."""
    net = ctx.net()
    opt = ctx.build(list(net.named_parameters()) if named_first else net.parameters(), "opt")
    ctx.train(net, [opt])
    checkpoint = state.clone_tree(opt.state_dict())
    ctx.out.checkpoint = state.clone_tree(checkpoint)
    if ctx.inject is not None:
        checkpoint = state.clone_tree(ctx.inject(checkpoint))
    net2 = copy.deepcopy(net)
    ctx.out.held.extend(net2.parameters())
    opt2 = ctx.build(list(net2.named_parameters()) if named_second else net2.parameters(), "loaded")
    opt2.load_state_dict(checkpoint)
    ctx.train_side_by_side((net, opt), (net2, opt2))
    return ctx.finish({"opt": opt, "loaded": opt2}, {"net": net, "net2": net2})


def deepcopy(ctx):
    """``copy.deepcopy(optimizer)`` mid-run: the copy holds copies of the parameters (and of their
    gradients); a second model is built around them and both train on."""
    net = ctx.net()
    opt = ctx.build(net.parameters(), "opt")
    ctx.train(net, [opt])
    opt2 = copy.deepcopy(opt)
    ctx.track(opt2, "copy")
    net2 = Net(ctx.variant, seed=0)            # the same coefficients; its weights become the copy's
    for leaf, p in zip(net2.leaves, [p for g in opt2.param_groups for p in g["params"]]):
        leaf.weight = p
    ctx.out.held.extend(net2.parameters())
    ctx.train_side_by_side((net, opt), (net2, opt2))
    return ctx.finish({"opt": opt, "copy": opt2}, {"net": net, "net2": net2})


def hooks(ctx):
    """torch's global step hooks and the optimizer's own (step, state_dict), recorded in order.

    The run gets a learning rate of its own (``ctx.lr_factor``), so autopatch meets these
    hyperparameters for the first time inside the script whatever ran before it in the process."""
    calls = ctx.out.hook_calls

    def rec(name):
        return lambda opt, *args: calls.append((name, ctx.label_of(opt)))
    handles = [register_optimizer_step_pre_hook(rec("global step pre-hook")),
               register_optimizer_step_post_hook(rec("global step post-hook"))]
    try:
        net = ctx.net()
        opt = ctx.build(net.parameters(), "opt")
        handles += [opt.register_step_pre_hook(rec("step pre-hook")),
                    opt.register_step_post_hook(rec("step post-hook")),
                    opt.register_state_dict_pre_hook(lambda o: calls.append(("state_dict pre-hook", ctx.label_of(o)))),
                    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_state_dict post-hook", ctx.label_of(o))))]
        ctx.train(net, [opt])
        opt.load_state_dict(state.clone_tree(opt.state_dict()))
        ctx.train(net, [opt])
        return ctx.finish({"opt": opt}, {"net": net})
    finally:
        for h in handles:
            h.remove()


def schedules(variant):
    """The LR schedules torch's OptimizerInfo lists for this optimizer, then OneCycleLR and a StepLR
    that decays every step (the database's StepLR decays every 10 steps, after these scripts end)."""
    out = [list(s) for s in variant.info.scheduler_inputs]
    defaults = variant.kwargs()

    def one_cycle(opt):
        cycle = "momentum" in opt.defaults or "betas" in opt.defaults
        return lr_scheduler.OneCycleLR(opt, max_lr=float(defaults.get("lr", 1e-3)) * 4, total_steps=1000,
                                       pct_start=0.01, cycle_momentum=cycle)
    out.append([one_cycle])
    out.append([lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)])
    return out


def scheduler(ctx, which):
    net = ctx.net()
    opt = ctx.build(net.parameters(), "opt")
    scheds = [make(opt) for make in schedules(ctx.variant)[which]]

    def step_schedulers(loss):
        for s in scheds:
            if isinstance(s, lr_scheduler.ReduceLROnPlateau):
                s.step(loss)
            else:
                s.step()
    ctx.train(net, [opt], steps=2 * ctx.n, after_each=step_schedulers)
    return ctx.finish({"opt": opt}, {"net": net})


def swa(ctx):
    """Stochastic weight averaging: AveragedModel updated and SWALR stepped after every step."""
    net = ctx.net()
    opt = ctx.build(net.parameters(), "opt")
    averaged = swa_utils.AveragedModel(net)
    sched = swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=2)

    def average(_):
        averaged.update_parameters(net)
        sched.step()
    ctx.train(net, [opt], steps=2 * ctx.n, after_each=average)
    out = ctx.finish({"opt": opt}, {"net": net, "averaged": averaged})
    out.models["averaged.n_averaged"] = [("n_averaged", averaged.n_averaged.clone())]
    return out


def recreate(ctx):
    """The user builds an optimizer, steps it 1, 2 or 3 times and drops it, three times over, then
    builds the one that trains, always over the same parameters."""
    net = ctx.net()
    for first_steps in (1, 2, 3):
        label = f"dropped after {first_steps} step{'s' if first_steps > 1 else ''}"
        opt = ctx.build(net.parameters(), label)
        ctx.train(net, [opt], steps=first_steps)
        del opt
        ctx.dropped(label)
    opt = ctx.build(net.parameters(), "last")
    ctx.train(net, [opt])
    return ctx.finish({"last": opt}, {"net": net})


def two_optimizers(ctx, partner):
    """The model's first half stepped by the case's optimizer, its second half by another one."""
    net = ctx.net()
    first, second = net.halves()
    a = ctx.build(first, "first")
    b = ctx.build(second, "second", variant=partner)
    ctx.train(net, [a, b], steps=2 * ctx.n, variants_=[ctx.variant, partner])
    return ctx.finish({"first": a, "second": b}, {"net": net})


@functools.lru_cache(maxsize=None)
class CountingMode(TorchFunctionMode):
    """A script's own torch function mode (as a FLOP counter, ``with torch.device(...)`` or a
    tracing tool would be): counts the torch calls it sees."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def user_mode(ctx):
    """Each iteration runs inside the script's own TorchFunctionMode: after step() it must still be
    the innermost mode, and see the calls the script makes for the rest of its block."""
    net = ctx.net()
    opt = ctx.build(net.parameters(), "opt")
    for _ in range(2 * ctx.n):
        mode = CountingMode()
        with mode:
            ctx.train(net, [opt], steps=1)
            depth = torch._C._len_torch_function_stack()
            before = mode.calls
            torch.ones(2).add(1)          # the script's own calls after step(), inside its block
            ctx.out.records.append({"modes on the stack after step()": depth,
                                    "calls the script's mode saw after step()": mode.calls - before})
        ctx.out.records.append({"modes on the stack after the block": torch._C._len_torch_function_stack()})
    return ctx.finish({"opt": opt}, {"net": net})


@functools.lru_cache(maxsize=None)
def partner_of(variant):
    """Another optimizer of the database for the model's other half, picked by rotation: one with a
    fused CPU kernel (so policy fast compiles nothing for it), same kind of parameters, torch
    accepts it."""
    pool = [v for info in INFOS.values() if info.name != variant.optim and fused_on_cpu(info)
            for v in variants(info)
            if v.kind == variant.kind and v.lr == "given" and (not v.matrix_only or variant.matrix_only)]
    pool.sort(key=lambda v: stable_hash("partner", variant.id, v.id))
    return next((v for v in pool if torch_rejects(v) is None), None)


SCENARIOS = {
    "plain": plain,
    "add_group": add_group,
    "state_dict": state_dict,
    "deepcopy": deepcopy,
    "hooks": hooks,
    "scheduler": scheduler,
    "swa": swa,
    "recreate": recreate,
    "two_optimizers": two_optimizers,
    "user_mode": user_mode,
}


def scenario_args(scenario, variant):
    """The scenario's own parameters for this variant, rotated by a stable hash: which named/unnamed
    pair, which schedule, how many steps before the re-creation, which partner."""
    h = stable_hash(scenario, variant.id)
    if scenario == "state_dict":
        return {"named_first": bool(h & 1), "named_second": bool(h & 2)}
    if scenario == "scheduler":
        return {"which": h % len(schedules(variant))}
    if scenario == "two_optimizers":
        return {"partner": partner_of(variant)}
    return {}


def applies(scenario, variant):
    """None when the scenario applies to the variant, else why not."""
    info = variant.info
    if scenario in ("add_group", "two_optimizers") and not info.supports_param_groups:
        return "the OptimizerInfo says it does not support param groups"
    if scenario == "two_optimizers" and partner_of(variant) is None:
        return "no other optimizer of the database takes these parameters"
    return None
