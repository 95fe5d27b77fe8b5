"""Shared training loops for the tests: run the same seeded job patched and unpatched."""

import copy
import hashlib

import torch
from torch import nn

from harness.optimizers import BertAdam  # noqa: F401  the hand-written optimizer the tests check bit for bit


def mlp(width=16, depth=6, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 3))


def batches(n, width=16, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


def train(model, opt, data, sched=None, set_to_none=True, closure=False):
    """A plain loop; returns the loss of every step."""
    losses = []
    for x, y in data:
        def compute():
            opt.zero_grad(set_to_none=set_to_none)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        if closure:
            loss = opt.step(compute)
        else:
            loss = compute()
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b):
    """Bit-for-bit equality of two lists of tensors (or floats)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"tensor {i} differs by {(x - y).abs().max().item()}"
        else:
            assert x == y, f"item {i}: {x} != {y}"


def assert_state_equal(sd_a, sd_b):
    """Two optimizer state_dicts have the same structure and values."""
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k in sd_a["state"]:
        sa, sb = sd_a["state"][k], sd_b["state"][k]
        assert sa.keys() == sb.keys(), (k, sa.keys(), sb.keys())
        for key in sa:
            va, vb = sa[key], sb[key]
            if isinstance(va, torch.Tensor):
                assert va.shape == vb.shape and va.dtype == vb.dtype, (k, key)
                assert torch.equal(va, vb), (k, key)
            else:
                assert va == vb, (k, key)


def clone(model):
    return copy.deepcopy(model)


def digest(model):
    """sha256 over every weight's bytes: equal digests across processes mean bit-for-bit equal weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()
