"""One rank of the DDP parity tests: ``python ddp_parity_worker.py SUITE RANK INIT_FILE OUT WORLD``.

Each scenario is a user's DDP script (AdamW, 6 steps, data drawn from (rank, step)) run unpatched,
then under the default policy with mode auto, multi_layer and backward. Each rank saves, per
scenario and mode: whether its losses and weights equal its unpatched run's bit for bit, and what
the report said about the gradient sync and the mode that ran.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import autopatch
from spawn import run_rank

RANK, WORLD = int(sys.argv[2]), int(sys.argv[5])     # of SUITE RANK INIT_FILE OUT WORLD (spawn.run_rank)
STEPS = 6
MODES = ("auto", "multi_layer", "backward")


def batch(step, width=64, micro=0, rank=RANK):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(8, width, generator=g), torch.randint(0, 4, (8,), generator=g)


class Net(nn.Module):
    """Over 1 MiB of gradients, so that DDP's first bucket (about 1 MiB) and its rebuilt buckets
    differ from one bucket of everything; ``branch`` runs on odd steps only when asked."""

    def __init__(self, width=64, dtype=None):
        super().__init__()
        self.inp = nn.Linear(width, 384)
        self.big = nn.Linear(384, 768)
        self.mid = nn.Linear(768, 64, dtype=dtype)
        self.branch = nn.Linear(64, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.big(torch.relu(self.inp(x))))
        h = self.mid(h.to(self.mid.weight.dtype)).float()
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def loss_of(model, step, micro=0, **kw):
    x, y = batch(step, micro=micro)
    return nn.functional.cross_entropy(model(x, **kw), y)


def plain(ddp_kwargs=None, net_kwargs=None, prepare=None):
    """A scenario: one DDP model, one AdamW, a step a batch; ``prepare(net)`` before wrapping."""
    def run(group=None):
        torch.manual_seed(0)
        net = Net(**(net_kwargs or {}))
        if prepare is not None:
            prepare(net)
        model = nn.parallel.DistributedDataParallel(net, process_group=group, **(ddp_kwargs or {}))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, step, use_branch=step % 2 == 1) if (ddp_kwargs or {}).get(
                "find_unused_parameters") else loss_of(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]
    return run


def no_sync_accumulation():
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        with model.no_sync():
            loss_of(model, step, micro=0).backward()
        loss = loss_of(model, step, micro=1)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def join_uneven():
    """Rank r has STEPS - 2 + r % 3 batches, inside DDP's join() context."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with Join([model]):
        for step in range(STEPS - 2 + RANK % 3):
            opt.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def two_models():
    torch.manual_seed(0)
    first = nn.parallel.DistributedDataParallel(Net())
    second = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 4)))
    opts = [torch.optim.AdamW(first.parameters(), lr=1e-2), torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)]
    losses = []
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        x, y = batch(step)
        loss = nn.functional.cross_entropy(second(first(x)), y)
        loss.backward()
        for opt in opts:
            opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for m in (first, second) for p in m.parameters()]


def subgroup():
    """DDP over the even ranks only (every rank makes the group, as torch asks)."""
    group = dist.new_group(ranks=list(range(0, WORLD, 2)))
    if RANK % 2:
        return [], []
    return plain()(group)


def freeze_inp(net):
    net.inp.weight.requires_grad_(False)


SCENARIOS = {
    "ddp_default": plain(),
    "bucket_cap_mb": plain({"bucket_cap_mb": 0.25}),
    "find_unused_parameters": plain({"find_unused_parameters": True}),
    "static_graph": plain({"static_graph": True}),
    "gradient_as_bucket_view": plain({"gradient_as_bucket_view": True}),
    "no_sync_accumulation": no_sync_accumulation,
    "join_uneven_inputs": join_uneven,
    "frozen_parameter": plain(prepare=freeze_inp),
    "mixed_dtypes": plain(net_kwargs={"dtype": torch.float64}),
    "two_models": two_models,
    "process_subgroup": subgroup,
}


def compare(got, ref):
    (losses, weights), (ref_losses, ref_weights) = got, ref
    if losses != ref_losses:
        return f"losses differ: {losses} vs {ref_losses}"
    for i, (w, r) in enumerate(zip(weights, ref_weights)):
        if not torch.equal(w, r):
            return f"weight {i} differs by {(w.double() - r.double()).abs().max().item():.3g}"
    return None


def parity():
    res = {}
    for name, scenario in SCENARIOS.items():
        ref = scenario()
        for mode in MODES:
            autopatch.enable(mode=mode, fusion={"observe_steps": 1})
            try:
                got = scenario()
                report = autopatch.report()
            finally:
                autopatch.disable()
            res[name, mode] = {"differs": compare(got, ref),
                               "allreduce": {k: report["allreduce"].get(k) for k in ("active", "reason")},
                               "modes": [o["mode"] for o in report["optimizers"]],
                               "reasons": [o["reason"] for o in report["optimizers"]]}
            dist.barrier()
    return res


if __name__ == "__main__":
    run_rank({"parity": parity})
