"""What users see of ``p.grad`` does not change under any mode: a tensor of the parameter's shape
after backward and after ``step()``, equal to unpatched's, that clipping and GradScaler read and
write as usual; None after ``zero_grad()``; None for a parameter that got no gradient. Backward
fusion is the one exception by design: it consumes each gradient inside backward, which it only
does where the first steps showed nothing reads them."""

import pytest
import torch
from torch import nn

import autopatch
from training import assert_same, batches, mlp

MODES = ["multi_layer", "forward", "auto"]


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        return self.body(x)


def grads_seen(mode, set_to_none=True, clip=False):
    """Per step: the grads after backward, after step() and after zero_grad() (as clones)."""
    model = WithUnused()
    if mode:
        autopatch.enable(mode=mode, chunk_bytes=2048, fusion={"observe_steps": 1})
    seen = []
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(6):
            nn.functional.cross_entropy(model(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            after_backward = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            opt.step()
            after_step = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            shapes_ok = all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())
            opt.zero_grad(set_to_none=set_to_none)
            after_zero = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            seen.append((after_backward, after_step, after_zero, shapes_ok))
        autopatch.flush()
        weights = [p.detach().clone() for p in model.parameters()]
        ran = autopatch.report()["optimizers"][0]["mode"] if mode else None
    finally:
        autopatch.disable()
    return seen, weights, ran


def same_or_none(a, b):
    assert [x is None for x in a] == [y is None for y in b]
    assert_same([x for x in a if x is not None], [y for y in b if y is not None])


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_grads_look_as_unpatched(ap, mode, set_to_none, clip):
    ref, ref_weights, _ = grads_seen(None, set_to_none, clip)
    got, weights, ran = grads_seen(mode, set_to_none, clip)
    assert ran in ("off", "multi_layer", "forward", "backward") and (ran != "backward" or not clip)
    for (rb, rs, rz, _), (gb, gs, gz, shapes_ok) in zip(ref, got):
        assert shapes_ok
        same_or_none(rb, gb)
        same_or_none(rs, gs)
        same_or_none(rz, gz)
    assert got[0][0][-1] is None and got[0][1][-1] is None      # the unused layer's grad
    assert_same(ref_weights, weights)
