"""A user's DDP training script, one rank of a torchrun job, for the fault tests (tests/faults/).

It trains a small MLP under DistributedDataParallel with Adam on data drawn from (rank, step),
saves model and optimizer state_dicts to ``FAULT_CHECKPOINT`` every ``FAULT_EVERY`` steps (rank 0)
and loads them at start when present, as a restartable script does (under sharded optimizer
state, rank 0's state_dict() is served the other ranks' shares). At the end every rank saves its
model's state_dict to ``FAULT_OUT/rank{r}.pt``.

``FAULT`` says what goes wrong on rank ``FAULT_RANK`` at step ``FAULT_STEP``: ``raise`` (an
exception), ``kill`` (SIGKILL to itself; under torchrun's restarts only in its first attempt),
``finish`` (it stops training there and exits normally), or ``ready`` (it writes
``FAULT_OUT/ready`` and trains on, for a signal sent from outside). With ``FAULT_HANDLER=1`` the
script has its own SIGTERM and SIGINT handler, which writes ``FAULT_OUT/handled.rank{r}`` and
exits.
"""

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

RANK = int(os.environ["RANK"])
OUT = Path(os.environ["FAULT_OUT"])
FAULT = os.environ.get("FAULT", "none")
FAULT_RANK = int(os.environ.get("FAULT_RANK", 0))
FAULT_STEP = int(os.environ.get("FAULT_STEP", 10))
STEPS = int(os.environ.get("FAULT_STEPS", 40))
PAUSE = float(os.environ.get("FAULT_PAUSE", 0.01))
CHECKPOINT = os.environ.get("FAULT_CHECKPOINT")
EVERY = int(os.environ.get("FAULT_EVERY", 5))


def handler(signum, frame):
    (OUT / f"handled.rank{RANK}").write_text(signal.Signals(signum).name)
    sys.exit(128 + signum)


def batch(step):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def main():
    if os.environ.get("FAULT_HANDLER") == "1":
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("FAULT_PG_TIMEOUT", 60))))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0
    if CHECKPOINT and os.path.exists(CHECKPOINT):
        saved = torch.load(CHECKPOINT, weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    for step in range(start, STEPS):
        if RANK == FAULT_RANK and step == FAULT_STEP:
            if FAULT in ("raise", "kill", "finish") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                (OUT / "fault.time").write_text(repr(time.time()))
            if FAULT == "raise":
                raise RuntimeError(f"the user's script fails on rank {RANK} at step {step}")
            if FAULT == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            if FAULT == "finish":
                break
            if FAULT == "ready":
                (OUT / "ready").write_text(str(step))
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(PAUSE)
        if CHECKPOINT and RANK == 0 and (step + 1) % EVERY == 0:
            part = CHECKPOINT + ".part"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, part)
            os.replace(part, CHECKPOINT)
        if CHECKPOINT and (step + 1) % EVERY == 0:
            dist.barrier()          # every rank resumes from the same checkpoint
    torch.save(model.module.state_dict(), OUT / f"rank{RANK}.pt")


if __name__ == "__main__":
    main()
