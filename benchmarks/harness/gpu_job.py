"""One contender of the GPU runs in a process of its own: its model, optimizer and batch; warm-up,
turns of timed steps, peak memory, the host-sync check and the training-result check; and what the
machine is, asked in a process of its own so the parent never holds a CUDA context."""

import os
import platform
import time
import traceback
import warnings
from pathlib import Path

import torch

import autopatch

from .fsdp import fully_shard_function, one_rank_group, shard_gpt2
from .gpu_workloads import (GiB, TORCHVISION, TRANSFORMERS, WORKLOADS, build, make_optimizer, transformers_logging)
from .machine import cpu_model
from .memory import peak_memory_bytes, reset_peak_memory
from .processes import Skip
from .report import first_line
from .states import compare_states

STABLE_STEPS = 5          # warm-up goes on until autopatch's report is unchanged over this many steps
MAX_EXTRA_WARMUP = 60     # ... or this many steps past --warmup


class Job:
    """A contender's model, optimizer and batch; steps, timed steps, memory and its report."""

    def __init__(self, key, contender, opts):
        warnings.filterwarnings("ignore")
        if transformers_logging is not None:
            transformers_logging.set_verbosity_error()
        self.device = torch.device(opts["device"])
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            torch.set_num_threads(1)   # the CPU run shares its cores: one thread each keeps turns fair
        self.patched = contender.policy is not None
        try:
            contender.enable()
        except autopatch.PolicyError as e:
            raise Skip(f"unknown to this autopatch\n{e}") from None
        torch.manual_seed(0)
        self.model, self.forward, (self.x, self.y), self.loss, bf16 = build(key, self.device)
        if opts.get("fsdp"):
            shard(self.model, self.device)
        try:
            self.opt = make_optimizer(WORKLOADS[key].optimizer, self.model, **dict(contender.options))
        except (RuntimeError, ValueError, TypeError) as e:
            raise Skip(f"torch refused {dict(contender.options)}\n{e}") from None
        self.autocast = dict(device_type=self.device.type, dtype=torch.bfloat16, enabled=bf16)
        self.peak_ok = True
        if self.cuda:
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def hello(self):
        params = list(self.model.parameters())
        return {"tensors": len(params), "params": sum(p.numel() for p in params)}

    def _forward_backward(self):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(**self.autocast):
            loss = self.loss(self.forward(self.x), self.y)
        loss.backward()

    def step(self):
        self._forward_backward()
        self.opt.step()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed_step(self):
        """(whole step, opt.step()) seconds."""
        self.sync()
        t0 = time.perf_counter()
        self._forward_backward()
        if self.cuda:
            self.events[0].record()
        o0 = time.perf_counter()
        self.opt.step()
        o1 = time.perf_counter()
        if self.cuda:
            self.events[1].record()
        self.sync()
        whole = time.perf_counter() - t0
        return whole, self.events[0].elapsed_time(self.events[1]) / 1e3 if self.cuda else o1 - o0

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak_ok = reset_peak_memory()

    def peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else peak_memory_bytes(self.peak_ok)

    def release(self):
        if self.cuda:
            torch.cuda.empty_cache()

    def modes(self):
        """[(mode, reason)] per optimizer from autopatch.report(); None unpatched."""
        if not self.patched:
            return None
        return [(o.get("mode"), o.get("reason")) for o in autopatch.report().get("optimizers", [])]

    def warm_up(self, steps):
        for _ in range(steps):
            self.step()
        seen, extra = self.modes(), 0
        while self.patched and extra < MAX_EXTRA_WARMUP:
            for _ in range(STABLE_STEPS):
                self.step()
            extra += STABLE_STEPS
            now = self.modes()
            if now == seen:
                break
            seen = now
        self.sync()
        self.release()
        return {"steps": steps + extra, "modes": seen}

    def turn(self, steps):
        self.step()                  # untimed: the allocator refills after the last turn's release
        self.sync()
        self.reset_peak()
        timed = [self.timed_step() for _ in range(steps)]
        peak = self.peak()
        self.release()
        return {"steps": timed, "peak": peak}

    def sync_check(self):
        """Two steps under set_sync_debug_mode("error"): 'pass', or the failure and where it happened."""
        if not self.cuda:
            return "n/a (CUDA only)"
        self.sync()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                self.step()
        except Exception as e:
            frames = traceback.extract_tb(e.__traceback__)
            ours = [f for f in frames if "/autopatch/" in f.filename] or frames
            where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} in {ours[-1].name}"
            return f"FAIL: {first_line(e) or type(e).__name__} (at {where})"
        finally:
            torch.cuda.set_sync_debug_mode("default")
            self.sync()
        return "pass"

    def finish(self, sync_check):
        out = {"modes": self.modes(),
               "report": autopatch.report() if self.patched else None}
        if sync_check:
            out["sync"] = self.sync_check()
        if self.patched:
            try:
                autopatch.disable()
            except Exception as e:    # after a failed sync check the step it cut short may be half done
                out["disable_error"] = f"{type(e).__name__}: {e}"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return out

    def state(self):
        """Model and optimizer state for the training-result check (forward mode's pending update applied)."""
        if self.patched:
            autopatch.flush()
        return {"model": self.model.state_dict(), "optimizer": {"state": self.opt.state_dict()["state"]}}


def shard(model, device):
    """FSDP2 over one rank (``harness.fsdp``); a contender this torch cannot shard is skipped."""
    try:
        fully_shard_function()
    except ImportError as e:
        raise Skip(f"FSDP2 (fully_shard) not in this torch: {e}") from None
    try:
        one_rank_group("nccl" if device.type == "cuda" else "gloo")
        shard_gpt2(model)
    except Exception as e:
        raise Skip(f"FSDP2 could not be set up: {type(e).__name__}: {e}") from None


def check_worker(conn, key, contender, opts, path, reference):
    """Train --check-steps steps deterministically; the reference saves its state, the others compare."""
    try:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"   # cuBLAS's deterministic workspace
        torch.use_deterministic_algorithms(True)
        job = Job(key, contender, opts)
        for _ in range(opts["check_steps"]):
            job.step()
        state, out = job.state(), {"modes": job.modes()}
        if reference:
            torch.save(state, path)
        else:
            out["equal"], out["max_diff"] = compare_states(torch.load(path, map_location=job.device), state)
        conn.send(out)
    except Skip as e:
        conn.send({"skip": str(e)})
    except BaseException as e:
        conn.send({"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                   "trace": traceback.format_exc()})


def info_worker(conn, device):
    """What the run ran on, asked in a process of its own so the parent never holds a CUDA context."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "transformers": TRANSFORMERS or __import__("transformers").__version__,
           "torchvision": TORCHVISION or __import__("torchvision").__version__}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, capability=f"sm_{p.major}{p.minor}", memory_gib=p.total_memory / GiB,
                   cudnn=torch.backends.cudnn.version(), devices=torch.cuda.device_count())
    else:
        out.update(device=f"CPU: {os.cpu_count()} x {cpu_model()}")
    conn.send(out)
