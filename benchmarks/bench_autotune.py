"""Autotune against an exhaustive grid over the same space, in one run.

The workload starts from a poor config (1 KiB chunks: hundreds of tiny fused updates), so the
default is not the best. First autopatch autotunes while the job trains and freezes a config;
then, in the same process and on the same model, every config of the space is measured against
the frozen one, side by side: windows alternate between the two, so load from other jobs on a
shared machine hits both alike (rounds in rotating order; median of windows, median over rounds).
Reported: the frozen config's throughput as a fraction of the grid's best (target: >= 0.95 after
at most 20 trials), the starting config's, and what the search cost.

    python benchmarks/bench_autotune.py              # a few minutes
    python benchmarks/bench_autotune.py --quick      # smoke run
"""

import argparse
import json
import statistics
import time

import torch
from torch import nn

import autopatch
from autopatch.autotune.knobs import RunKnobs
from autopatch.autotune.space import Space
from harness.alternation import turns
from harness.machine import summary
from harness.workloads import stack


def build(width, depth):
    torch.manual_seed(0)
    model = stack(width, depth, act=nn.GELU, norm=True, head=10)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


class Job:
    """The training loop, stepped on demand so the grid can time it config by config."""

    def __init__(self, model, opt, batch, width):
        self.model, self.opt = model, opt
        self.x = torch.randn(batch * 16, width)
        self.y = torch.randint(0, 10, (batch * 16,))
        self.batch, self.i = batch, 0

    def step(self):
        s = (self.i % 16) * self.batch
        loss = nn.functional.cross_entropy(self.model(self.x[s:s + self.batch]), self.y[s:s + self.batch])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.i += 1

    def throughput(self, steps, windows):
        """Median samples/s over ``windows`` windows of ``steps`` steps (after one settling step)."""
        self.step()
        rates = []
        for _ in range(windows):
            t = time.perf_counter()
            for _ in range(steps):
                self.step()
            rates.append(steps * self.batch / (time.perf_counter() - t))
        return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-samples", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    trial_seconds, rounds, pairs, steps = (0.2, 1, 2, 5) if args.quick else (1.5, 3, 3, 30)

    session = autopatch.enable("autotune", fusion={"mode": "multi_layer", "chunk_bytes": 1024},
                     autotune={"knobs": ["mode", "chunk_size_2p"], "warmup_steps": 20,
                               "trial_seconds": trial_seconds, "max_samples": args.max_samples,
                               "batch_size": args.batch, "bounds": {"mode": ["off", "multi_layer"],
                                                                    "chunk_size_2p": [10, 26]}})
    model, opt = build(args.width, args.depth)
    job = Job(model, opt, args.batch, args.width)
    t0 = time.perf_counter()
    while autopatch.report()["autotune"]["phase"] != "frozen":
        job.step()
    tuned_wall = time.perf_counter() - t0
    tune = autopatch.report()["autotune"]
    frozen = tune["best"]["config"]

    knobs = RunKnobs(session)
    knobs.current(frozen)
    space = Space({"mode": ("off", "multi_layer"), "chunk_size_2p": (10, 26)})
    grid = space.grid()
    contenders = [(space.key(c), c) for c in grid]
    relative = {name: [] for name, _ in contenders}     # throughput / the frozen config's, per round
    frozen_rates = []
    t0 = time.perf_counter()
    for _, (name, config) in turns(contenders, rounds):
        mine, theirs = [], []
        for _ in range(pairs):
            knobs.apply(config)
            mine.append(job.throughput(steps, 1))
            knobs.apply(frozen)
            theirs.append(job.throughput(steps, 1))
        relative[name].append(statistics.median(mine) / statistics.median(theirs))
        frozen_rates += theirs
    grid_wall = time.perf_counter() - t0
    autopatch.disable()

    grid_scores = {name: statistics.median(v) for name, v in relative.items()}
    best_key = max(grid_scores, key=grid_scores.get)
    ratio = grid_scores[space.key(frozen)] / grid_scores[best_key]
    frozen_score = statistics.median(frozen_rates)
    start = tune["trials"][0]
    out = {
        "machine": summary(),
        "workload": f"MLP width {args.width} depth {args.depth} ({sum(len(g['params']) for g in opt.param_groups)} "
                    f"tensors), Adam, batch {args.batch}; start: chunk 1 KiB",
        "space": f"mode x chunk_size_2p 10..26: {len(grid)} distinct configs",
        "trials": len(tune["trials"]),
        "start_config": start["config"], "start_score_during_search": round(start["score"], 1),
        "frozen_config": frozen, "grid_best_config": dict(best_key),
        "frozen_samples_per_s_during_grid": round(frozen_score, 1),
        "frozen_vs_grid_best": round(ratio, 4), "target_met": ratio >= 0.95,
        "start_config_vs_grid_best": round(grid_scores[space.key(start["config"])] / grid_scores[best_key], 4),
        "frozen_vs_itself_in_grid": round(grid_scores[space.key(frozen)], 4),
        "search_cost": tune["cost"], "search_wall_seconds_incl_warmup": round(tuned_wall, 2),
        "grid_wall_seconds": round(grid_wall, 2),
        "grid_vs_frozen": {str(dict(k)): round(v, 3) for k, v in sorted(grid_scores.items(), key=lambda kv: -kv[1])},
    }
    out["search_trials"] = [(t["config"].get("mode"), t["config"].get("chunk_size_2p"), round(t["score"], 1)) for t in tune["trials"]]
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
