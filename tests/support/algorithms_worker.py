"""One rank of the communication-algorithm tests:
``python algorithms_worker.py SUITE RANK WORLD INIT_FILE OUT``.

Each algorithm is driven the way the DDP takeover drives it, around a plain training loop:
``gradient_sync()`` arms a ``BucketedAllreduce`` before each forward, ``before_forward`` /
``before_step`` / ``after_step`` are called around forward and step, and the algorithm finds the
end of backward itself. Each rank feeds different data, so the exchanges matter. The suite's
results are saved with ``torch.save`` for the test to compare across ranks.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from autopatch.comm.algorithms import (AsyncModelAverage, Decentralized, LowPrecisionDecentralized,
                                       QAdam, QAdamOptimizer)
from autopatch import topology
from autopatch.comm.allreduce import BucketedAllreduce
from autopatch.comm.sync_settings import SyncSettings

SUITE, RANK, WORLD, INIT_FILE, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
WIDTH = 8


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return torch.randn(16, WIDTH, generator=g), torch.randint(0, 3, (16,), generator=g)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat(model, vector):
    with torch.no_grad():
        for p, piece in zip(model.parameters(), vector.split([p.numel() for p in model.parameters()])):
            p.copy_(piece.view_as(p))


class Driven:
    """What the DDP takeover does around one model under ``algorithm``."""

    def __init__(self, model, algorithm, sync=None, compression="none"):
        self.model, self.algorithm = model, algorithm
        self.sync = sync or (lambda: algorithm is None or algorithm.gradient_sync())
        params = list(model.parameters())
        self.reducer = BucketedAllreduce(params, [str(i) for i in range(len(params))], dist.group.WORLD,
                                         SyncSettings(2**20, compression))

    def forward(self, x):
        self.reducer.arm(self.sync())
        if self.algorithm is not None:
            self.algorithm.before_forward(True)
        return self.model(x)

    def step(self, opt):
        alg = self.algorithm
        if alg is not None:
            alg.before_step()
        if isinstance(alg, QAdam) and alg.compressing:
            alg.step(opt)
        else:
            opt.step()
        if alg is not None:
            alg.after_step()
        opt.zero_grad()

    def close(self):
        self.reducer.remove()
        if self.algorithm is not None:
            self.algorithm.close()


def train(driven, opt, steps, on_backward=None, data=batch, pause=0.0):
    """``pause``: seconds each step sleeps, as a longer computation would leave a background
    thread's rounds the time they need."""
    losses = []
    for t in range(steps):
        time.sleep(pause)
        x, y = data(t)
        loss = nn.functional.cross_entropy(driven.forward(x), y)
        loss.backward()
        if on_backward is not None:
            on_backward(t)
        driven.step(opt)
        losses.append(loss.item())
    return losses


# -- decentralized ---------------------------------------------------------------------------------
SHIFT_ONE_4 = [{0: 2, 2: 0, 1: 3, 3: 1}, {0: 3, 3: 0, 1: 2, 2: 1}]   # the pairs of s = 0, 1, 0, 1, ...


def decentralized(mode, interval, steps=6, hierarchical=False, group=None):
    """Losses, final weights, and (weights as the step began, weights after backward) per
    communicating step."""
    model = small_mlp()
    before = {}
    alg = Decentralized(model.parameters(), group or dist.group.WORLD, peer_selection_mode=mode,
                        communication_interval=interval, hierarchical=hierarchical)
    driven = Driven(model, alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    exchanges = []
    real_forward = driven.forward

    def forward(x):
        before["w"] = flat(model)
        return real_forward(x)
    driven.forward = forward

    def averaged(t):
        if t % interval == 0:
            exchanges.append((before["w"], flat(model)))
    losses = train(driven, opt, steps, on_backward=averaged)
    out = {"losses": losses, "weights": flat(model), "exchanges": exchanges, "describe": alg.describe()}
    driven.close()
    return out


def decentralized_reference(mode, interval, steps=6):
    """The same job written directly with torch.distributed: all_reduce, or isend/irecv pairs."""
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, s = [], 0
    for t in range(steps):
        x, y = batch(t)
        mixed = None
        if t % interval == 0:
            mine = flat(model)
            if mode == "all":
                mixed = mine.mul(1 / WORLD)
                dist.all_reduce(mixed)
            else:
                peer = SHIFT_ONE_4[s % 2][RANK]
                theirs = torch.empty_like(mine)
                send, recv = dist.isend(mine, peer), dist.irecv(theirs, peer)
                send.wait()
                recv.wait()
                mixed = (mine + theirs) * 0.5
            s += 1
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if mixed is not None:
            set_flat(model, mixed)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": flat(model)}


def bad_inputs():
    """The messages of shift_one on three ranks, and on one node with hierarchical=True."""
    errors = {}
    three = dist.new_group([0, 1, 2])
    if RANK < 3:
        try:
            Decentralized(small_mlp().parameters(), three, peer_selection_mode="shift_one")
        except ValueError as e:
            errors["odd"] = str(e)
    os.environ["LOCAL_WORLD_SIZE"] = str(WORLD)         # every rank on one node
    topology.forget()
    try:
        Decentralized(small_mlp().parameters(), dist.group.WORLD, peer_selection_mode="shift_one",
                      hierarchical=True)
    except ValueError as e:
        errors["one_node"] = str(e)
    return errors


# -- low precision ---------------------------------------------------------------------------------
def low_precision(interval, steps=5, hierarchical=False):
    """Replicas before each communication, the weights it started from and the replica after
    (on node leaders only, when hierarchical)."""
    model = small_mlp()
    alg = LowPrecisionDecentralized(model.parameters(), dist.group.WORLD, communication_interval=interval,
                                    row_elements=32, hierarchical=hierarchical)
    if not alg.replica:
        driven = Driven(model, alg)
        train(driven, torch.optim.SGD(model.parameters(), lr=0.1), steps)
        driven.close()
        return {"replica": None, "weights": flat(model)}
    driven = Driven(model, alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    communications = []
    real_step = opt.step

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        communications.append({"s": alg.replica[0].clone(), "x": flat(model),
                               "neighbours": {p: r[0].clone() for p, r in alg.neighbour_replicas.items()}})
        return out
    opt.step = step
    train(driven, opt, steps)
    for i, c in enumerate(communications):
        c["s_after"] = communications[i + 1]["s"] if i + 1 < len(communications) else alg.replica[0].clone()
    out = {"communications": communications, "replica": alg.replica[0].clone(),
           "neighbour_replicas": {p: r[0].clone() for p, r in alg.neighbour_replicas.items()},
           "weights": flat(model), "describe": alg.describe()}
    driven.close()
    return out


# -- QAdam -----------------------------------------------------------------------------------------
def qadam_warmup(steps=8):
    """QAdamOptimizer inside its warm-up, and torch.optim.Adam, on averaged gradients."""
    runs = {}
    for name, make in (("qadam", lambda ps: QAdamOptimizer(ps, lr=0.01, warmup_steps=1000, weight_decay=0.01)),
                       ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01))):
        model = small_mlp()
        driven = Driven(model, None)
        runs[name] = {"losses": train(driven, make(model.parameters()), steps), "weights": flat(model)}
        driven.close()
    return runs


ADAMS = {"adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.05),
         "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.5)}


def qadam_after_warmup(kind, warmup=3, steps=7):
    """QAdam (uncompressed, so the arithmetic is comparable) continuing a user's Adam or AdamW,
    QAdamOptimizer switching by itself, and the same update written out by hand."""
    model = small_mlp()
    if kind == "optimizer":
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=warmup, weight_decay=0.05,
                             compression="none")
        driven = Driven(model, None, sync=lambda: opt.steps_taken < warmup)
    else:
        opt = ADAMS[kind](model.parameters())
        driven = Driven(model, QAdam(model.parameters(), dist.group.WORLD, warmup_steps=warmup, compression="none"))
    losses = train(driven, opt, steps)
    driven.close()
    return {"qadam": {"losses": losses, "weights": flat(model)},
            "reference": qadam_reference(ADAMS.get(kind, ADAMS["adam"]), kind, warmup, steps)}


def qadam_reference(make, kind, warmup, steps):
    model = small_mlp()
    params = list(model.parameters())
    opt = make(params)
    lr, (b1, b2), eps, wd = 0.01, opt.defaults["betas"], opt.defaults["eps"], opt.defaults["weight_decay"]
    losses = []
    for t in range(steps):
        x, y = batch(t)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            if t < warmup:                     # Adam on the averaged gradient
                for p in params:
                    p.grad.mul_(1 / WORLD)
                    dist.all_reduce(p.grad)
                opt.step()
            else:                              # the switch step's own gradient is used
                for p in params:            # each rank's step direction, clipped, is averaged
                    st = opt.state[p]
                    g = p.grad if kind == "adamw" else p.grad + wd * p
                    m = b1 * st["exp_avg"] + (1 - b1) * g
                    denom = (st["exp_avg_sq"] / (1 - b2 ** warmup)).sqrt() + eps
                    bound = max(1, (1 - b1) / (1 - b2) ** 0.5)
                    direction = (m / denom).clamp_(-bound, bound).mul_(1 / WORLD)
                    dist.all_reduce(direction)
                    st["exp_avg"].copy_(direction * denom)
                    st["step"] += 1
                    if kind == "adamw":
                        p.mul_(1 - lr * wd)
                    p.sub_(lr / (1 - b1 ** (t + 1)) * direction)
        opt.zero_grad()
    return {"losses": losses, "weights": flat(model)}


def qadam_compressed(steps=6):
    model = small_mlp()
    alg = QAdam(model.parameters(), dist.group.WORLD, warmup_steps=2)
    driven = Driven(model, alg)
    train(driven, torch.optim.Adam(model.parameters(), lr=0.01), steps)
    out = {"weights": flat(model), "describe": alg.describe()}
    driven.close()
    return out


# -- handwritten digits ----------------------------------------------------------------------------
def digits():
    """Test accuracy (mean over ranks) of a small MLP trained on sklearn's digits, 4 ranks."""
    from digits_data import load
    x, y = load()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = order[:1400], order[1400:]
    mine = train_idx[RANK::WORLD]
    epochs, bs = 15, 20
    per_epoch = len(mine) // bs

    def data(t):
        epoch, i = divmod(t, per_epoch)
        perm = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(100 * RANK + epoch))]
        idx = perm[i * bs:(i + 1) * bs]
        return x[idx], y[idx]

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def accuracy(model):
        with torch.no_grad():
            return (model(x[test_idx]).argmax(1) == y[test_idx]).float().mean().item() * 100

    algorithms = {
        "ddp": None,
        "bytegrad": lambda ps: None,             # the bucketed allreduce, 8-bit
        "decentralized_all": lambda ps: Decentralized(ps, dist.group.WORLD),
        "decentralized_shift_one": lambda ps: Decentralized(ps, dist.group.WORLD, peer_selection_mode="shift_one"),
        "low_precision_decentralized": lambda ps: LowPrecisionDecentralized(ps, dist.group.WORLD),
        "async": lambda ps: AsyncModelAverage(ps, dist.group.WORLD, sync_interval_ms=2, warmup_steps=per_epoch),
        "qadam": lambda ps: QAdam(ps, dist.group.WORLD, warmup_steps=per_epoch),
    }
    results = {}
    for name, make in algorithms.items():
        model = net()
        driven = DDPAsIs(model) if name == "ddp" else Driven(
            model, make(list(model.parameters())), compression="minmax_uint8" if name == "bytegrad" else "none")
        train(driven, torch.optim.Adam(model.parameters(), lr=1e-2), epochs * per_epoch, data=data,
              pause=0.004 if name == "async" else 0.0)
        driven.close()
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, accuracy(model))
        results[name] = {"accuracy": sum(everyone) / WORLD, "per_rank": everyone,
                         "describe": driven.algorithm.describe() if getattr(driven, "algorithm", None) else None,
                         "gradient_bytes_per_step": getattr(getattr(driven, "reducer", None), "bytes_per_step", None)}
    return results


class DDPAsIs:
    """The baseline: torch's DistributedDataParallel with its own reducer."""

    def __init__(self, model):
        self.forward = torch.nn.parallel.DistributedDataParallel(model)

    def step(self, opt):
        opt.step()
        opt.zero_grad()

    def close(self):
        pass


# -- async -----------------------------------------------------------------------------------------
def async_job(schedule):
    """Train under async averaging (20 ms rounds) following ``schedule``; each rank ends as the
    schedule says and the process then exits."""
    model = small_mlp()
    alg = AsyncModelAverage(model.parameters(), dist.group.WORLD, sync_interval_ms=20, warmup_steps=10)
    driven = Driven(model, alg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    synced = []

    def epoch(n):
        for t in range(n):
            synced.append(alg.gradient_sync())
            train(driven, opt, 1, data=lambda _: batch(len(synced)), pause=0.002)

    if schedule == "warmup":                  # Bagua's run_epochs: train, then abort once
        for _ in range(5):
            epoch(10)
        alg.abort()
    elif schedule == "cycles":                # Bagua's run_multiple_aborts
        for _ in range(10):
            alg.resume()
            alg.resume()
            epoch(10)
            alg.abort()
            alg.abort()
    elif schedule == "uneven":                # different step counts; no abort: exit stops it
        epoch(10 + 40 * RANK)
    elif schedule == "destroy":               # the group destroyed with averaging under way
        epoch(30)
    return {"synced": synced, "describe": alg.describe(), "weights": flat(model)}


def main():
    os.environ["RANK"] = str(RANK)
    os.environ["LOCAL_WORLD_SIZE"] = str(WORLD)
    dist.init_process_group("gloo", init_method=f"file://{INIT_FILE}", rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    res = {}
    if SUITE == "four":
        for mode in ("all", "shift_one"):
            for k in (1, 2):
                res[f"{mode}_{k}"] = decentralized(mode, k)
                res[f"{mode}_{k}_reference"] = decentralized_reference(mode, k)
        os.environ["LOCAL_WORLD_SIZE"] = "2"           # two nodes of two ranks
        topology.forget()
        for mode in ("all", "shift_one"):
            res[f"hierarchical_{mode}"] = decentralized(mode, 3, steps=4, hierarchical=True)
        res["hierarchical_low_precision"] = low_precision(1, hierarchical=True)
        res["errors"] = bad_inputs()
        for k in (1, 2):
            res[f"low_precision_{k}"] = low_precision(k)
        res["qadam_warmup"] = qadam_warmup()
        for kind in ("adam", "adamw", "optimizer"):
            res[f"qadam_{kind}"] = qadam_after_warmup(kind)
        res["qadam_compressed"] = qadam_compressed()
        res["digits"] = digits()
    elif SUITE == "digits":
        res["digits"] = digits()
    elif SUITE == "pair":
        res["low_precision"] = low_precision(1)
        res["shift_one"] = decentralized("shift_one", 1, steps=3)
    else:
        res = async_job(SUITE.removeprefix("async_"))
    torch.save(res, OUT)
    if SUITE == "async_destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
