"""One rank of the bucketed-allreduce tests: ``python allreduce_worker.py SUITE RANK INIT_FILE OUT``.

Every scenario trains the same seeded job twice in this process group, under plain DDP and with
autopatch taking DDP over, and saves what the test compares (losses, weights, buffers, gradients,
the report). Each rank feeds different data, so the averaging matters.
"""

import contextlib
import datetime
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import autopatch
from autopatch import topology
from autopatch.comm.layout_check import LayoutMismatch
from autopatch.comm.waiting import CommunicationError
from memory import TensorMemory

WIDTH = 32
SUITE, RANK, INIT_FILE, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def batchnorm_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 3))


def plain_mlp():
    """No buffers, so no forward collective: a dead or slow peer shows up in the gradient sync."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 3))


class Branchy(nn.Module):
    """``head_b`` is used on rank 0 always and on rank 1 every other step; ``never`` never is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head_a = nn.Linear(WIDTH, 3)
        self.head_b = nn.Linear(WIDTH, 3)
        self.never = nn.Linear(WIDTH, 3)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.head_a(h) + self.head_b(h) if use_b else self.head_a(h)


def batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * RANK + 10 * step + micro)
    return torch.randn(8, WIDTH, generator=g), torch.randint(0, 3, (8,), generator=g)


def job(enable=None, *, model=batchnorm_mlp, optimizer="sgd", steps=4, accumulate=1,
        set_to_none=True, ddp_kwargs=None, on_step=None, prebuilt=None):
    """Train under DDP, with autopatch enabled by ``enable(**enable)`` when given."""
    if enable is not None and prebuilt is None:
        autopatch.enable(**enable)
    try:
        net = prebuilt if prebuilt is not None else DDP(model(), **(ddp_kwargs or {}))
        if prebuilt is not None and enable is not None:
            autopatch.enable(**enable)
        opt = (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
               else torch.optim.Adam(net.parameters(), lr=0.01))
        losses, first_grads = [], None
        for step in range(steps):
            for micro in range(accumulate):
                sync = contextlib.nullcontext() if micro == accumulate - 1 else net.no_sync()
                with sync:
                    x, y = batch(step, micro)
                    extra = (RANK == 0 or step % 2 == 0,) if isinstance(net.module, Branchy) else ()
                    loss = nn.functional.cross_entropy(net(x, *extra), y)
                    loss.backward()
            if first_grads is None:
                first_grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, net)
        return {"losses": losses, "weights": [p.detach().clone() for p in net.parameters()],
                "buffers": [b.clone() for b in net.buffers()], "first_grads": first_grads,
                "grad_is_none": [p.grad is None for p in net.parameters()],
                "report": autopatch.report() if enable is not None else None}
    finally:
        if enable is not None:
            autopatch.disable()


def on(**allreduce):
    """Allreduce taken over; fusion off, so only the gradient sync differs from the DDP run."""
    return {"mode": "off", "allreduce": dict({"enabled": True}, **allreduce)}


def local_first_grads(model=batchnorm_mlp):
    """This rank's own step-0 gradients, without any averaging."""
    net = model()
    x, y = batch(0)
    nn.functional.cross_entropy(net(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def gathered(tensor):
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


def equivalence():
    res = {"ddp": job(), "ddp_adam": job(optimizer="adam")}
    for nbytes in (1024, 8192, 25 * 2**20):
        res[f"bucket_{nbytes}"] = job(on(bucket_bytes=nbytes))

    def change_buckets(step, net):
        comm = autopatch.session().allreduce
        if step == 0:
            comm.set_bucket_bytes(1024)
        elif step == 2:
            comm.set_bucket_bytes(8192)
    res["changing"] = job(on(bucket_bytes=25 * 2**20), on_step=change_buckets)
    res["bucket_size_2p"] = job(on(bucket_size_2p=10))

    res["ddp_no_sync"] = job(optimizer="adam", accumulate=3, set_to_none=False)
    res["no_sync"] = job(on(bucket_bytes=1024), optimizer="adam", accumulate=3, set_to_none=False)

    unused = dict(model=Branchy, optimizer="adam", ddp_kwargs={"find_unused_parameters": True})
    res["ddp_unused"] = job(**unused)
    res["unused"] = job(on(bucket_bytes=1024), **unused)
    res["ddp_unused_no_sync"] = job(accumulate=2, **unused)
    res["unused_no_sync"] = job(on(bucket_bytes=1024), accumulate=2, **unused)

    res["local_grads"] = gathered(local_first_grads())
    for compression in ("fp16", "bf16", "minmax_uint8"):
        res[compression] = job(on(compression=compression))

    res["multi_layer"] = job({"mode": "multi_layer", "allreduce": {"enabled": True}}, optimizer="adam")
    res["ddp_adam_6"] = job(optimizer="adam", steps=6)
    for mode in ("forward", "backward"):    # these modes start after watching 3 steps
        res[mode] = job({"mode": mode, "allreduce": {"enabled": True}}, optimizer="adam", steps=6)
    res["backward_small_buckets"] = job({"mode": "backward", "allreduce": {"enabled": True, "bucket_bytes": 1024}},
                                        optimizer="adam", steps=6)
    res["minmax_adam_6"] = job(on(compression="minmax_uint8", bucket_bytes=1024), optimizer="adam", steps=6)
    res["backward_minmax"] = job({"mode": "backward", "allreduce": {"enabled": True, "bucket_bytes": 1024,
                                                                    "compression": "minmax_uint8"}},
                                 optimizer="adam", steps=6)

    def shrink_buckets_while_fusing(step, net):
        if step == 4:        # backward fusion has run one step; the next backward uses 1 KiB buckets
            autopatch.session().allreduce.set_bucket_bytes(1024)
    res["backward_changing"] = job({"mode": "backward", "allreduce": {"enabled": True}}, optimizer="adam",
                                   steps=7, on_step=shrink_buckets_while_fusing)
    res["ddp_adam_7"] = job(optimizer="adam", steps=7)
    res["ddp_unused_6"] = job(steps=6, **unused)
    res["backward_unused"] = job({"mode": "backward", "allreduce": {"enabled": True, "bucket_bytes": 1024}},
                                 steps=6, **unused)
    res["backward_left_to_ddp"] = job({"mode": "backward", "allreduce": {"enabled": False}},
                                      optimizer="adam", steps=6)
    # Mode auto: watched 2 steps, then 16 steps measuring 4 modes, then the choice for 5 steps.
    res["auto"] = job({"mode": "auto", "allreduce": {"enabled": True},
                       "fusion": {"observe_steps": 2, "measure_steps": 16}}, optimizer="adam", steps=24)
    res["ddp_adam_24"] = job(optimizer="adam", steps=24)

    for nodes, group_rank, local in (("2x1", RANK, 1), ("1x2", 0, 2)):   # as torchrun would set them
        os.environ.update(GROUP_RANK=str(group_rank), LOCAL_WORLD_SIZE=str(local))
        topology.forget()
        res[f"hierarchical_{nodes}"] = job(on(hierarchical=True, bucket_bytes=8192))
        res[f"hierarchical_{nodes}_fp16"] = job(on(hierarchical=True, compression="fp16"))

    for mode in ("off", "backward"):
        # Now and then a collective's buffers outlive it inside gloo for a while: the least of
        # three runs is the job's own memory.
        runs = [steady_peak(mode) for _ in range(3)]
        res[f"peak_{mode}"] = dict(runs[0], peak=min(r["peak"] for r in runs),
                                   after_backward=min(r["after_backward"] for r in runs))

    prebuilt = DDP(batchnorm_mlp())
    res["adopted_then_disabled"] = job(on(bucket_bytes=1024), prebuilt=prebuilt, steps=2)
    res["adopted_then_disabled"]["after"] = job(prebuilt=prebuilt, steps=2)
    prebuilt = DDP(batchnorm_mlp())
    res["ddp_2_then_2"] = job(prebuilt=prebuilt, steps=2)
    res["ddp_2_then_2"]["after"] = job(prebuilt=prebuilt, steps=2)
    del prebuilt     # enable() adopts every live DDP model; keep the next reports to their own

    def register_hook(step, net):
        if step == 1:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.allreduce_hook)
    res["comm_hook"] = job(on(), on_step=register_hook)
    res["static_graph"] = job(on(), ddp_kwargs={"static_graph": True})
    res["disabled_policy"] = job({"mode": "off", "allreduce": {"enabled": False}})
    return res


def steady_peak(mode, width=512, layers=8):
    """Tensor memory of a DDP job taken over by autopatch's allreduce (64 KiB buckets) in
    ``mode``: the most bytes held at once over two steady-state steps, the bytes held right after
    a backward, and the job's gradient bytes."""
    autopatch.enable(mode=mode, fusion={"observe_steps": 1},
                     allreduce={"enabled": True, "bucket_bytes": 65536})
    gc.collect()     # earlier runs' tensors (kept for their report until this enable()) are freed now
    with TensorMemory() as tm:
        try:
            torch.manual_seed(0)
            net = DDP(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]))
            opt = torch.optim.Adam(net.parameters(), lr=0.01)
            x = batch(0)[0].repeat(4, width // WIDTH)

            def step(between=None):
                opt.zero_grad()
                net(x).square().mean().backward()
                if between is not None:
                    with between:
                        pass
                opt.step()
            for _ in range(4):
                step()
            with tm.window():
                step(tm.window())
                step()
            ran = autopatch.report()["optimizers"][0]["mode"]
        finally:
            autopatch.disable()
    peak, after_backward = tm.peaks()
    return {"peak": peak, "after_backward": after_backward, "grad_bytes": layers * width * width * 4,
            "mode": ran}


def expect_error(fn):
    """Run ``fn``; return the exception's type name, message and the seconds it took to come."""
    start = time.perf_counter()
    try:
        fn()
    except (CommunicationError, LayoutMismatch, RuntimeError) as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - start}
    return {"type": None, "message": "", "seconds": time.perf_counter() - start}


def failures():
    res = {"mismatch": expect_error(lambda: job(on(bucket_bytes=1024 if RANK == 0 else 8192)))}
    dist.barrier()      # a mismatch leaves the process group usable: nothing mismatched was sent
    res["unused_without_flag"] = expect_error(lambda: job(on(), model=Branchy, steps=2))
    dist.barrier()      # so does DDP's unused-parameter error: the step's collectives all ran

    res["accumulation_in_backward_mode"] = expect_error(accumulate_once_backward_is_chosen)
    dist.barrier()      # every collective of the failing backward ran on both ranks

    def die(step, net):
        if step == 2 and RANK == 1:
            os._exit(17)
    res["death"] = expect_error(lambda: job(on(timeout_seconds=30), model=plain_mlp, on_step=die))
    return res


def accumulate_once_backward_is_chosen():
    """Mode backward across processes, then two synchronised backwards before one step()."""
    autopatch.enable(mode="backward", fusion={"observe_steps": 1},
                     allreduce={"enabled": True, "bucket_bytes": 1024})
    try:
        net = DDP(plain_mlp())
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        for step in range(6):
            for micro in range(1 if step < 4 else 2):
                x, y = batch(step, micro)
                nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        autopatch.disable()


def stall():
    """Last in its spawn: after a timeout the process group is in no state to go on."""
    res = {}
    stalled_at = {}

    def slow_rank_1(step, net):
        if step == 1:
            stalled_at["time"] = time.perf_counter()
            if RANK == 1:
                time.sleep(3)
    res["stall"] = expect_error(lambda: job(on(timeout_seconds=1.5), model=plain_mlp, on_step=slow_rank_1))
    res["stall"]["seconds"] = time.perf_counter() - stalled_at["time"]
    return res


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"file://{INIT_FILE}", rank=RANK, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {"equivalence": equivalence, "failures": failures, "stall": stall}[SUITE]()
    torch.save(results, OUT)
    sys.stdout.flush()
    os._exit(0)     # a peer may be gone: skip the process group's teardown
