"""Where each step's time goes, and the advice it backs, in situations built for real: a dataset
that sleeps behind a real DataLoader, many small tensors stepped through a closure, a 2-rank gloo
DDP job whose gradients are large next to its compute, and a run where nothing stands out. Only
which share is the largest is asserted, never a duration."""

import json
import os
import shutil
import time

import pytest
import torch
from torch import nn

from spawn import IMPORT_PATH, patience, write_script
from autopatch.reporting.summary import summary


class SlowDataset(torch.utils.data.Dataset):
    """Every sample takes a sleep to load: the loop waits on data."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.full((8,), float(i)), i % 3


def test_a_slow_dataset_makes_data_wait_the_largest_share_and_the_advice_names_the_cache(ap, one_thread):
    ap.enable(logging={"breakdown": True})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in torch.utils.data.DataLoader(SlowDataset(), batch_size=4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    report = ap.report()
    b = report["breakdown"]
    assert b["steps"] == 23 and b["largest"] == "data", b
    assert b["data"]["datasets"] == [{"dataset": "SlowDataset", "map_style": True, "samples": 96, "workers": 0}]
    data_advice = [a["advice"] for a in report["advice"] if a["about"] == "data"]
    assert any("FUSEDOPT_DATA_CACHE=1" in a and "SlowDataset" in a for a in data_advice), report["advice"]
    assert any("num_workers=0" in a for a in data_advice)
    text = summary(report)
    assert "step time (rank 0, median step" in text and "advice (data): " in text


def test_many_small_tensors_stepped_through_a_closure_make_the_optimizer_the_largest_share(ap, one_thread):
    ap.enable(logging={"breakdown": True})
    params = [torch.zeros(4, requires_grad=True) for _ in range(400)]
    opt = torch.optim.Adam(params, lr=0.1)

    def closure():
        opt.zero_grad()
        loss = torch.stack(params).square().sum()
        loss.backward()
        return loss
    for _ in range(40):
        opt.step(closure)
    report = ap.report()
    assert report["breakdown"]["largest"] == "optimizer", report["breakdown"]
    # the closure's forward and backward ran inside step(), and are counted as backward, not optimizer
    assert report["breakdown"]["share"]["backward"] > 0
    [advice] = [a["advice"] for a in report["advice"] if a["about"] == "optimizer"]
    assert "over 400 tensors" in advice and "backward: closure-based step()" in advice, advice
    assert "instead of passing step() a closure" in advice


def global_module_hooks():
    from torch.nn.modules import module
    return [len(getattr(module, name)) for name in dir(module) if name.startswith("_global_") and name.endswith("hooks")]


def test_a_run_where_nothing_stands_out_gives_no_advice(ap, one_thread):
    """The breakdown is on by default and needs no module hook: torch's global module hooks stay
    empty between steps (mode multi_layer, as mode forward applies its deferred updates from one),
    and every part's share is measured."""
    ap.enable(mode="multi_layer")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 3, (64,))
    assert not any(global_module_hooks())
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert not any(global_module_hooks())
    report = ap.report()
    b = report["breakdown"]
    assert b["steps"] == 29 and "unseen_backward_steps" not in b
    assert all(b["share"][part] > 0 for part in ("forward", "backward", "optimizer"))
    assert abs(sum(b["share"].values()) - 1) < 0.01, b["share"]
    assert set(b["share"]) == {"data", "forward", "backward", "optimizer", "comm", "autopatch", "other"}
    assert b["share"]["data"] == 0 and b["share"]["comm"] == 0
    assert report["advice"] == []
    assert "advice" not in summary(report)


def test_slow_work_between_steps_is_autopatchs_own_and_not_the_next_forwards(ap, one_thread):
    """What the step timer's listeners take between two iterations (TensorBoard, the autotuner) is
    counted once, as autopatch's own: the forward after it starts when they are done, and the
    shares still add up to the whole."""
    from autopatch.reporting.breakdown import Breakdown
    from autopatch.reporting.step_timer import StepTimer
    ap.enable(mode="multi_layer", logging={"breakdown": False})
    timer = StepTimer(ap.session(), breakdown=True)
    breakdown = Breakdown(timer, ap.session())
    timer.subscribe(lambda _timer: time.sleep(0.005))
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    try:
        for _ in range(12):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        b = breakdown.describe()
    finally:
        timer.close()
    assert b["steps"] == 11 and b["median_ms"]["autopatch"] >= 5, b
    assert b["median_ms"]["forward"] < 5 and b["largest"] == "autopatch", b
    assert abs(sum(b["share"].values()) - 1) < 0.01, b["share"]


def test_breakdown_switched_off_measures_nothing_and_disable_restores_backward(ap):
    original = torch.autograd.backward
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train():
        for _ in range(3):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    ap.enable(logging={"breakdown": False})
    train()
    report = ap.report()
    assert "breakdown" not in report and "advice" not in report
    assert torch.autograd.backward is original
    ap.disable()
    ap.enable(logging={"breakdown": True})
    train()
    assert torch.autograd.backward is not original and ap.report()["breakdown"]["steps"] == 2
    ap.disable()
    assert torch.autograd.backward is original


DDP_SCRIPT = """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # 2 M weights and a batch of 2 over a 1 Gbit/s link: the gradients' sync outweighs the rest
    model = DDP(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2, 1024)
    for _ in range(10):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    dist.destroy_process_group()
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="needs root (a network namespace whose loopback is shaped) and iproute2")
def test_a_slow_link_between_two_gloo_ranks_makes_exposed_communication_the_largest_share(tmp_path):
    netns = pytest.importorskip("harness.netns")
    script = write_script(tmp_path / "train.py", DDP_SCRIPT)
    ranks = netns.run_ranks_shaped([script], 2, rate="1gbit", timeout=patience(120),
                                   env={"PYTHONPATH": IMPORT_PATH, "FUSEDOPT_ENABLE": 1, "FUSEDOPT_MODE": "off", "FUSEDOPT_BREAKDOWN": 1,
                                        "FUSEDOPT_POLICY": "gradient_allreduce",   # autopatch runs the sync
                                        "FUSEDOPT_REPORT": tmp_path / "report_{rank}.json"})
    for r in ranks:
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads((tmp_path / f"report_{r.rank}.json").read_text())
        assert report["allreduce"]["active"] and report["breakdown"]["largest"] == "comm", report["breakdown"]
        [advice] = [a["advice"] for a in report["advice"] if a["about"] == "comm"]
        sent = report["allreduce"]["algorithm"]["bytes_sent_per_step"]
        assert f"at {sent} bytes sent per step" in advice and "FUSEDOPT_ALGORITHM=bytegrad" in advice
        assert "changes results by design" in advice
        assert f"step time (rank {r.rank}, " in r.stderr and "advice (comm): " in r.stderr   # each its own


def test_the_medians_come_from_iterations_kept_evenly_over_a_long_run():
    """Past its reservoir, the breakdown keeps rows by skips it draws; every stretch of a long run
    must still be kept alike, or the medians would describe only part of it."""
    from autopatch.reporting.breakdown import RESERVOIR, Breakdown
    from autopatch.reporting.step_timer import Window

    class Timer:
        last = None

        def subscribe(self, fn):
            self.add = fn

    timer, n = Timer(), 30 * RESERVOIR
    breakdown = Breakdown(timer, session=None)
    for i in range(n):
        timer.last = Window(steps=1, seconds=float(i))
        timer.add(timer)
    kept = [row[0] for row in breakdown._rows]
    assert len(kept) == RESERVOIR and len(set(kept)) == RESERVOIR
    per_tenth = [sum(1 for s in kept if int(10 * s / n) == tenth) for tenth in range(10)]
    assert all(0.07 * RESERVOIR < c < 0.13 * RESERVOIR for c in per_tenth), per_tenth
    assert breakdown.steps == n
