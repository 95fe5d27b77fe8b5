"""One rank of the with_bagua test: Bagua's calls, as a script written for Bagua makes them, on a
gloo job started by ``harness.launch.run_ranks`` without FUSEDOPT_ENABLE (with_bagua enables
autopatch). Each algorithm trains a small model for a few steps; what the takeover reports for it
and whether the ranks' weights agree are saved for the test."""

import torch
import torch.distributed as dist
from torch import nn

from autopatch.contrib import (AsyncModelAverageAlgorithm, ByteGradAlgorithm, DecentralizedAlgorithm,
                               GradientAllReduceAlgorithm, LowPrecisionDecentralizedAlgorithm, QAdamAlgorithm,
                               QAdamOptimizer, with_bagua)
from harness.launch import save_results


def train(ddp, opt, steps):
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(torch.randn(8, 6, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
        opt.step()


def identical(ddp):
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    every = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(every, weights)
    return all(torch.equal(w, every[0]) for w in every)


def run(make_algorithm, optimizer=torch.optim.SGD, steps=6, between=None):
    import autopatch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = optimizer(model.parameters(), lr=0.05)
    algorithm = make_algorithm(opt)
    ddp = with_bagua(model, [opt], algorithm)
    train(ddp, opt, steps)
    if between is not None:
        between(algorithm, ddp, opt)
    running = autopatch.session().allreduce.algorithm(ddp)
    entry = autopatch.report()["allreduce"]["models"][-1]
    return {"returned_ddp": isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model,
            "compression": entry["compression"], "algorithm": None if running is None else running.describe(),
            "identical": identical(ddp), "stepped_by_optimizer": "steps_taken_over" not in
            autopatch.report()["optimizers"][-1]}


def async_cycles(algorithm, ddp, opt):
    """Bagua's abort and resume, each called twice, around more training; ends aborted."""
    for _ in range(2):
        algorithm.abort(ddp)
        algorithm.abort(ddp)
        algorithm.resume(ddp)
        algorithm.resume(ddp)
        train(ddp, opt, 4)
    algorithm.abort(ddp)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {
        "gradient_allreduce": run(lambda opt: GradientAllReduceAlgorithm()),
        "bytegrad": run(lambda opt: ByteGradAlgorithm(hierarchical=False)),
        "decentralized": run(lambda opt: DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one")),
        "low_precision_decentralized": run(lambda opt: LowPrecisionDecentralizedAlgorithm()),
        "qadam": run(lambda opt: QAdamAlgorithm(opt), optimizer=lambda ps, lr: QAdamOptimizer(ps, lr=lr, warmup_steps=3)),
    }
    out["async"] = run(lambda opt: AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=2),
                       between=async_cycles)
    save_results(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
