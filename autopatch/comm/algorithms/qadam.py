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

What travels is m / (sqrt(v / (1 - beta2^T)) + eps), the step's direction, rather than m: the
frozen denominator is the same on every rank, so its average is the average of m, but its 8-bit
code steps are in units of the update. Coded as m, the largest moments set the code step and the
error on an element with a tiny v, divided by its sqrt(v), becomes a huge step (digits' always
blank pixels have v = 0 and diverge that way). Elements with v = 0 (never a gradient during
warm-up) have no step size to freeze, and stay where they are.
The moment is updated and averaged inside the optimizer step rather than during backward, so
clipping and loss scaling between backward and step apply to it as they would under Adam.

Two ways in:
- ``QAdamOptimizer``: a ``torch.optim.Adam`` (same state, same checkpoints) whose ``step()``
  switches by itself after ``warmup_steps``;
- ``QAdam`` (the algorithm a DDP takeover drives): ``gradient_sync()`` is True during warm-up,
  and afterwards ``step(optimizer)`` replaces a user's ``torch.optim.Adam`` or ``AdamW`` step,
  working on that optimizer's own state (``exp_avg``, ``exp_avg_sq``, ``step``).

"""

import math

import torch

from .base import Algorithm, Waiter, group_timeout, whole_number
from .compressed_average import DEFAULT_BUCKET_ELEMENTS, CompressedAverage


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
        self.frozen = {}           # parameter -> its step count when its second moment froze

    def __call__(self, optimizer):
        reason = unsupported(optimizer)
        if reason is not None:
            raise ValueError(f"autopatch qadam: {reason}")
        steps = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    steps.append(self._prepare(optimizer, p, group))
            self.average([direction for *_, direction in steps])
            for p, group, denom, direction in steps:
                if denom is not None:
                    self._apply(optimizer, p, group, denom, direction)

    def _prepare(self, optimizer, p, group):
        """Update m with the local gradient; the step direction m / sqrt(v) (zero where v is)."""
        state = optimizer.state[p]
        if not state:
            _start_state(state, p, group)
        self.frozen.setdefault(p, int(state["step"]))
        m = state["exp_avg"]
        if p.grad is not None:
            g = -p.grad if group["maximize"] else p.grad
            if group["weight_decay"] and not _decoupled(optimizer, group):
                g = g.add(p, alpha=group["weight_decay"])
            m.lerp_(g, 1 - float(group["betas"][0]))
        if not self.frozen[p]:
            return p, group, None, torch.zeros_like(m)
        v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
        denom = (v.sqrt() / math.sqrt(1 - float(group["betas"][1]) ** self.frozen[p])).add_(group["eps"])
        return p, group, denom, torch.where(v > 0, m / denom, 0)

    def _apply(self, optimizer, p, group, denom, direction):
        state = optimizer.state[p]
        torch.mul(direction, denom, out=state["exp_avg"])      # the averaged m, kept as Adam keeps it
        state["step"] += 1
        lr = float(group["lr"])
        if group["weight_decay"] and _decoupled(optimizer, group):
            p.mul_(1 - lr * group["weight_decay"])
        p.add_(direction, alpha=-lr / (1 - float(group["betas"][0]) ** int(state["step"])))


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
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, timeout_seconds=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.warmup_steps = whole_number("warmup_steps", warmup_steps, 1)
        self.steps_taken = 0
        self._average = dict(compression=compression, hierarchical=hierarchical, bucket_elements=bucket_elements)
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
    step = torch.optim.Adam.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step(optimizer, closure)


class QAdam(Algorithm):
    name = "qadam"
    changes = ("after warmup_steps of ordinary gradient averaging, Adam's second moment is frozen and "
               "ranks average Adam's first moment in 8 bits instead of gradients")
    fusion_modes = ()
    fusion_refusal = "after warm-up qadam steps the optimizer itself (its step is not fused)"

    def __init__(self, params, group, *, warmup_steps=100, hierarchical=False, compression="minmax_uint8",
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, timeout_seconds=None):
        super().__init__(params, group, timeout_seconds=timeout_seconds)
        self.warmup_steps = whole_number("warmup_steps", warmup_steps, 1)
        self.options = {"hierarchical": bool(hierarchical), "compression": compression,
                        "bucket_elements": whole_number("bucket_elements", bucket_elements, 1)}
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

    def fits(self, optimizer):
        why = unsupported(optimizer)
        mine = {id(p) for p in self.params}
        if why is None and any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
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
