"""Parameters autopatch cannot flatten are left per tensor with the reason, never a crash, and a
failure of autopatch inside a step falls back to the unpatched step (FUSEDOPT_STRICT=1 raises).

Planning must decide from metadata alone: asking for the storage of a tensor that has none
(DTensor, any wrapper subclass, a sparse CSR tensor) raises, and reading freed memory crashes the
process.
"""

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import autopatch
from training import assert_same, batches, mlp, train, weights

CHUNK = 1024


class Wrapped(torch.Tensor):
    """A wrapper tensor subclass, as DTensor is one: no storage of its own, every op runs on the
    tensor it wraps."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device, requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if type(t) is torch.Tensor else t, out)


def the_optimizer(report):
    (entry,) = report["optimizers"]
    return entry


def run(build, make_opt, policy, steps=6):
    """Train ``build()`` with ``make_opt`` unpatched or, with ``policy``, under autopatch."""
    model = build()
    if policy is not None:
        autopatch.enable(**policy)
    try:
        opt = make_opt(model)
        losses = train(model, opt, batches(steps))
        return losses, weights(model), opt.state_dict(), autopatch.report() if policy else None
    finally:
        autopatch.disable()


def assert_unchanged(build, make_opt, policy):
    ref, got = run(build, make_opt, None), run(build, make_opt, policy)
    assert_same(got[0], ref[0])
    assert_same([w.inner if isinstance(w, Wrapped) else w for w in got[1]],
                [w.inner if isinstance(w, Wrapped) else w for w in ref[1]])
    return the_optimizer(got[3])


def with_wrapped_head():
    model = mlp()
    model[-1].weight = nn.Parameter(Wrapped(model[-1].weight.detach().clone()))
    return model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_wrapper_subclass_parameter_is_left_unfused_with_the_reason(ap):
    entry = assert_unchanged(with_wrapped_head, adamw, {"mode": "multi_layer", "chunk_bytes": CHUNK})
    assert entry["mode"] == "multi_layer"
    assert entry["fusion"]["excluded_params"] == {"tensor subclass Wrapped": 1}
    assert entry["fusion"]["fused_params"] == len(list(mlp().parameters())) - 1


def test_a_sparse_csr_parameter_is_left_unfused(ap):
    """SGD steps a CSR tensor unpatched; its storage cannot even be asked for."""
    csr = nn.Parameter(torch.eye(6).to_sparse_csr())

    def make_opt(model):
        return torch.optim.SGD([*model.parameters(), csr], lr=0.1)

    def step_csr_too(model):
        csr.grad = torch.eye(6).to_sparse_csr()
        return make_opt(model)
    entry = assert_unchanged(mlp, step_csr_too, {"mode": "multi_layer"})
    assert entry["fusion"]["excluded_params"] == {"sparse or non-floating parameter": 1}


def test_a_parameter_whose_storage_is_freed_is_never_read(ap):
    """An offloaded parameter (storage resized to 0, no gradient this step): reading it would
    crash the process, so planning must decide from its sizes alone."""
    spare = nn.Parameter(torch.randn(32))
    spare.untyped_storage().resize_(0)

    def make_opt(model):
        return torch.optim.AdamW([*model.parameters(), spare], lr=1e-2)
    entry = assert_unchanged(mlp, make_opt, {"mode": "multi_layer", "chunk_bytes": CHUNK})
    assert entry["fusion"]["excluded_params"] == {"storage is freed or smaller than the parameter (resized)": 1}


class MomentumInSubclass(torch.optim.Optimizer):
    """SGD with momentum whose buffers are created in __init__ (as Adagrad does) and kept in a
    tensor subclass (as low-bit optimizers keep theirs); elementwise in every other respect."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["buf"] = Wrapped(torch.zeros_like(p))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p]["buf"]
                    buf.mul_(group["momentum"]).add_(p.grad)
                    p.add_(buf.inner, alpha=-group["lr"])


NO_PROBE = {"mode": "multi_layer", "chunk_bytes": CHUNK, "fusion": {"probe": False}}


def test_a_failure_inside_planning_falls_back_to_the_unpatched_step(ap):
    """With the probe off, planning tries to move the subclass state into a flat buffer and
    fails on its missing storage: the step runs unpatched, with a warning and the reason."""
    make_opt = lambda model: MomentumInSubclass(model.parameters())
    with pytest.warns(RuntimeWarning, match="fell back to the unpatched step"):
        entry = assert_unchanged(mlp, make_opt, NO_PROBE)
    assert entry["mode"] == "off" and entry["steps"] == 6
    assert entry["reason"].startswith("fell back to the unpatched step: preparing the fused step failed (RuntimeError")
    assert "invalid python storage" in entry["reason"]
    assert entry["fusion"]["fallback"]["where"] == "preparing the fused step"


def test_strict_raises_the_failure_instead(ap, monkeypatch):
    monkeypatch.setenv("FUSEDOPT_STRICT", "1")
    with pytest.raises(RuntimeError, match="invalid python storage"):
        run(mlp, lambda model: MomentumInSubclass(model.parameters()), NO_PROBE)


class GrowsAHistory(torch.optim.SGD):
    """SGD that, after the probe's few steps, starts keeping a small per-parameter record: state
    that has no place in a flat run."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["calls"] = st.get("calls", 0) + 1
                if st["calls"] > 4:
                    st["history"] = torch.zeros(2)
        return loss


def test_a_failure_after_the_fused_step_falls_back_and_keeps_the_state_usable(ap):
    make_opt = lambda model: GrowsAHistory(model.parameters(), lr=0.1, momentum=0.9)
    policy = {"mode": "multi_layer", "chunk_bytes": CHUNK}
    ref = run(mlp, make_opt, None, steps=8)
    with pytest.warns(RuntimeWarning, match="restoring the optimizer after the fused step failed"):
        got = run(mlp, make_opt, policy, steps=8)
    assert_same(got[0], ref[0])
    assert_same(got[1], ref[1])
    entry = the_optimizer(got[3])
    assert entry["mode"] == "off" and "NotFusable" in entry["reason"]
    assert got[2]["param_groups"] == ref[2]["param_groups"]
    assert {k: set(v) for k, v in got[2]["state"].items()} == {k: set(v) for k, v in ref[2]["state"].items()}

