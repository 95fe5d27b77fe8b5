"""What sharding the optimizer state (``fusion.shard``) saves per rank, and what it costs a step,
against unpatched DDP, on N gloo ranks of this machine (2 and 4 by default).

One unchanged DDP script (``--worker``) trains AdamW, started zero-code per contender:

- ``ddp``: torch's DistributedDataParallel, autopatch off (the baseline);
- ``multi_layer``: ``FUSEDOPT_ENABLE=1 FUSEDOPT_MODE=multi_layer``, unsharded: the fused step the
  sharded one is built on;
- ``sharded``: ``FUSEDOPT_ENABLE=1 FUSEDOPT_POLICY=sharded`` (multi_layer with ``fusion.shard``);
- ``shard_env``: ``FUSEDOPT_ENABLE=1 FUSEDOPT_SHARD=1``, as a user asks for it (the default
  policy: mode auto, which runs multi_layer sharded from the first step);
- ``ours_sharded`` and ``backward_sharded``: a policy file with ``allreduce.enabled: true``
  (autopatch's allreduce runs DDP's gradient sync) and ``fusion.shard``, under mode multi_layer,
  and under mode backward (each share updated inside backward as its gradients are averaged;
  ``observe_steps: 2``, so it runs from the third step on). Equal to each other bit for bit; to
  DDP at two ranks.

Models: ``big``, 5 x Linear(2048, 2048) with ReLU and a 10-way head (80 MiB of float32
parameters, 160 MiB of AdamW state unsharded, batch 16), and ``mlp``, 4 x Linear(512, 512) with a
10-way head (4 MiB, batch 32).

Per rank: the optimizer state it holds after the last step (unpatched: the bytes of every state
tensor; sharded: the report's ``state_bytes``, checked against its ``state_bytes_unsharded``), and
its peak resident memory over the training steps (glibc's mmap threshold pinned at 1 MiB so that
the resident size follows the tensors; the peak is reset once the model and the optimizer are
built, so each contender's peak covers its steps alone). Rank 0 times each step after
``--warmup`` steps; a contender's step time is its median. Contenders take turns in rounds (the
first of each round rotating), each a job of its own, and the ratio to ``ddp`` is the median of
per-round ratios. Every job hashes rank 0's final weights, to show which trained exactly as DDP
did; sharded jobs also give the seconds rank 0 spent in the broadcasts of the updated shares.

    python benchmarks/bench_sharded_state.py                   # big and mlp, 2 and 4 ranks
    python benchmarks/bench_sharded_state.py --models big      # the 80 MiB model only
    python benchmarks/bench_sharded_state.py --quick           # smoke run
"""

import argparse
import hashlib
import pathlib
import statistics
import sys
import tempfile
import time

from harness.launch import failed, run_ranks
from harness.machine import closing, summary

OURS_SHARDED = "version: 1\nfusion: {{mode: {mode}, shard: true, observe_steps: 2}}\nallreduce: {{enabled: true}}\n"
CONTENDERS = {"ddp": {}, "multi_layer": {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_MODE": "multi_layer"},
              "sharded": {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_POLICY": "sharded"},
              "shard_env": {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_SHARD": "1"},
              "ours_sharded": {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_POLICY": ("policy", "multi_layer")},
              "backward_sharded": {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_POLICY": ("policy", "backward")}}
MODELS = {"big": (2048, 5, 16), "mlp": (512, 4, 32)}     # width, layers, batch


def worker(model_name, steps, warmup):
    import torch
    from torch import nn

    from harness.launch import init_rank, save_results
    from harness.memory import peak_memory_bytes, pin_mmap_threshold, reset_peak_memory

    pin_mmap_threshold(1 << 20)
    rank = init_rank()
    torch.set_num_threads(1)
    width, layers, batch = MODELS[model_name]
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())],
                        nn.Linear(width, 10))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reset_ok = reset_peak_memory()
    times = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    peak = peak_memory_bytes(reset_ok)
    seen, held = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                held += v.untyped_storage().nbytes()
    out = {"peak_rss": peak, "state_bytes": held, "step_ms": 1e3 * statistics.median(times[warmup:]),
           "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    import autopatch
    if autopatch.session() is not None:
        entry = autopatch.report()["optimizers"][0]
        out.update(mode=entry["mode"], shard=entry.get("shard"))
        if entry.get("shard", {}).get("ranks"):
            out["state_bytes"] = entry["shard"]["state_bytes"]
    if rank == 0:
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
        out["weights"] = h.hexdigest()[:12]
    save_results(out)


def environment(name, policy_dir):
    """The contender's variables, its policy file written into ``policy_dir`` (once) where it has one."""
    env = dict(CONTENDERS[name])
    for key, value in env.items():
        if isinstance(value, tuple):
            path = pathlib.Path(policy_dir) / f"{name}.yaml"
            if not path.exists():
                path.write_text(OURS_SHARDED.format(mode=value[1]))
            env[key] = str(path)
    return env


def run(model, world, name, steps, warmup, policy_dir):
    ranks = run_ranks([__file__, "--worker", model, "--steps", steps, "--warmup", warmup], world,
                      env=environment(name, policy_dir), timeout=1800)
    why = failed(ranks)
    if why:
        sys.exit(f"{name} on {world} ranks failed:\n{why}")
    return [r.results for r in ranks]


def compare(model, world, rounds, steps, warmup):
    names = list(CONTENDERS)
    got = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as policy_dir:
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                got[name].append(run(model, world, name, steps, warmup, policy_dir))
    mib = 1 / 2**20
    print(f"\n{model}, {world} ranks, {rounds} rounds of {steps} steps ({warmup} warm-up):")
    print(f"  {'contender':12} {'state MiB/rank':>22} {'peak RSS MiB/rank':>24} {'step ms':>8} {'vs ddp':>7}  weights")
    for name in names:
        last = got[name][-1]
        states = "/".join(f"{r['state_bytes'] * mib:.1f}" for r in last)
        peaks = "/".join(f"{statistics.median(rd[r]['peak_rss'] for rd in got[name]) * mib:.0f}" for r in range(world))
        ms = statistics.median(rd[0]["step_ms"] for rd in got[name])
        ratio = statistics.median(rd[0]["step_ms"] / ref[0]["step_ms"] for rd, ref in zip(got[name], got["ddp"]))
        print(f"  {name:12} {states:>22} {peaks:>24} {ms:8.1f} {ratio:7.3f}  {last[0]['weights']}")
    in_backward = got["backward_sharded"][-1][0].get("mode")
    print(f"  backward_sharded ran mode {in_backward} on rank 0")
    shard = got["sharded"][-1][0].get("shard") or {}
    if shard.get("ranks"):
        gather_ms = statistics.median(1e3 * rd[0]["shard"]["gather_seconds"] / rd[0]["shard"]["gathered_steps"]
                                      for rd in got["sharded"])
        ms = statistics.median(rd[0]["step_ms"] for rd in got["sharded"])
        print(f"  sharded: rank 0 holds {shard['state_bytes'] * mib:.1f} of {shard['state_bytes_unsharded'] * mib:.1f} MiB; "
              f"receives {shard['gather_bytes_per_step'] * mib:.1f} MiB per step in {shard['broadcasts_per_step']} "
              f"broadcasts, {gather_ms:.1f} ms of its {ms:.1f} ms step ({100 * gather_ms / ms:.0f}%; mean over the run)")
    else:
        print(f"  sharded did not shard: {shard}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.models, args.ranks = 1, 4, 1, ["mlp"], [2]
    started = time.perf_counter()
    print(summary())
    for model in args.models:
        for world in args.ranks:
            compare(model, world, args.rounds, args.steps, args.warmup)
    print(closing(started))


if __name__ == "__main__":
    main()
