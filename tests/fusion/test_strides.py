"""Every parameter keeps its strides, and its results, in every mode.

A dense parameter in any memory order (transposed, permuted, channels_last) is laid into its flat
run in its own order and stays a view with its own strides: a matmul or convolution reading it
takes the kernel path it takes unpatched, and its optimizer state (which torch creates with
``preserve_format``) keeps the same strides too. A parameter with gaps or overlaps in memory
(a strided slice, an expanded or overlapping view, one aliasing another's storage) is stepped
per tensor with the reason in the report. Each case trains unpatched and patched and compares
weights, optimizer state and every tensor's strides bit for bit.
"""

import copy

import pytest
import torch
from torch import nn

import autopatch
from autopatch.fusion.flat_run import FlatRun

MODES = ["multi_layer", "backward", "forward", "auto"]
SHORT = {"observe_steps": 2, "measure_steps": 16}
STEPS = 12


class Transposed(nn.Module):
    """Weights laid out transposed, read by matmuls in forward and backward: one larger than a
    chunk (its chunks read its grad in place), one sharing a chunk (its grad is gathered)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 12)
        self.w = nn.Parameter(torch.randn(64, 12).t())     # strides (1, 12)
        self.u = nn.Parameter(torch.randn(3, 64).t())      # strides (1, 64)
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.tanh(torch.tanh(self.inp(x)) @ self.w) @ self.u + self.b


class Permuted(nn.Module):
    """Weights permuted in 3-D and 4-D, contracted with einsum."""

    def __init__(self):
        super().__init__()
        self.w3 = nn.Parameter(torch.randn(4, 12, 2).permute(1, 2, 0))        # (12, 2, 4)
        self.w4 = nn.Parameter(torch.randn(3, 2, 4, 5).permute(2, 3, 1, 0))   # (4, 5, 2, 3)
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(torch.einsum("bi,ijk->bjk", x, self.w3))
        return torch.einsum("bjk,kljc->bc", h, self.w4) + self.b


class Conv2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Tanh(), nn.Conv2d(6, 4, 3),
                                  nn.Tanh(), nn.Conv2d(4, 4, 1), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))

    def forward(self, x):
        return self.body(x.repeat(1, 9).view(-1, 3, 6, 6).contiguous(memory_format=torch.channels_last))


class Conv3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv3d(4, 3, 2),
                                  nn.Flatten(), nn.Linear(3 * 2 * 2 * 2, 3))

    def forward(self, x):
        return self.body(x.repeat(1, 5)[:, :54].view(-1, 2, 3, 3, 3).contiguous(
            memory_format=torch.channels_last_3d))


def channels_last():
    torch.manual_seed(0)
    return Conv2d().to(memory_format=torch.channels_last)


def channels_last_3d():
    torch.manual_seed(0)
    return Conv3d().to(memory_format=torch.channels_last_3d)


def seeded(cls):
    def build():
        torch.manual_seed(0)
        return cls()
    return build


class Holes(nn.Module):
    """A weight sliced with a stride of 2 (half its storage is gaps), beside ordinary ones."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 12)
        self.w = nn.Parameter(torch.randn(12, 6)[:, ::2])
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.tanh(self.inp(x)) @ self.w + self.b


class Aliased(nn.Module):
    """Two parameters over one storage, one the ``.T`` of the other, beside ordinary ones."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 12)
        self.w = nn.Parameter(torch.randn(12, 12))
        self.wt = nn.Parameter(self.w.data.T)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        return self.out(torch.tanh(torch.tanh(self.inp(x)) @ self.w) @ self.wt)


DENSE = {
    "transposed": seeded(Transposed),
    "permuted": seeded(Permuted),
    "channels_last": channels_last,
    "channels_last_3d": channels_last_3d,
}
class Overlapping(nn.Module):
    """A weight whose rows overlap in memory (strides (2, 1) over 3 columns)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 12)
        self.w = nn.Parameter(torch.randn(30).as_strided((12, 3), (2, 1)))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.tanh(self.inp(x)) @ self.w + self.b


class Expanded(Overlapping):
    """A weight expanded from one column: every optimizer's in-place update of it raises."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 1).expand(12, 3))


NOT_DENSE = {"not dense in memory (a view with gaps or overlaps)": 1}
GAPS = {
    "strided_slice": (seeded(Holes), NOT_DENSE),
    "overlapping": (seeded(Overlapping), NOT_DENSE),
    "aliased_transpose": (seeded(Aliased), {"shares storage with another parameter": 2}),
}


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def train(build, mode=None, make_opt=adamw, before_step=None, model=None, opt_state=None):
    """Train ``build()`` (or ``model``) unpatched or in ``mode``; returns its parameters, the
    optimizer's state_dict and the report."""
    model = build() if model is None else model
    if mode:
        autopatch.enable(mode=mode, chunk_bytes=1024, fusion=SHORT)
    try:
        opt = make_opt(model.parameters())
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        for x, y in batches(STEPS):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if before_step:
                before_step(model)
            opt.step()
        autopatch.flush()
        report = autopatch.report() if mode else None
        return list(model.parameters()), opt.state_dict(), report
    finally:
        autopatch.disable()


def assert_same_with_strides(ref, got):
    for i, (a, b) in enumerate(zip(ref[0], got[0], strict=True)):
        assert a.stride() == b.stride(), (i, a.stride(), b.stride())
        assert torch.equal(a, b), i
    for k, st in ref[1]["state"].items():
        for key, v in st.items():
            w = got[1]["state"][k][key]
            assert v.stride() == w.stride(), (k, key, v.stride(), w.stride())
            assert torch.equal(v, w), (k, key)


def fusion_of(report):
    (entry,) = [o for o in report["optimizers"] if o["steps"]]
    return entry["fusion"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(DENSE))
def test_a_dense_parameter_in_any_memory_order_keeps_its_strides(ap, case, mode):
    ref = train(DENSE[case])
    assert any(not p.is_contiguous() for p in ref[0])
    got = train(DENSE[case], mode)
    assert_same_with_strides(ref, got)
    fusion = fusion_of(got[2])
    if mode != "auto":
        assert fusion["excluded_params"] == {} and fusion["fused_params"] == len(ref[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(GAPS))
def test_a_parameter_with_gaps_or_aliases_is_stepped_per_tensor(ap, case, mode):
    build, excluded = GAPS[case]
    ref = train(build)
    got = train(build, mode)
    assert_same_with_strides(ref, got)
    if mode != "auto":
        assert fusion_of(got[2])["excluded_params"] == excluded


@pytest.mark.parametrize("mode", MODES)
def test_an_expanded_parameter_fails_its_update_as_unpatched(ap, mode):
    """Writing to an expanded tensor in place is an error in torch: stepped per tensor, it is the
    same error, not a failure of autopatch's planning and not a silent success."""
    match = "more than one element of the written-to tensor"
    with pytest.raises(RuntimeError, match=match):
        train(seeded(Expanded))
    with pytest.raises(RuntimeError, match=match):
        train(seeded(Expanded), mode)


def other_order(model):
    """User code between backward and step() that replaces each 2-D gradient with one laid out
    the other way round (a transposed weight's grad becomes row-major, and the reverse)."""
    for p in model.parameters():
        if p.grad.dim() == 2:
            p.grad = p.grad.t().contiguous().t()


@pytest.mark.parametrize("mode", ["multi_layer", "forward", "auto"])
def test_a_gradient_laid_out_unlike_its_parameter_is_read_by_value(ap, mode):
    ref = train(DENSE["transposed"], before_step=other_order)
    got = train(DENSE["transposed"], mode, before_step=other_order)
    assert_same_with_strides(ref, got)


def sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


@pytest.mark.parametrize("mode", MODES)
def test_state_cloned_from_the_gradient_keeps_the_parameters_strides(ap, mode):
    """SGD's momentum buffer is a clone of the first gradient, laid out as the parameter is."""
    assert_same_with_strides(train(channels_last, make_opt=sgd), train(channels_last, mode, make_opt=sgd))


@pytest.mark.parametrize("mode", ["multi_layer", "forward"])
def test_loaded_state_in_another_memory_order_stays_as_loaded(ap, mode):
    """A checkpoint of a row-major model loaded into its channels_last copy: torch keeps the
    state row-major, so its parameters are stepped per tensor, with the reason."""
    saved = train(seeded(Conv2d))[1]

    def resumed(mode=None):
        return train(None, mode, model=channels_last(), opt_state=copy.deepcopy(saved))
    got = resumed(mode)
    assert_same_with_strides(resumed(), got)
    assert fusion_of(got[2])["excluded_params"] == {
        "optimizer state is in another memory order than its parameter": 3}


def test_a_transposed_run_is_used_again_where_it_lies():
    """Modes adopt each other's flat buffers where they lie: a run of parameters in their own
    memory order is back to back as it is, and planned again without a copy."""
    ps = [nn.Parameter(torch.randn(5, 4).t()), nn.Parameter(torch.randn(2, 3, 4).permute(2, 0, 1))]
    before = [(p.detach().clone(), p.stride()) for p in ps]
    first = FlatRun(ps, None, chunk_elems=100)
    assert all(torch.equal(p, b) and p.stride() == st for p, (b, st) in zip(ps, before))
    again = FlatRun(ps, None, chunk_elems=100)
    assert again.flat.data_ptr() == first.flat.data_ptr() and again.is_intact()
