"""The optimizer step of FSDP2: unpatched (over DTensors), autopatch (over the plain local shards)
and the flat-chunks option autopatch does not take, side by side in one run.

Every contender owns a copy of the same FSDP2 model and its own optimizer; only the first
(unpatched) one runs forward and backward, and each step its gradients are copied into the
others' parameters, so every contender steps from the same gradients and nothing but
``optimizer.step()`` is timed. The contenders take turns inside every step, the first one rotating
from step to step; medians over all timed steps are quoted, and "vs unpatched" is the median of
the per-step ratios, both sides measured within milliseconds of each other.

- unpatched: the optimizer over FSDP2's DTensor parameters;
- autopatch: the same optimizer under autopatch (policy ``multi_layer``, which mode ``auto`` picks
  too), which steps the plain local shards and holds no memory of its own;
- flat copy: the option autopatch does not take, measured: the optimizer steps a copy of the
  local shards under autopatch's ``multi_layer`` (flat buffers, chunks), and every step copies
  the result back into FSDP's shards. It holds a second copy of the shards, the buffer autopatch
  keeps the smallest parameters' gradients in, and the buffers it gathers the other gradients of
  a chunk into, beside FSDP's own gradients ("extra memory", the largest seen at any step). Copying the shards *in* again when something else wrote them
  (loading a checkpoint) is left out, so this is its best case.

Every contender must end with the unpatched weights and optimizer state bit for bit, on every
rank, or the run stops.

    python benchmarks/bench_fsdp.py            # 2 gloo ranks on 127.0.0.1, a few minutes
    python benchmarks/bench_fsdp.py --quick    # smoke run
    python benchmarks/bench_fsdp.py --gpu      # 1 rank, GPT-2 124M on CUDA (needs a GPU)
"""

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from harness import launch
from harness.alternation import rotated
from harness.machine import summary
from harness.optimizers import BertAdam
from harness.adoption import adopt_alone, assert_fused
from harness.fsdp import one_rank_group, shard_gpt2, shard_mlp
from harness.report import markdown
from harness.states import assert_trained_alike
from harness.workloads import stack

MiB = 2**20
CONTENDERS = ("unpatched", "autopatch", "flat copy")


def gpt2(device):
    """GPT-2 124M from its config, random weights, each block and the root sharded by FSDP2."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return shard_gpt2(GPT2LMHeadModel(GPT2Config()).to(device))


OPTIMIZERS = {"AdamW": lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01),
              "BertAdam": lambda params: BertAdam(params, lr=1e-4)}


def under_autopatch(opt):
    """``opt`` alone under autopatch's multi_layer, the unpatched contender left untouched."""
    return adopt_alone(opt, "multi_layer")


class Stepper:
    """A contender: its copy of the model and its optimizer, stepped from the gradients the
    unpatched contender computed; only ``step`` is timed."""

    def __init__(self, name, model, opt, handle=None, step=None):
        self.name, self.model, self.opt, self.handle = name, model, opt, handle
        self.params = list(model.parameters())
        self._step = step or opt.step
        self.times = []

    def take_grads(self, ref_params):
        for p, r in zip(self.params, ref_params):
            p.grad = None if r.grad is None else r.grad.detach().clone()

    def step(self, sync, record):
        sync()
        t0 = time.perf_counter()
        self._step()
        sync()
        if record:
            self.times.append(time.perf_counter() - t0)
        self.opt.zero_grad()

    def extra_bytes(self):
        if self.name != "flat copy":
            return 0
        fusion = self.handle.describe()["fusion"]
        return fusion["flat_bytes"] + fusion["kept_grad_bytes"] + self.opt.gathered_bytes


class FlatCopy:
    """The flat-chunks option: step a copy of the local shards in autopatch's flat buffers, then
    write the result back into FSDP's shards."""

    def __init__(self, params, make_opt):
        with torch.no_grad():
            self.params = params
            self.shards = [p.to_local() for p in params]
            self.copies = [torch.nn.Parameter(s.detach().clone()) for s in self.shards]
        self.opt = make_opt(self.copies)
        self.handle = under_autopatch(self.opt)
        self.gathered_bytes = 0

    def step(self):
        with torch.no_grad():
            for c, p in zip(self.copies, self.params):
                c.grad = None if p.grad is None else p.grad.to_local()
            self.opt.step()
            torch._foreach_copy_(self.shards, [c.detach() for c in self.copies])

    def zero_grad(self):
        """Drop the copies' gradients, noting first the bytes of the buffers autopatch gathered
        them into: every gradient storage they hold that is not FSDP's own."""
        own = {p.grad.to_local().untyped_storage().data_ptr() for p in self.params if p.grad is not None}
        held = {c.grad.untyped_storage().data_ptr(): c.grad.untyped_storage().nbytes()
                for c in self.copies if c.grad is not None}
        self.gathered_bytes = max(self.gathered_bytes, sum(n for ptr, n in held.items() if ptr not in own))
        for c in self.copies:
            c.grad = None

    def state_dict(self):
        return self.opt.state_dict()


def contenders(build, make_opt):
    out = []
    for name in CONTENDERS:
        torch.manual_seed(0)
        model = build()
        if name == "unpatched":
            out.append(Stepper(name, model, make_opt(model.parameters())))
        elif name == "autopatch":
            opt = make_opt(model.parameters())
            out.append(Stepper(name, model, opt, handle=under_autopatch(opt)))
        else:
            flat = FlatCopy(list(model.parameters()), make_opt)
            out.append(Stepper(name, model, flat, handle=flat.handle, step=flat.step))
    return out


def check_equal(ref, other):
    """Same local shards and optimizer state as unpatched, bit for bit, and autopatch really ran
    its fused step."""
    assert_trained_alike(other.name, ref.params, other.params, ref.opt, other.opt)
    assert_fused(other.handle, other.name)
    if other.name == "autopatch":
        fusion = other.handle.describe()["fusion"]
        assert fusion.get("layout") == "local_shards", f"autopatch ran {fusion}"


def measure(build, make_opt, batch, steps, warmup, sync=lambda: None, autocast=None):
    """Train the first contender; every step, each contender steps from its gradients in turn."""
    import contextlib
    runners = contenders(build, make_opt)
    ref = runners[0]
    for i in range(warmup + steps):
        loss = batch(i, ref.model)
        with autocast() if autocast else contextlib.nullcontext():
            value = loss()
        value.backward()
        for r in runners[1:]:
            r.take_grads(ref.params)
        for r in rotated(runners, i):
            r.step(sync, record=i >= warmup)
    for r in runners[1:]:
        check_equal(ref, r)
    out = {}
    for r in runners:
        ratios = [t / u for t, u in zip(r.times, ref.times)]
        out[r.name] = {"median_ms": 1e3 * statistics.median(r.times), "min_ms": 1e3 * min(r.times),
                       "ratio": statistics.median(ratios), "extra_bytes": r.extra_bytes(),
                       "tensors": len(r.params), "params": sum(p.numel() for p in r.params)}
    return out


# -- CPU: 2 gloo ranks --------------------------------------------------------------------------
CPU_MODELS = {"6 x (Linear 64, LayerNorm, GELU) + head": (64, 6),
              "6 x (Linear 512, LayerNorm, GELU) + head": (512, 6),
              "6 x (Linear 2048, LayerNorm, GELU) + head": (2048, 6)}


def cpu_worker(args):
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank = launch.init_rank()
    results = []
    for model_name, (width, depth) in CPU_MODELS.items():
        def batch(i, model):
            g = torch.Generator().manual_seed(1000 * rank + i)
            x, y = torch.randn(16, width, generator=g), torch.randint(0, 4, (16,), generator=g)
            return lambda: nn.functional.cross_entropy(model(x), y)
        for opt_name, make_opt in OPTIMIZERS.items():
            build = lambda: shard_mlp(stack(width, depth, act=nn.GELU, norm=True, head=4))  # noqa: E731
            res = measure(build, make_opt, batch, args.steps, args.warmup)
            for name, r in res.items():
                results.append(dict(r, model=model_name, optimizer=opt_name, contender=name))
    if rank == 0:
        launch.save_results(results)
    dist.barrier()
    dist.destroy_process_group()


def run_cpu(args):
    start = time.time()
    ranks = launch.run_ranks([__file__, "--steps", args.steps, "--warmup", args.warmup, "--worker"], 2,
                             timeout=args.timeout)
    why = launch.failed(ranks)
    if why:
        sys.exit(f"a rank failed:\n{why}")
    print(context("2 gloo ranks on 127.0.0.1, 1 thread each", args, time.time() - start))
    print(table(ranks[0].results))


# -- GPU: 1 rank, GPT-2 124M ----------------------------------------------------------------------
def run_gpu(args):
    if not torch.cuda.is_available():
        print("bench_fsdp --gpu: CUDA is not available on this machine; nothing measured.")
        return
    import torch.distributed as dist
    one_rank_group("nccl")
    torch.cuda.set_device(0)
    start = time.time()
    rows = []
    for opt_name, make_opt in OPTIMIZERS.items():
        def batch(i, model):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 50257, (args.gpu_batch, 256), generator=g).cuda()
            return lambda: model(input_ids=ids, labels=ids).loss
        res = measure(lambda: gpt2("cuda"), make_opt, batch, args.steps, args.warmup,
                      sync=torch.cuda.synchronize, autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        for name, r in res.items():
            rows.append(dict(r, model="GPT-2 124M (1 rank, bf16 autocast)", optimizer=opt_name, contender=name))
        torch.cuda.empty_cache()
    print(context(f"1 rank, {torch.cuda.get_device_name()}", args, time.time() - start))
    print(table(rows))
    dist.destroy_process_group()


# -- reporting ------------------------------------------------------------------------------------
def context(where, args, seconds):
    return (f"bench_fsdp: {summary()}\n{where}; {args.warmup} warm-up + {args.steps} timed steps per "
            f"contender; {seconds:.0f} s\n")


def table(rows):
    body = []
    for r in rows:
        ratio = "1.000" if r["contender"] == "unpatched" else f"{r['ratio']:.3f}"
        model = f"{r['model']} ({r['tensors']} tensors, {r['params'] / 1e6:.2f} M)"
        body.append([model, r["optimizer"], r["contender"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}",
                     ratio, f"{r['extra_bytes'] / MiB:.2f}"])
    return markdown(["model", "optimizer", "contender", "step, median (ms)", "step, min (ms)",
                     "vs unpatched (median of per-step ratios)", "extra memory (MiB)"], body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="few steps: a smoke run")
    ap.add_argument("--gpu", action="store_true", help="GPT-2 124M on one CUDA device instead")
    ap.add_argument("--gpu-batch", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for the whole CPU run of both ranks")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = 6, 2
    if args.worker:
        return cpu_worker(args)
    return run_gpu(args) if args.gpu else run_cpu(args)


if __name__ == "__main__":
    main()
