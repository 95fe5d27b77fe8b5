"""An unchanged DistributedDataParallel script on scikit-learn's handwritten digits, for the zero-code
algorithm tests: ``FUSEDOPT_ENABLE=1 FUSEDOPT_POLICY=... python zero_code_digits.py`` as one rank
of a gloo job (``harness.launch.run_ranks``). ``DIGITS_OPTIMIZER`` names the optimizer (Adam);
``DIGITS_STEP_PAUSE`` adds seconds of work to each step, as a larger model's would.

``train()`` is all a user writes. What follows it is the test's: the report, ``disable()`` and what
it leaves behind, and the same job again under plain DDP as the baseline. With
``DIGITS_EXPECT=policy_error`` the DDP model must be refused with a ``PolicyError`` (an odd number
of ranks for shift_one), once as the policy says and once with ``hierarchical: true`` added.
"""

import functools
import gc
import os
import threading
import time

import torch
import torch.distributed as dist
import wrapt
from torch import nn

import digits_data
from harness.launch import save_results

EPOCHS, BATCH = 8, 20


@functools.cache
def digits():
    return digits_data.load()


def data(rank, world):
    x, y = digits()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x, y, order[:1400][rank::world], order[1400:]


def train():
    """The user's script: a small MLP under DDP, each rank on its own share of the data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, mine, test = data(rank, world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    name = os.environ.get("DIGITS_OPTIMIZER", "Adam")
    pause = float(os.environ.get("DIGITS_STEP_PAUSE", 0))
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2 if name == "Adam" else 0.2)
    for epoch in range(EPOCHS):
        perm = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(100 * rank + epoch))]
        for i in range(len(mine) // BATCH):
            idx = perm[i * BATCH:(i + 1) * BATCH]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            time.sleep(pause)
    return evaluate(model), model


def evaluate(model):
    """Test accuracy in percent, on the digits no rank trained on."""
    x, y, _, test = data(0, 1)
    with torch.no_grad():
        return (model(x[test]).argmax(1) == y[test]).float().mean().item() * 100


def identical_everywhere(model):
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(every, weights)
    return all(torch.equal(w, every[0]) for w in every)


def patched(obj, name):
    return isinstance(vars(obj)[name], wrapt.ObjectProxy)


def refused():
    """Build the DDP model as the policy says, then with hierarchical: true; each must raise."""
    import autopatch
    messages = []
    for overrides in ({}, {"algorithm": {"hierarchical": True}}):
        if overrides:
            policy = autopatch.session().policy.source
            autopatch.disable()
            autopatch.enable(policy, **overrides)
        try:
            nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
            messages.append(None)
        except autopatch.PolicyError as e:
            messages.append(str(e))
        gc.collect()
    return {"messages": messages}


def main():
    import autopatch
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if os.environ.get("DIGITS_EXPECT") == "policy_error":
        save_results(refused())
        return
    accuracy, model = train()       # the model stays alive: disable() must close its algorithm
    report = autopatch.report()
    autopatch.disable()
    after = {
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("autopatch")],
        "ddp_patched": patched(nn.parallel.DistributedDataParallel, "forward"),
        "destroy_patched": patched(dist, "destroy_process_group"),
        "report": autopatch.report()["allreduce"],
        "accuracy": evaluate(model),    # async's closing round left every rank the average
    }
    baseline, _ = train()
    save_results({"accuracy": accuracy, "baseline": baseline, "identical": identical_everywhere(model),
                  "report": report, "after_disable": after})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
