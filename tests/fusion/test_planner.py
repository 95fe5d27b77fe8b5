"""FlatPlanner: which parameters share a flat run, which are left out and why, and when a plan
is stale."""

import torch

from autopatch.fusion.chunking import MEMORY_FLOOR
from autopatch.fusion.planner import FlatPlanner


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_one_run_per_group_dtype_and_state_shape_with_the_rest_left_out_with_reasons():
    m = model()
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    halves = torch.nn.Parameter(torch.ones(5, dtype=torch.float16))
    opt = torch.optim.SGD([{"params": list(m.parameters()) + [frozen]}, {"params": [halves], "lr": 0.5}], lr=0.1)
    planner = FlatPlanner(opt, 64 << 20)
    planner.plan()
    first, second = planner.plans
    # the smallest parameters, within 1/32 of the fused bytes (here the last bias), get a run of
    # their own whose grads are copied into a buffer made once
    assert [[tuple(p.shape) for p in r.params] for r in first.runs] == [[(4,)], [(16, 8), (16,), (4, 16)]]
    assert first.rest == [frozen]
    assert [r.flat.dtype for r in second.runs] == [torch.float16] and second.rest == []
    assert planner.excluded == {"frozen (requires_grad=False)": 1}
    layout = planner.layout()
    assert layout["runs"] == 3 and layout["fused_params"] == 5
    assert layout["chunk_bytes"] == MEMORY_FLOOR    # 64 MiB asked for, but never above the memory bound


def test_parameters_sharing_memory_the_planner_does_not_own_are_left_alone():
    buf = torch.zeros(10)
    a, b = torch.nn.Parameter(buf[:5]), torch.nn.Parameter(buf[5:])
    whole = torch.nn.Parameter(torch.zeros(20)[:6])           # a view into a larger buffer
    own = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([a, b, whole, own], lr=0.1)       # the planner holds it weakly
    planner = FlatPlanner(opt, 1 << 20)
    planner.plan()
    assert planner.excluded == {"shares storage with another parameter": 2, "is a view into a larger buffer": 1}
    assert [r.params for r in planner.plans[0].runs] == [[own]]


def test_runs_already_back_to_back_are_fused_where_they_lie_without_moving_anything():
    buf = torch.arange(10.0)
    a, b = torch.nn.Parameter(buf[:4]), torch.nn.Parameter(buf[4:])
    loose = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([a, b, loose], lr=0.1)
    planner = FlatPlanner(opt, 1 << 20, moves_params=False)
    planner.plan()
    run, = planner.plans[0].runs
    assert run.params == [a, b] and run.flat.data_ptr() == buf.data_ptr()
    assert planner.plans[0].rest == [loose] and loose.data_ptr() != run.flat.data_ptr()


def test_a_plan_is_stale_when_the_optimizer_or_a_parameter_changes_under_it():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    planner = FlatPlanner(opt, 1 << 20)
    assert planner.needs_plan()
    planner.plan()
    assert not planner.needs_plan()
    m[0].weight.data = m[0].weight.data.clone()           # user code moved a parameter
    assert planner.needs_plan()
    planner.plan()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert planner.needs_plan()
    planner.plan()
    planner.set_chunk_bytes(4096)
    assert planner.needs_plan()
    planner.plan()
    assert planner.chunk_bytes_in_use == 4096
