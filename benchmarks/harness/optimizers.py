"""Optimizers torch does not ship, as training scripts write them."""

import torch


class BertAdam(torch.optim.Optimizer):
    """A hand-written Adam with decoupled weight decay, in the style of BERT's optimizer:
    plain tensor ops in a Python loop, state created lazily, no bias correction: the kind of
    optimizer torch has no foreach or fused kernel for."""

    def __init__(self, params, lr=1e-3, b1=0.9, b2=0.999, e=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, b1=b1, b2=b2, e=e, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["next_m"] = torch.zeros_like(p)
                    state["next_v"] = torch.zeros_like(p)
                m, v = state["next_m"], state["next_v"]
                m.mul_(group["b1"]).add_(p.grad, alpha=1 - group["b1"])
                v.mul_(group["b2"]).addcmul_(p.grad, p.grad, value=1 - group["b2"])
                update = m / (v.sqrt() + group["e"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])
        return loss
