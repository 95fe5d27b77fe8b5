"""QAdam: Adam whose second moment is frozen after warm-up, so its first moment can travel in 8 bits.

Warm-up (the first ``warmup_steps`` optimizer steps) is plain Adam on averaged gradients. After
it, on every rank and every step, with g the local gradient:

    g += weight_decay * x                  (Adam; AdamW instead decays x *= 1 - lr * weight_decay)
    m = beta1 m + (1 - beta1) g            (the switch step's own gradient included)
    m = average of m over the ranks        (8-bit min-max scatter-gather)
    x -= lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^T)) + eps)

where v and T, the step count of v's last update, stay as warm-up left them: the frozen variance
keeps the bias correction it had, rather than one that grows towards 1 for a v that no longer
accumulates. Every rank applies the same averaged m to the same x, so replicas stay identical.
Each rank's m / sqrt(...) is clipped to the bound Adam's own steps obey, (1 - beta1) /
sqrt(1 - beta2) (``step_bound``), before it is averaged: where warm-up saw almost no gradient, the
frozen v is near 0 and a later gradient would otherwise make a step of any size.

What travels is m / (sqrt(v / (1 - beta2^T)) + eps), the step's direction, rather than m: the
frozen denominator is the same on every rank, so its average is the average of m, but its 8-bit
code steps are in units of the update. Coded as m, the largest moments set the code step and the
error on an element with a tiny v, divided by its sqrt(v), becomes a huge step (digits' always
blank pixels have v = 0 and diverge that way). Elements with v = 0 (never a gradient during
warm-up) have no step size to freeze, and stay where they are.
The moment is updated and averaged inside the optimizer step rather than during backward, so
clipping and loss scaling between backward and step apply to it as they would under Adam.

After warm-up it holds, besides Adam's own state, two parameter-sized buffers filled again each
step (the frozen denominator, and the step direction, laid out flat for the average): fresh
model-sized allocations every step would cost more in new pages than the arithmetic.

Two ways in:
- ``QAdamOptimizer``: a ``torch.optim.Adam`` (same state, same checkpoints) whose ``step()``
  switches by itself after ``warmup_steps``;
- ``QAdam`` (the algorithm a DDP takeover drives): ``gradient_sync()`` is True during warm-up,
  and afterwards ``step(optimizer)`` replaces a user's ``torch.optim.Adam`` or ``AdamW`` step,
  working on that optimizer's own state (``exp_avg``, ``exp_avg_sq``, ``step``).

"""

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...policy import check_algorithm_setting
from ...stand_ins import stands_for, user_params
from ...torch_internals import group_timeout, unhooked_step
from ..waiting import Waiter
from .base import Algorithm, whole_number
from .compressed_average import DEFAULT_SLICE_ELEMENTS, CompressedAverage


# The step count a parameter's second moment froze at, kept in the optimizer's own state: it is
# checkpointed with the rest, and survives the parameter objects a fused step puts in its place
# (autopatch.contrib.fuse_optimizer's chunks are new objects after every ordinary step).
FROZEN_STEP = "qadam_frozen_step"


def unsupported(optimizer):
    """Why ``FrozenVarianceAdam`` cannot take this optimizer's steps over, or None."""
    if not isinstance(optimizer, torch.optim.Adam):
        return f"QAdam continues torch.optim.Adam and AdamW only, not {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "differentiable=True: the update must stay on autograd's graph"
        if any(p.is_complex() for p in group["params"]):
            return "complex parameters"
    return None


class FrozenVarianceAdam:
    """QAdam's post-warm-up step on an Adam or AdamW, averaging its first moment with ``average``
    (a function that averages a list of tensors in place across the ranks)."""

    def __init__(self, average):
        self.average = average
        # parameter -> (the v it was computed from, denominator, v == 0 or None); weakly keyed:
        # fused steps bring new chunk objects, and dead ones must not be kept alive
        self.denoms = WeakIdKeyDictionary()
        self._directions = None    # (what the optimizer steps, its DirectionLayout)

    def __call__(self, optimizer):
        reason = unsupported(optimizer)
        if reason is not None:
            raise ValueError(f"autopatch qadam: {reason}")
        groups = optimizer.param_groups
        stepped = [p for g in groups for p in g["params"]]
        layout = self._layout(stepped, [p for g in groups for p in user_params(g)])
        steps = []
        with torch.no_grad():
            for group in groups:
                for p in group["params"]:
                    steps.append(self._prepare(optimizer, p, group, layout.direction(p)))
            layout.gather()
            self.average(layout.flats)
            layout.scatter()
            for p, group, denom, direction in steps:
                if denom is not None:
                    self._apply(optimizer, p, group, denom, direction)

    def _layout(self, stepped, users):
        """Where each stepped tensor's direction goes, kept while the optimizer steps the same ones."""
        key = [(id(p), p.data_ptr()) for p in stepped] + [id(p) for p in users]
        if self._directions is None or self._directions[0] != key:
            self._directions = key, DirectionLayout(stepped, users)
        return self._directions[1]

    def _prepare(self, optimizer, p, group, direction):
        """Update m with the local gradient; into ``direction`` the step direction m / sqrt(v),
        held within Adam's bound (zero where v is)."""
        state = optimizer.state[p]
        if not state:
            _start_state(state, p, group)
        state.setdefault(FROZEN_STEP, int(state["step"]))
        m = state["exp_avg"]
        if p.grad is not None:
            g = -p.grad if group["maximize"] else p.grad
            if group["weight_decay"] and not _decoupled(optimizer, group):
                g = g.add(p, alpha=group["weight_decay"])
            m.lerp_(g, 1 - float(group["betas"][0]))
        if not state[FROZEN_STEP]:
            return p, group, None, direction.zero_()
        v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
        denom, blank = self._denominator(p, group, v, state[FROZEN_STEP])
        torch.div(m, denom, out=direction)
        if blank is not None:
            direction.masked_fill_(blank, 0)
        bound = step_bound(group["betas"])
        direction.clamp_(-bound, bound)
        return p, group, denom, direction

    def _denominator(self, p, group, v, frozen):
        """sqrt(v / (1 - beta2^T)) + eps, T the step v froze at, and where v is zero (no gradient
        in warm-up, so no step size), if anywhere. v no longer changes: computed once, and again
        only when the state holds another v (a loaded checkpoint). One parameter-sized buffer."""
        cached = self.denoms.get(p)
        if cached is None or cached[0] is not v:
            denom = (v.sqrt() / math.sqrt(1 - float(group["betas"][1]) ** frozen)).add_(group["eps"])
            blank = v == 0
            cached = self.denoms[p] = (v, denom, blank if blank.any() else None)
        return cached[1], cached[2]

    def _apply(self, optimizer, p, group, denom, direction):
        state = optimizer.state[p]
        torch.mul(direction, denom, out=state["exp_avg"])      # the averaged m, kept as Adam keeps it
        state["step"] += 1
        lr = float(group["lr"])
        if group["weight_decay"] and _decoupled(optimizer, group):
            p.mul_(1 - lr * group["weight_decay"])
        p.add_(direction, alpha=-lr / (1 - float(group["betas"][0]) ** int(state["step"])))


class DirectionLayout:
    """The step directions QAdam averages, laid out as the unpatched step lays them out: one flat
    buffer per dtype and device holding each of the user's parameters in the optimizer's order,
    element by element in the parameter's own index order. The 8-bit average codes its rows with
    a min and max each, so which elements share a row decides the result.

    A stepped tensor that is the user's parameter writes its direction there directly. A flat
    chunk a fused step hands the optimizer (``stand_ins``) writes into a buffer laid out as the
    memory it updates; its parameters' directions are copied into the flat buffers before the
    average (``gather``) and back after it (``scatter``).
    """

    def __init__(self, stepped, users):
        chunks, laid = [], {id(p): p for p in users}
        for t in stepped:
            if stands_for(t)[0] is t:
                # in the user's list, or (a swap stand_ins was not told of) placed after it
                laid.setdefault(id(t), t)
            else:
                chunks.append(t)
        by_kind = {}
        for p in laid.values():
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        self.flats, self._views = [], {}
        for (dtype, device), ps in by_kind.items():
            self.flats.append(torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=device))
            for p, piece in zip(ps, self.flats[-1].split([p.numel() for p in ps])):
                self._views[id(p)] = piece.view(p.shape)
        self._direction = {id(t): self._views[id(t)] for t in stepped if id(t) in self._views}
        self._copies = []
        for memory in _by_storage(chunks):
            self._mirror(memory)

    def _mirror(self, chunks):
        """One buffer laid out as the storage the ``chunks`` (and their parameters) live in."""
        base = min(c.storage_offset() for c in chunks)
        end = max(c.storage_offset() + c.numel() for c in chunks)
        buffer = torch.empty(end - base, dtype=chunks[0].dtype, device=chunks[0].device)
        params = {}
        for c in chunks:
            self._direction[id(c)] = buffer.as_strided(c.shape, c.stride(), c.storage_offset() - base)
            params.update((id(p), p) for p in stands_for(c))
        for i, p in params.items():
            memory = buffer.as_strided(p.shape, p.stride(), p.storage_offset() - base)
            self._copies.append((self._views[i], memory))

    def direction(self, tensor):
        return self._direction[id(tensor)]

    def gather(self):
        for flat_view, memory_view in self._copies:
            flat_view.copy_(memory_view)

    def scatter(self):
        for flat_view, memory_view in self._copies:
            memory_view.copy_(flat_view)


def _by_storage(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return groups.values()


def step_bound(betas):
    """The most Adam's own m / sqrt(v) can be per element, (1 - beta1) / sqrt(1 - beta2) (at
    least 1; Kingma and Ba, section 2.1). A frozen v cannot follow a gradient that grows (a ReLU
    unit that wakes up after warm-up, with v near 0), so the direction is held within that bound:
    unbounded, it diverges within a few steps on such units."""
    beta1, beta2 = (float(b) for b in betas)
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def _decoupled(optimizer, group):
    return bool(group.get("decoupled_weight_decay")) or isinstance(optimizer, torch.optim.AdamW)


def _start_state(state, p, group):
    """Adam's own initial state, for a parameter that never took a step."""
    state["step"] = torch.tensor(0.0)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class QAdamOptimizer(torch.optim.Adam):
    """``torch.optim.Adam`` for ``warmup_steps`` steps (gradients averaged by the caller, as DDP
    does), QAdam afterwards, averaging the first moment over ``process_group`` (default: the
    world). The step count restarts with the object: a resumed run warms up again."""

    def __init__(self, params, lr=1e-3, warmup_steps=100, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 *, process_group=None, hierarchical=False, compression="minmax_uint8",
                 slice_elements=DEFAULT_SLICE_ELEMENTS, timeout_seconds=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.warmup_steps = check_algorithm_setting("qadam", "warmup_steps", warmup_steps, "QAdamOptimizer")
        self.steps_taken = 0
        self._average = dict(compression=compression, hierarchical=hierarchical, slice_elements=slice_elements)
        self._group = process_group
        self._timeout_seconds = timeout_seconds
        self._after_warmup = None

    def set_hierarchical(self, flag):
        """Average within nodes, then between node leaders, from the switch on (Bagua's
        QAdamAlgorithm chose this for its optimizer); only before the switch."""
        if self._after_warmup is not None:
            raise RuntimeError("QAdamOptimizer: the first moment is already averaged; set hierarchical before "
                               "warm-up ends")
        self._average["hierarchical"] = bool(flag)

    def step(self, closure=None):
        if self.steps_taken < self.warmup_steps:
            loss = _adam_step(self, closure)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self._after_warmup is None:    # all ranks get here at the same step
                group = self._group if self._group is not None else torch.distributed.group.WORLD
                device = self.param_groups[0]["params"][0].device
                timeout = group_timeout(group, device) if self._timeout_seconds is None else self._timeout_seconds
                self._after_warmup = FrozenVarianceAdam(
                    CompressedAverage(group, device, Waiter(timeout, "qadam"), **self._average))
            self._after_warmup(self)
        self.steps_taken += 1
        return loss


def _adam_step(optimizer, closure):
    """``torch.optim.Adam``'s own step. ``Optimizer`` wraps each class's ``step`` once with the
    step hooks; they already ran around this class's step, so Adam's runs unwrapped."""
    step = unhooked_step(torch.optim.Adam) or torch.optim.Adam.step
    return step(optimizer, closure)


class QAdam(Algorithm):
    name = "qadam"
    changes = ("after warmup_steps of ordinary gradient averaging, Adam's second moment is frozen and "
               "ranks average Adam's first moment in 8 bits instead of gradients")
    fusion_modes = ()
    fusion_refusal = "after warm-up qadam steps the optimizer itself (its step is not fused)"

    def __init__(self, params, group, *, warmup_steps=100, hierarchical=False, compression="minmax_uint8",
                 slice_elements=DEFAULT_SLICE_ELEMENTS, timeout_seconds=None):
        super().__init__(params, group, timeout_seconds=timeout_seconds)
        self.warmup_steps = self.setting("warmup_steps", warmup_steps)
        self.options = {"hierarchical": bool(hierarchical), "compression": compression,
                        "slice_elements": whole_number("slice_elements", slice_elements, 1)}
        self.average = CompressedAverage(group, self.params[0].device, self.waiter, **self.options)
        self.update = FrozenVarianceAdam(self._average_moments)

    def settings(self):
        return {"warmup_steps": self.warmup_steps, **self.options}

    @property
    def compressing(self):
        """Past warm-up: ``step(optimizer)`` takes the place of the optimizer's own step."""
        return self.steps >= self.warmup_steps

    def gradient_sync(self):
        return not self.compressing

    def fits(self, optimizer, stepped):
        why = unsupported(optimizer)
        mine = {id(p) for p in self.params}
        if why is None and any(id(p) not in mine for p in stepped):
            why = f"{type(optimizer).__name__} also updates parameters outside this model"
        if why is None and isinstance(optimizer, QAdamOptimizer):
            self.warmup_steps = optimizer.warmup_steps   # its own switch says when averaging stops
        return why

    def takes_step_of(self, optimizer):
        """Past warm-up, for an Adam or AdamW; a QAdamOptimizer switches by itself."""
        return self.compressing and not isinstance(optimizer, QAdamOptimizer)

    def step(self, optimizer):
        """One QAdam step for ``optimizer`` (an Adam or AdamW over these parameters), on its own
        state; call it instead of ``optimizer.step()`` once ``compressing``, then ``after_step``."""
        self.update(optimizer)

    def _average_moments(self, moments):
        self.average(moments, "the first-moment average")
        self.bytes_sent = self.average.bytes_sent

    def describe(self):
        return dict(super().describe(), phase="compressing" if self.compressing else "warm-up")
