"""One rank of Bagua's documented usage, as a script written for Bagua makes its calls, on a gloo job
started by ``harness.launch.run_ranks`` (with_bagua enables autopatch itself). Each case trains
Bagua's small models a few steps both ways and saves, per rank, what the test compares.

Suites: ``main`` (2 ranks), ``group`` (3 ranks: a process group of ranks 0 and 1, rank 2 busy
with work of its own, as in Bagua's decentralized tests) and ``mnist_qadam`` (any world size:
Bagua's mnist example with ``--algorithm qadam``, with and without ``--fuse-optimizer``).
"""

import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from autopatch.contrib import (AsyncModelAverageAlgorithm, ByteGradAlgorithm, DecentralizedAlgorithm,
                               GradientAllReduceAlgorithm, LowPrecisionDecentralizedAlgorithm, QAdamAlgorithm,
                               QAdamOptimizer, fuse_optimizer, with_bagua)
from harness.launch import init_rank, save_results

ALGORITHMS = {
    "gradient_allreduce": lambda opt: GradientAllReduceAlgorithm(),
    "bytegrad": lambda opt: ByteGradAlgorithm(hierarchical=False),
    "decentralized": lambda opt: DecentralizedAlgorithm(hierarchical=False),
    "low_precision_decentralized": lambda opt: LowPrecisionDecentralizedAlgorithm(hierarchical=False),
    "qadam": lambda opt: QAdamAlgorithm(opt, hierarchical=False),
}


def fused_test_model():
    """Bagua's fused-optimizer test model, two param groups (weights decayed, biases not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid())
    groups = [{"params": [m.weight for m in model if isinstance(m, nn.Linear)], "weight_decay": 0.1},
              {"params": [m.bias for m in model if isinstance(m, nn.Linear)], "weight_decay": 0.0}]
    return model, groups


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def everyone(t):
    """Every rank's ``t``, for comparing replicas."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def fused_run(algorithm, optimizer, order, steps=12, fuse=True, every_step=False):
    """Bagua's fused-optimizer test on 2 ranks: ``fuse_step()`` on even steps, ``step()`` on odd
    ones (``every_step``: ``fuse_step()`` always, as Bagua's examples; ``fuse`` False: ``step()``
    always), the optimizer fused before with_bagua (the docs' order) or after it (the examples'
    order)."""
    model, groups = fused_test_model()
    opt = optimizer(groups)
    if fuse and order == "fuse_first":
        fuse_optimizer(opt)
    ddp = with_bagua(model, [opt], ALGORITHMS[algorithm](opt), do_flatten=False)
    if fuse and order == "bagua_first":
        fuse_optimizer(opt)
    x = torch.arange(0.1, 0.7, 0.1).reshape(3, 2) * (1 + dist.get_rank())
    for step in range(steps):
        opt.zero_grad()
        ddp(x).sum().backward()
        if fuse and (every_step or step % 2 == 0):
            opt.fuse_step()
        else:
            opt.step()
    import autopatch
    running = autopatch.session().allreduce.algorithm(ddp)
    out = {"weights": flat(model), "running": None if running is None else running.name,
           "communications": None if running is None else running.describe().get("communications")}
    if fuse:
        out["fused_steps"] = opt.fuse_step.__self__.flat.describe()["fused_steps"]
    return out


def fused_cases():
    sgd = lambda groups: torch.optim.SGD(groups, lr=0.2, momentum=0.9, nesterov=True)  # noqa: E731
    adam = lambda groups: torch.optim.Adam(groups, lr=0.05, amsgrad=True)  # noqa: E731
    out = {}
    for algorithm in ("gradient_allreduce", "bytegrad", "decentralized"):
        for name, optimizer in (("sgd", sgd), ("adam", adam)):
            fused = fused_run(algorithm, optimizer, "fuse_first")
            plain = fused_run(algorithm, optimizer, "fuse_first", fuse=False)
            out[f"{algorithm}_{name}"] = {"equal": torch.equal(fused["weights"], plain["weights"]),
                                          "fused_steps": fused["fused_steps"]}
    fused = fused_run("low_precision_decentralized", sgd, "bagua_first")
    plain = fused_run("low_precision_decentralized", sgd, "bagua_first", fuse=False)
    out["low_precision_bagua_first"] = {"equal": torch.equal(fused["weights"], plain["weights"]),
                                        "communications": fused["communications"],
                                        "fused_steps": fused["fused_steps"]}
    return out


def order_cases():
    """Every algorithm with deterministic results, Adam (QAdamOptimizer for qadam) fused in either
    order, stepped with fuse_step() always or alternating with step(): the algorithm runs to the
    end and the weights equal step()'s."""
    adam = lambda groups: torch.optim.Adam(groups, lr=0.05)  # noqa: E731
    qadam = lambda groups: QAdamOptimizer(groups, lr=0.05, warmup_steps=3)  # noqa: E731
    out = {}
    for algorithm in ALGORITHMS:
        optimizer = qadam if algorithm == "qadam" else adam
        plain = fused_run(algorithm, optimizer, "fuse_first", fuse=False)
        for order in ("fuse_first", "bagua_first"):
            for stepping in ("fuse_step", "alternate"):
                fused = fused_run(algorithm, optimizer, order, every_step=stepping == "fuse_step")
                out[f"{algorithm}_{order}_{stepping}"] = {
                    "equal": torch.equal(fused["weights"], plain["weights"]), "running": fused["running"],
                    "plain_running": plain["running"], "fused_steps": fused["fused_steps"]}
    return out


def mnist_net():
    """Bagua's mnist example's network, narrower (two convolutions, dropout, two linear layers)."""
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.25), nn.Flatten(), nn.Linear(8 * 12 * 12, 16), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(16, 10), nn.LogSoftmax(dim=1))


def mnist_qadam(fuse, steps=10):
    """Bagua's examples/mnist/main.py with ``--algorithm qadam`` (``--fuse-optimizer`` when
    ``fuse``), in its order: QAdamOptimizer, with_bagua, then fuse_optimizer; fuse_step() in
    the loop. Returns the weights, what ran and the warnings raised."""
    import autopatch
    torch.manual_seed(0)
    model = mnist_net()
    optimizer = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = with_bagua(model, [optimizer], QAdamAlgorithm(optimizer), do_flatten=not fuse)
        if fuse:
            optimizer = fuse_optimizer(optimizer)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            data, target = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
            optimizer.zero_grad()
            nn.functional.nll_loss(model(data), target).backward()
            if fuse:
                optimizer.fuse_step()
            else:
                optimizer.step()
    running = autopatch.session().allreduce.algorithm(model)
    return {"weights": flat(model), "algorithm": None if running is None else running.describe(),
            "warnings": [str(w.message) for w in caught if "autopatch" in str(w.message) or "qadam" in str(w.message)],
            "fused_steps": optimizer.fuse_step.__self__.flat.describe()["fused_steps"] if fuse else None}


def mnist_qadam_case():
    fused, plain = mnist_qadam(True), mnist_qadam(False)
    weights = fused.pop("weights")
    return {"equal": torch.equal(weights, plain.pop("weights")),
            "identical": all(torch.equal(w, everyone(weights)[0]) for w in everyone(weights)),
            "fused": fused, "plain": plain, "layouts": qadam_layouts_case()}


class Layouts(nn.Module):
    """Parameters in every memory order a flat run keeps, each over several of the 8-bit average's
    rows of 1,024 (so a row holds other elements when a parameter is laid out in memory order):
    transposed, permuted 3-D, channels_last, and one cut into several chunks."""

    def __init__(self):
        super().__init__()
        self.transposed = nn.Parameter(torch.randn(48, 64).t())
        self.permuted = nn.Parameter(torch.randn(8, 16, 24).permute(2, 0, 1))
        self.conv = nn.Conv2d(2, 96, 3).to(memory_format=torch.channels_last)
        self.large = nn.Linear(48, 1 << 15)

    def forward(self, x):
        h = self.conv(x).mean((2, 3))[:, :64] @ self.transposed
        return self.large(h).mean(1) + self.permuted.square().mean() * h.mean(1)


def qadam_layouts_case():
    """QAdamOptimizer under fuse_step() against step() over those parameters: the 8-bit average's
    rows hold each parameter's elements in its own index order, in the optimizer's order,
    whatever chunks the fused step hands the optimizer."""
    def run(fuse):
        torch.manual_seed(0)
        model = Layouts()
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3, weight_decay=0.01)
        ddp = with_bagua(model, [opt], QAdamAlgorithm(opt, hierarchical=False), do_flatten=not fuse)
        if fuse:
            fuse_optimizer(opt)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(8):
            opt.zero_grad()
            ddp(torch.randn(4, 2, 6, 6, generator=g)).square().mean().backward()
            (opt.fuse_step if fuse else opt.step)()
        strides = [p.stride() for p in model.parameters()]
        return flat(model), strides, opt.fuse_step.__self__.flat.describe()["fused_steps"] if fuse else None

    (fused, fused_strides, steps), (plain, plain_strides, _) = run(True), run(False)
    return {"equal": torch.equal(fused, plain), "strides": fused_strides == plain_strides, "fused_steps": steps}


def broadcast_case():
    """Bagua's broadcast-state test: each rank trains on its own first (different seeds, a
    different learning rate on rank 1), then with_bagua: every rank holds rank 0's weights,
    optimizer state and hyperparameters."""
    out = {}
    for name, make in (("sgd", lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=0.1)),
                       ("adam", lambda ps, lr: torch.optim.Adam(ps, lr=lr, weight_decay=0.1)),
                       ("rprop", lambda ps, lr: torch.optim.Rprop(ps, lr=lr))):
        torch.manual_seed(dist.get_rank())
        model = nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 4))
        opt = make(model.parameters(), 0.2 if dist.get_rank() == 0 else 0.3)
        for _ in range(5):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 2)), torch.randn(4, 4)).backward()
            opt.step()
        with_bagua(model, [opt], GradientAllReduceAlgorithm())
        state = torch.cat([v.reshape(-1).float() for _, s in sorted(opt.state_dict()["state"].items())
                           for _, v in sorted(s.items()) if isinstance(v, torch.Tensor)])
        out[name] = {"weights": all(torch.equal(w, everyone(flat(model))[0]) for w in everyone(flat(model))),
                     "state": all(torch.equal(s, everyone(state)[0]) for s in everyone(state)),
                     "lr": opt.param_groups[0]["lr"]}
    return out


def qadam_case():
    """QAdamOptimizer with fuse_step() alternating with step() trains as step() alone."""
    def run(alternate):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 10), nn.ReLU(), nn.Linear(10, 4))
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)
        ddp = with_bagua(model, [opt], QAdamAlgorithm(opt, hierarchical=False))
        if alternate:
            fuse_optimizer(opt)
        g = torch.Generator().manual_seed(dist.get_rank())
        for step in range(12):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(torch.randn(4, 2, generator=g)), torch.randn(4, 4, generator=g)).backward()
            (opt.fuse_step if alternate and step % 2 else opt.step)()
        return flat(model)
    return {"equal": torch.equal(run(True), run(False))}


def switch_case():
    """Bagua's model-switch test: six algorithms in turn on one model and its optimizer."""
    import autopatch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 50), nn.ReLU(),
                          nn.Linear(50, 4, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrappers, before = [], len(autopatch.report().get("allreduce", {}).get("models", []))   # alone: not enabled yet
    # Bagua's order but qadam (its own test) and gradient allreduce last: each switch starts every
    # rank from rank 0's weights, so after gradient allreduce the replicas are identical
    algorithms = [ByteGradAlgorithm(hierarchical=False), DecentralizedAlgorithm(hierarchical=False),
                  AsyncModelAverageAlgorithm(sync_interval_ms=5),
                  LowPrecisionDecentralizedAlgorithm(hierarchical=False), GradientAllReduceAlgorithm()]
    g = torch.Generator().manual_seed(dist.get_rank())
    for algorithm in algorithms:
        ddp = with_bagua(model, [opt], algorithm)
        wrappers.append(ddp)
        if isinstance(algorithm, AsyncModelAverageAlgorithm):
            algorithm.resume(ddp)
        for _ in range(20):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(torch.randn(4, 2, generator=g)), torch.randn(4, 4, generator=g)).backward()
            opt.step()
        if isinstance(algorithm, AsyncModelAverageAlgorithm):
            algorithm.abort(ddp)
    models = autopatch.report()["allreduce"]["models"][before:]
    return {"one_wrapper": all(w is wrappers[0] for w in wrappers),
            "not_nested": not isinstance(wrappers[0].module, nn.parallel.DistributedDataParallel),
            "models": len(models), "running": autopatch.session().allreduce.algorithm(wrappers[0]),
            "identical": all(torch.equal(w, everyone(flat(model))[0]) for w in everyone(flat(model)))}


def shim_case():
    """A Bagua example's calls through the stand-in for bagua.torch_api: init, ranks, the method
    form of with_bagua, and async's abort and resume on model.bagua_algorithm."""
    import autopatch.contrib.bagua as bagua
    bagua.init_process_group()          # already set up by the launcher: kept
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model = model.with_bagua([opt], bagua.algorithms.async_model_average.AsyncModelAverageAlgorithm(
        sync_interval_ms=5, warmup_steps=2))
    g = torch.Generator().manual_seed(bagua.get_rank())
    for epoch in range(2):
        model.bagua_algorithm.resume(model)
        for _ in range(10):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 2, generator=g)), torch.randn(4, 4, generator=g)).backward()
            opt.step()
        model.bagua_algorithm.abort(model)
    return {"rank": bagua.get_rank(), "world": bagua.get_world_size(), "local_rank": bagua.get_local_rank(),
            "identical": all(torch.equal(w, everyone(flat(model))[0]) for w in everyone(flat(model)))}


def group_case():
    """Ranks 0 and 1 train one model over their own process group under the default policy
    (mode auto measures); rank 2, outside it, trains a model of its own and leaves early."""
    import autopatch
    autopatch.enable(fusion={"observe_steps": 2, "measure_steps": 16})
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    if dist.get_rank() == 2:
        for _ in range(40):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 2, generator=g)), torch.randn(4, 4, generator=g)).backward()
            opt.step()
        return {"outside": True, "mode": autopatch.session().optimizer(opt).mode}
    ddp = with_bagua(model, [opt], DecentralizedAlgorithm(hierarchical=False), process_group=group)
    for _ in range(40):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(torch.randn(4, 2, generator=g)), torch.randn(4, 4, generator=g)).backward()
        opt.step()
        time.sleep(0.001)
    return {"outside": False, "mode": autopatch.session().optimizer(opt).mode,
            "chose": not autopatch.session().optimizer(opt).choosing}


def main():
    init_rank()
    torch.set_num_threads(1)
    if sys.argv[1] == "group":
        save_results(group_case())
        return
    if sys.argv[1] == "switch":            # Bagua's model-switch test on its 4 processes, alone
        save_results(switch_case())
        return
    if sys.argv[1] == "mnist_qadam":
        save_results(mnist_qadam_case())
        return
    save_results({"fused": fused_cases(), "orders": order_cases(), "broadcast": broadcast_case(), "qadam": qadam_case(),
                  "switch": switch_case(), "shim": shim_case()})


if __name__ == "__main__":
    main()
