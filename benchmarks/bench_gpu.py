"""The GPU table: step time, optimizer time and peak memory of autopatch's modes and torch's optimizers.

Measured on CUDA, on MobileNetV2, GPT-2 124M and a 400-tensor MLP.

Contenders: unpatched with torch's default implementation (foreach on CUDA), a second unpatched
process (the noise floor: what two identical processes differ by), unpatched ``foreach=False``,
unpatched ``fused=True`` (AdamW and SGD only), autopatch ``multi_layer``, ``backward``,
``forward`` and ``auto``, and the builtin policy ``fast`` (mode auto, and forced to
``multi_layer`` and ``backward``; the notes give each optimizer's route, probe deviation and
compile time). A contender whose policy or option the autopatch under test does not know
(``autopatch.PolicyError``) is skipped with a note.

Method. Each contender trains in a process of its own (global hooks of one mode can never slow
another, and each process's peak memory is its own), all started once per workload from a fork
server that imported torch but never touched CUDA. They warm up one at a time, for at least
``--warmup`` steps and until ``autopatch.report()`` has shown the same mode and reason for 5 steps
(the modes that watch the first steps have decided), then take turns, round by round, the
starting one rotating. In its turn a process runs one untimed step (its allocator refills), then
``--steps`` timed steps, then hands its cached GPU memory back (``torch.cuda.empty_cache``), so
the idle contenders leave the active one the whole device. A step is ``zero_grad(); loss =
f(model(x)); loss.backward(); opt.step()``: whole-step time between two
``torch.cuda.synchronize()``, optimizer time between CUDA events around ``opt.step()`` (no extra
sync, so the step is timed as it runs). Mode ``backward`` updates inside backward and ``forward``
inside the next forward: their optimizer column shrinks by design and only the whole step
compares. Figures are medians over all timed steps; ratios are the median of per-round ratios
against unpatched (launch-bound runs drift by +-15% between processes and over time; the second
unpatched process shows how much of a ratio that drift can explain). Peak memory is
``torch.cuda.max_memory_allocated()`` over the timed steps (reset after each turn's untimed step),
the largest over all turns.

Checks. Training results: every contender trains ``--check-steps`` steps from the same seed in a
fresh process under ``torch.use_deterministic_algorithms(True)``, and its model and optimizer
state are compared with unpatched's: bit for bit, or the largest weight difference (``fused=True``
and the ``fast`` contenders are expected to differ by float rounding; the exact modes must not differ at all, and
the script exits 1 if one does). No host-device sync: after timing, each contender runs two
steady-state steps under ``torch.cuda.set_sync_debug_mode("error")``; a synchronising call fails
the check with torch's message and where it was made.

Extra runs: ``--max-model`` bisects the layer count of a GPT-2-style model (width 3072, 24 heads,
AdamW, fp32 weights, bf16 autocast, batch 1 x 256, 6 steps) that trains without running out of
memory, each try in a fresh process; ``--chunk-sweep`` times ``multi_layer`` and ``backward`` over
chunk sizes; ``--fsdp`` times a 1-rank FSDP2 (``fully_shard``) GPT-2, unpatched against autopatch's
default policy. ``--device cpu`` runs everything on small shapes, to exercise the harness where
there is no GPU (peak memory is then the process's peak resident set; the sync check is CUDA-only;
``--max-model`` caps the process's data segment to stand in for the device's capacity).

Results go to ``--out`` as Markdown (one table per run) and JSON (every raw figure), written after
each workload so a run cut short keeps what it measured, and the Markdown is printed at the end.

    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --workloads mobilenet
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --workloads gpt2,mlp
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --max-model --fsdp
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --chunk-sweep
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --device cpu --quick --out DIR   # harness smoke run
"""

import argparse
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import autopatch
from harness.alternation import median_ms, quartiles, round_ratios, turns
from harness.machine import autopatch_source, cpu_model
from harness.memory import peak_memory_bytes, reset_peak_memory, status_kib
from harness.optimizers import BertAdam
from harness.processes import Skip, Worker, WorkerError, serve
from harness.report import first_line, markdown
from harness.states import compare_states
from harness.workloads import mobilenet_v2 as in_repo_mobilenet_v2
from harness.workloads import square_loss, token_loss

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging
    TRANSFORMERS = None
except ImportError as e:
    GPT2Config = GPT2LMHeadModel = None
    TRANSFORMERS = f"transformers not importable: {e}"
try:
    from torchvision.models import mobilenet_v2 as torchvision_mobilenet_v2
    TORCHVISION = None
except Exception as e:   # absent, or built for another torch (then it fails with other errors)
    torchvision_mobilenet_v2 = None
    TORCHVISION = f"torchvision not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"

MiB, GiB = 2**20, 2**30
STABLE_STEPS = 5          # warm-up goes on until autopatch's report is unchanged over this many steps
MAX_EXTRA_WARMUP = 60     # ... or this many steps past --warmup
EXACT_MODES = ("multi_layer", "backward", "forward", "auto")   # must train bit for bit like unpatched


# -- workloads ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    model: str        # mobilenet | gpt2 | mlp
    batch: int        # on CUDA; --device cpu divides it by 8
    optimizer: str    # SGD | AdamW | BertAdam


WORKLOADS = {
    "mobilenet-b32-sgd": Workload("mobilenet", 32, "SGD"),
    "mobilenet-b32-adamw": Workload("mobilenet", 32, "AdamW"),
    "mobilenet-b96-sgd": Workload("mobilenet", 96, "SGD"),
    "mobilenet-b96-adamw": Workload("mobilenet", 96, "AdamW"),
    "gpt2-b1-adamw": Workload("gpt2", 1, "AdamW"),
    "gpt2-b1-bertadam": Workload("gpt2", 1, "BertAdam"),
    "gpt2-b8-adamw": Workload("gpt2", 8, "AdamW"),
    "gpt2-b8-bertadam": Workload("gpt2", 8, "BertAdam"),
    "mlp-adamw": Workload("mlp", 128, "AdamW"),
    "mlp-bertadam": Workload("mlp", 128, "BertAdam"),
}
SWEEP_WORKLOADS = ("gpt2-b8-adamw", "gpt2-b8-bertadam", "mobilenet-b32-sgd")
SWEEP_MIB = (1, 4, 16, 64, 256)

# Shapes per device: the real ones on CUDA, small ones that keep a 2-core CPU run short.
SHAPES = {
    "cuda": {"image": 224, "gpt2": {}, "seq": 512, "mlp_width": 256, "batch_div": 1,
             "max_model": {"n_embd": 3072, "n_head": 24}, "max_model_seq": 256},
    "cpu": {"image": 64, "gpt2": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1024,
                                  "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0},
            "seq": 64, "mlp_width": 32, "batch_div": 8,
            "max_model": {"n_embd": 128, "n_head": 4, "vocab_size": 1024, "n_positions": 128,
                          "bos_token_id": 0, "eos_token_id": 0}, "max_model_seq": 32},
}
CPU_MEMORY_CAP = 96 * MiB   # --max-model on CPU: the data segment may grow this much past start-up
# How running out of memory reads when it does not raise torch's OutOfMemoryError or MemoryError.
OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "bad_alloc", "CUBLAS_STATUS_ALLOC_FAILED")


def shapes(device):
    return SHAPES["cuda" if device.type == "cuda" else "cpu"]


def batch_size(workload, device):
    return max(1, workload.batch // shapes(device)["batch_div"])


def gpt2_config(device):
    return GPT2Config(use_cache=False, **shapes(device)["gpt2"])


def mobilenet_source(device):
    if torchvision_mobilenet_v2 is not None:
        return "torchvision"
    return f"in-repo builder x{1.0 if device.type == 'cuda' else 0.35}"


def describe(key, device):
    w, s = WORKLOADS[key], shapes(device)
    b = batch_size(w, device)
    if w.model == "mobilenet":
        what = f"MobileNetV2 ({mobilenet_source(device)}), {s['image']} px, batch {b}"
    elif w.model == "gpt2":
        c = gpt2_config(device)
        what = f"GPT-2 {c.n_layer}x{c.n_embd}, seq {s['seq']}, batch {b}, bf16 autocast"
    else:
        what = f"MLP 200 x Linear({s['mlp_width']}), batch {b}"
    return f"{what}; {w.optimizer}"


def build(key, device):
    """(model, forward, (x, y), loss, bf16) of a workload, weights from the current seed, on ``device``."""
    w, s = WORKLOADS[key], shapes(device)
    b = batch_size(w, device)
    gen = torch.Generator().manual_seed(1)
    if w.model == "mobilenet":
        with torch.device(device):
            if torchvision_mobilenet_v2 is not None:
                model, classes = torchvision_mobilenet_v2(), 1000
            elif device.type == "cuda":
                model, classes = in_repo_mobilenet_v2(width=1.0, classes=1000), 1000
            else:
                model, classes = in_repo_mobilenet_v2(), 100
        x = torch.randn(b, 3, s["image"], s["image"], generator=gen)
        y = torch.randint(0, classes, (b,), generator=gen)
        forward, loss, bf16 = model, nn.functional.cross_entropy, False
    elif w.model == "gpt2":
        if GPT2LMHeadModel is None:
            raise Skip(TRANSFORMERS)
        config = gpt2_config(device)
        with torch.device(device):
            model = GPT2LMHeadModel(config)
        x = torch.randint(0, config.vocab_size, (b, s["seq"]), generator=gen)
        y = torch.randint(0, config.vocab_size, (b, s["seq"]), generator=gen)
        forward, loss, bf16 = (lambda ids: model(input_ids=ids).logits), token_loss, True
    else:
        width = s["mlp_width"]
        with torch.device(device):
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(200)])
        x, y = torch.randn(b, width, generator=gen), None
        forward, loss, bf16 = model, square_loss, False
    model.to(device).train()
    return model, forward, (x.to(device), None if y is None else y.to(device)), loss, bf16


def make_optimizer(name, model, **options):
    """Two param groups, as training recipes have them: weights with decay, biases and norms without."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay, rate = {"SGD": (1e-4, 0.01), "AdamW": (0.01, 1e-4), "BertAdam": (0.01, 1e-4)}[name]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if name == "SGD":
        return torch.optim.SGD(groups, lr=rate, momentum=0.9, **options)
    if name == "AdamW":
        return torch.optim.AdamW(groups, lr=rate, **options)
    return BertAdam(groups, lr=rate)


# -- contenders ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    policy: object = None     # autopatch.enable(policy, **overrides); None: unpatched
    overrides: tuple = ()
    options: tuple = ()       # keyword arguments of the optimizer

    def enable(self):
        if self.policy is not None:
            autopatch.enable(self.policy, **dict(self.overrides))


def fusion_mode(mode, name=None, label=None, **overrides):
    """An autopatch contender: the default policy with ``fusion.mode`` (and more) overridden."""
    return Contender(name or mode, label or f"autopatch {mode}", "default",
                     tuple({"mode": mode, **overrides}.items()))


UNPATCHED = Contender("unpatched", "unpatched (torch default)")
TABLE = [UNPATCHED,
         Contender("twin", "unpatched, second process (noise)"),
         Contender("foreach_off", "unpatched foreach=False", options=(("foreach", False),)),
         Contender("fused", "unpatched fused=True", options=(("fused", True),)),
         *[fusion_mode(m) for m in EXACT_MODES],
         Contender("fast", "autopatch policy fast (within rounding)", "fast"),
         Contender("fast_multi_layer", "autopatch fast, multi_layer", "fast", (("mode", "multi_layer"),)),
         Contender("fast_backward", "autopatch fast, backward", "fast", (("mode", "backward"),))]


def unavailable(key, contender):
    """None, or why this contender has no entry for the workload."""
    if contender.options and WORKLOADS[key].optimizer == "BertAdam":
        return "the hand-written optimizer has no foreach/fused option"
    return None


# -- one contender, in its own process --------------------------------------------------------------
class Job:
    """A contender's model, optimizer and batch; steps, timed steps, memory and its report."""

    def __init__(self, key, contender, opts):
        warnings.filterwarnings("ignore")
        if GPT2LMHeadModel is not None:
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
    """FSDP2 over one rank: every GPT-2 block, then the root (which holds the tied embedding)."""
    import torch.distributed as dist
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as e:
            raise Skip(f"FSDP2 (fully_shard) not in this torch: {e}") from None
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
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


def max_model_worker(conn, mode_name, layers, opts):
    """One try: build a GPT-2-style model of ``layers`` layers and train 6 steps; fits or out of memory."""
    device = torch.device(opts["device"])
    out = {"layers": layers}
    try:
        warnings.filterwarnings("ignore")
        transformers_logging.set_verbosity_error()
        if device.type == "cpu":
            torch.set_num_threads(1)
            limit = status_kib("VmData") * 1024 + CPU_MEMORY_CAP
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
        if mode_name != "unpatched":
            autopatch.enable("default", mode=mode_name)
        s = shapes(device)
        config = GPT2Config(use_cache=False, n_layer=layers, **s["max_model"])
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT2LMHeadModel(config)
        model.to(device).train()
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = make_optimizer("AdamW", model)
        ids = torch.randint(0, config.vocab_size, (1, s["max_model_seq"]), device=device)
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = token_loss(model(input_ids=ids).logits, ids)
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            out.update(peak=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved())
        else:
            out.update(peak=status_kib("VmHWM") * 1024)
        out.update(fits=True, modes=[(o["mode"], o["reason"]) for o in autopatch.report()["optimizers"]]
                   if mode_name != "unpatched" else None)
    except BaseException as e:
        text = str(e)
        oom = (isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError))
               or any(sign in text for sign in OUT_OF_MEMORY))
        out.update(fits=False, oom=oom, failure=f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
        if not oom:
            out["trace"] = traceback.format_exc()
    conn.send(out)


def count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def measure(ctx, key, contenders, opts):
    """All contenders of one workload, taking turns; per contender its raw figures or why it has none."""
    results, live = {}, {}
    for c in contenders:
        why = unavailable(key, c)
        results[c.name] = {"label": c.label, "status": "n/a", "note": why} if why else {"label": c.label}
        if not why:
            live[c.name] = Worker(ctx, serve, Job, key, c, opts, timeout=opts["timeout"])

    def drop(name, status, note):
        results[name].update(status=status, note=note)
        live.pop(name).close()
        if status == "failed":
            log(f"  {key} / {name} failed:\n{note}")

    def each(fn):
        for name in list(live):
            try:
                fn(name, live[name])
            except WorkerError as e:
                drop(name, "failed", str(e))

    def hello(name, w):
        msg = w.answer()
        if "skip" in msg:
            drop(name, "skipped", msg["skip"])
        else:
            results[name].update(status="ok", hello=msg, rounds=[], peaks=[])

    each(hello)
    each(lambda name, w: results[name].update(warmup=w.ask("warm_up", opts["warmup"])))
    for _, name in turns(live, opts["rounds"]):
        if "unpatched" not in live:
            break
        try:
            turn = live[name].ask("turn", opts["steps"])
        except WorkerError as e:
            drop(name, "failed", str(e))
            continue
        results[name]["rounds"].append(turn["steps"])
        results[name]["peaks"].append(turn["peak"])
    each(lambda name, w: results[name].update(final=w.ask("finish", opts["sync_check"])))
    for w in live.values():
        w.close()
    return results


def check(ctx, key, contenders, opts, tmp):
    """Training-result check of every contender against unpatched; per contender its outcome."""
    path = os.path.join(tmp, f"{key}-reference.pt")
    out = {}

    def run(batch):
        workers = {c.name: Worker(ctx, check_worker, key, c, opts, path, c is UNPATCHED,
                                  timeout=opts["timeout"]) for c in batch}
        for name, w in workers.items():
            try:
                out[name] = w.answer()
            except WorkerError as e:
                out[name] = {"failed": str(e).strip().splitlines()[-1], "trace": str(e)}
            w.close()

    run([UNPATCHED])
    if "equal" not in out["unpatched"] and "modes" not in out["unpatched"]:
        return dict(out, **{c.name: {"failed": "the unpatched reference could not be trained"}
                            for c in contenders if c is not UNPATCHED})
    rest = [c for c in contenders if c is not UNPATCHED and unavailable(key, c) is None]
    for i in range(0, len(rest), opts["parallel_checks"]):
        run(rest[i:i + opts["parallel_checks"]])
    if os.path.exists(path):
        os.remove(path)
    return out


# -- figures and tables -------------------------------------------------------------------------
def figures(results):
    """Per contender measured: medians, ratios against unpatched, peak."""
    ref = results.get("unpatched", {})
    if ref.get("status") != "ok" or not ref.get("rounds"):
        return {}
    out = {}
    for name, r in results.items():
        if r.get("status") != "ok" or not r.get("rounds"):
            continue
        n = min(len(r["rounds"]), len(ref["rounds"]))
        steps = [s for rnd in r["rounds"] for s in rnd]
        ratios = round_ratios(r["rounds"][:n], ref["rounds"][:n], seconds=lambda s: s[0])
        out[name] = {"step_ms": median_ms([s[0] for s in steps]), "opt_ms": median_ms([s[1] for s in steps]),
                     "ratio": statistics.median(ratios), "ratio_q": quartiles(ratios),
                     "peak_mib": max(r["peaks"]) / MiB, "rounds": n}
    for f in out.values():
        f["peak_delta_mib"] = f["peak_mib"] - out["unpatched"]["peak_mib"]
    return out


def ran(r):
    """The mode that ran, from autopatch's report at the end; flagged when it changed after warm-up."""
    final = (r.get("final") or {}).get("modes")
    if final is None:
        return "-"
    text = ", ".join(m for m, _ in final) or "no optimizer seen"
    if final != r.get("warmup", {}).get("modes"):
        text += " (changed after warm-up: warm-up too short)"
    return text


def check_text(name, c):
    if c is None:
        return "-"
    if name == "unpatched" and "failed" not in c:
        return "reference"
    if "skip" in c:
        return "skipped"
    if "failed" in c:
        return f"check failed: {c['failed']}"
    if c["equal"]:
        return "bitwise"
    flag = "NOT bitwise" if name in EXACT_MODES or name == "twin" else "not bitwise"
    if c["max_diff"] == 0:
        return f"{flag}: weights equal, optimizer state differs"
    return f"{flag}: weights differ by up to {c['max_diff']:.2e}"


def table(title, rows_by_key, device, checks=None, sync=True):
    """One Markdown table for the run: a row per workload x contender (a key may name the workload
    and more: 'gpt2-b8-adamw backward')."""
    header = ["workload", "contender", "mode that ran", "step ms", "vs unpatched (IQR)",
              "opt.step() ms", "peak MiB", "peak vs unpatched"]
    header += (["result vs unpatched"] if checks is not None else []) + (["no host sync"] if sync else [])
    rows = []
    for key, results in rows_by_key.items():
        label, f = f"{key}: {describe(key.split()[0], device)}", figures(results)
        for name, r in results.items():
            c = None if checks is None else checks.get(key, {}).get(name)
            extra = ([check_text(name, c)] if checks is not None else [])
            extra += [(r.get("final") or {}).get("sync", "-")] if sync else []
            if name in f:
                x = f[name]
                lo, hi = x["ratio_q"]
                rows.append([label, r["label"], ran(r), f"{x['step_ms']:.2f}", f"{x['ratio']:.3f} ({lo:.2f}-{hi:.2f})",
                             f"{x['opt_ms']:.2f}", f"{x['peak_mib']:.0f}", f"{x['peak_delta_mib']:+.0f}"] + extra)
            else:
                note = r.get("note") or "not measured (the unpatched reference failed)"
                rows.append([label, r["label"], f"{r.get('status', 'n/a')}: {first_line(note)}"]
                            + [""] * 5 + extra)
            label = ""
    return f"## {title}\n\n" + markdown(header, rows)


def notes(rows_by_key, checks=None):
    """What autopatch said each contender ran and why, and why some have no figures: one line per
    distinct statement, with the workloads it holds for."""
    said, broken = {}, []
    for key, results in rows_by_key.items():
        for name, r in results.items():
            for m, why in (r.get("final") or {}).get("modes") or []:
                said.setdefault(f"{name}: {m}: {why}", []).append(key)
            for o in (((r.get("final") or {}).get("report") or {}).get("optimizers") or []):
                if (o.get("route") or {}).get("why", "fusion.exact: bitwise") != "fusion.exact: bitwise":
                    said.setdefault(f"{name}: {route_text(o['route'])}", []).append(key)
            if r.get("status") in ("skipped", "failed"):
                detail = first_line(r["note"]) if r["status"] == "failed" else "; ".join(r["note"].splitlines())
                said.setdefault(f"{name}: {r['status']}: {detail}", []).append(key)
            c = (checks or {}).get(key, {}).get(name)
            if c and c.get("equal") is False and (name in EXACT_MODES or name == "twin"):
                broken.append(f"{key} / {name}")
    every = len(rows_by_key) > 1
    return [f"- {text} ({'every workload' if every and len(keys) == len(rows_by_key) else ', '.join(keys)})"
            for text, keys in said.items()], broken


def route_text(route):
    """The rounding route an optimizer took (policy fast), with the probe's figure and, for a
    compiled one, its compile time (the first run's; later runs reuse Inductor's cache)."""
    text = f"route {route['route']}"
    if route.get("deviation") is not None:
        text += f", probe deviation {route['deviation']:.1e} (bound {route['bound']:.0e})"
    if route.get("graphs") is not None:
        text += f", {route['graphs']} graph(s) compiled in {route.get('compile_seconds', 0):.1f} s"
    return f"{text}: {route['why']}"


def environment(info, args, extra=""):
    dev = info.get("device", "?")
    if args.device == "cuda":
        dev += (f" ({info['capability']}, {info['memory_gib']:.1f} GiB, {info['devices']} visible), "
                f"CUDA {info['cuda']}, cuDNN {info['cudnn']}")
    return "\n".join([
        f"- {time.strftime('%Y-%m-%d %H:%M %Z')}; device: {dev}",
        f"- torch {info['torch']}, python {info['python']}, transformers: {info['transformers']}, "
        f"torchvision: {info['torchvision']}",
        f"- {autopatch_source()}",
        f"- command: `{' '.join(sys.argv)}`",
        f"- {extra}" if extra else ""]).rstrip()


class Output:
    """The run's Markdown and JSON under --out, rewritten whenever a part is done."""

    def __init__(self, out_dir, name):
        self.dir, self.name = Path(out_dir), name
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, text, data):
        (self.dir / f"{self.name}.md").write_text(text + "\n")
        (self.dir / f"{self.name}.json").write_text(json.dumps(data, indent=1, default=str))
        return text


def log(msg):
    print(msg, flush=True)


# -- the runs -----------------------------------------------------------------------------------
def method_line(opts, checked=True):
    return (f"{opts['rounds']} rounds x {opts['steps']} timed steps per contender (each turn after one "
            f"untimed step), warm-up >= {opts['warmup']} steps until autopatch's report holds still"
            + (f"; training-result check over {opts['check_steps']} deterministic steps" if checked else ""))


def run_table(ctx, args, opts, info, tmp):
    keys, contenders = args.keys, [c for c in TABLE if c.name in args.contenders]
    out = Output(args.out, f"table-{args.tag}")
    measured, checks, started = {}, {}, time.perf_counter()
    text = ""
    for key in keys:
        t0 = time.perf_counter()
        checks[key] = check(ctx, key, contenders, opts, tmp)
        log(f"  {key} checked in {time.perf_counter() - t0:.0f} s")
        measured[key] = measure(ctx, key, contenders, opts)
        log(f"  {key} done in {time.perf_counter() - t0:.0f} s (total {time.perf_counter() - started:.0f} s)")
        lines, broken = notes(measured, checks)
        text = "\n\n".join([
            f"# GPU table ({args.device})", environment(info, args, method_line(opts)),
            table("Whole step, optimizer step, peak memory", measured, torch.device(args.device), checks,
                  sync=True),
            "Mode each contender ran and why (autopatch.report()), and contenders left out:\n\n" + "\n".join(lines),
            ("**Not bit-for-bit equal to unpatched: " + ", ".join(broken) + "**") if broken else
            "Every exact contender (multi_layer, backward, forward, auto, the second unpatched process) "
            "that was checked trained bit for bit like unpatched."])
        out.write(text, {"info": info, "opts": opts, "measured": measured, "checks": checks,
                         "figures": {k: figures(v) for k, v in measured.items()}})
    return text, 1 if notes(measured, checks)[1] else 0


def run_chunk_sweep(ctx, args, opts, info, tmp):
    out = Output(args.out, "chunk-sweep")
    measured, text = {}, ""
    for key in SWEEP_WORKLOADS:
        for m in ("multi_layer", "backward"):
            t0 = time.perf_counter()
            contenders = [UNPATCHED] + [fusion_mode(m, f"{m}@{n}MiB", f"{m}, {n} MiB chunks", chunk_bytes=n * MiB)
                                        for n in SWEEP_MIB]
            measured[f"{key} {m}"] = measure(ctx, key, contenders, opts)
            log(f"  {key} / {m} done in {time.perf_counter() - t0:.0f} s")
            text = "\n\n".join([
                f"# Chunk-size sweep ({args.device})", environment(info, args, method_line(opts, checked=False)),
                table(f"multi_layer and backward over chunk sizes {', '.join(f'{n} MiB' for n in SWEEP_MIB)}",
                      measured, torch.device(args.device), sync=False)])
            out.write(text, {"info": info, "opts": opts, "measured": measured,
                             "figures": {k: figures(v) for k, v in measured.items()}})
    return text, 0


def run_fsdp(ctx, args, opts, info, tmp):
    out = Output(args.out, "fsdp")
    key = "gpt2-b8-adamw"
    contenders = [UNPATCHED, Contender("default", "autopatch default policy", "default")]
    measured = {key: measure(ctx, key, contenders, dict(opts, fsdp=True, sync_check=False))}
    text = "\n\n".join([
        f"# FSDP2, one rank ({args.device})", environment(info, args, method_line(opts, checked=False)),
        table("GPT-2 under fully_shard: every parameter a DTensor", measured, torch.device(args.device), sync=False),
        "\n".join(notes(measured)[0])])
    out.write(text, {"info": info, "opts": opts, "measured": measured,
                     "figures": {key: figures(measured[key])}})
    return text, 0


def run_max_model(ctx, args, opts, info, tmp):
    """Per mode, bisect the layer count: the largest that trains 6 steps without running out of memory."""
    out = Output(args.out, "max-model")
    lo, hi = args.max_model_layers
    device = torch.device(args.device)
    if GPT2LMHeadModel is None:
        return out.write(f"# Largest GPT-2-style model: skipped, {TRANSFORMERS}", {}), 0
    found, rows = {}, []
    for m in ("unpatched", "multi_layer", "forward", "backward"):
        t0, tries = time.perf_counter(), {}
        good, bad = lo - 1, hi + 1          # lo - 1 taken to fit and hi + 1 not to, until tried
        stopped = False
        while bad - good > 1 and not stopped:
            layers = (good + bad) // 2
            w = Worker(ctx, max_model_worker, m, layers, opts, timeout=opts["timeout"])
            try:
                r = w.answer()
            except WorkerError as e:
                r = {"layers": layers, "fits": False, "oom": False, "failure": first_line(e)}
            w.close()
            tries[layers] = r
            log(f"  {m} {layers} layers: " + ("fits" if r["fits"] else "out of memory" if r.get("oom")
                                              else f"error: {r['failure']}"))
            stopped = not r["fits"] and not r.get("oom")
            if not stopped:
                good, bad = (layers, bad) if r["fits"] else (good, layers)
        found[m] = tries
        best, first_oom = tries.get(good), tries.get(bad)
        rows.append([m, f"{good} layers, {count(best['params'])} params" if best else f"none in {lo}..{hi}",
                     f"{best['peak'] / GiB:.1f}" + (f" / {best['reserved'] / GiB:.1f}" if "reserved" in best else "")
                     if best else "",
                     "bisection stopped by an error (below)" if stopped else
                     (f"{bad} layers" + (f", {count(first_oom['params'])}" if first_oom.get("params") else "")
                      if first_oom else f"none up to {hi}"),
                     ", ".join(f"{n} {'ok' if t['fits'] else 'OOM' if t.get('oom') else 'error'}"
                               for n, t in tries.items()),
                     ", ".join(x for x, _ in best["modes"]) if best and best.get("modes") else "-"])
        log(f"  {m} done in {time.perf_counter() - t0:.0f} s")
        width = shapes(device)["max_model"]
        cap = ("" if device.type == "cuda" else
               f"; on CPU the data segment is capped at {CPU_MEMORY_CAP // MiB} MiB past start-up")
        text = "\n\n".join([
            f"# Largest GPT-2-style model that trains ({args.device})",
            environment(info, args, f"width {width['n_embd']}, {width['n_head']} heads, AdamW, fp32 weights, "
                                    f"bf16 autocast, batch 1 x {shapes(device)['max_model_seq']}, 6 steps; "
                                    f"bisection over {lo}..{hi} layers, each try in a fresh process{cap}"),
            markdown(["contender", "largest that trains", "peak GiB (allocated / reserved)",
                      "first that did not", "tries", "mode that ran"], rows),
            "\n".join(f"- {m} {n} layers: {t['failure']}" for m, ts in found.items() for n, t in ts.items()
                      if not t["fits"] and not t.get("oom"))])
        out.write(text, {"info": info, "tries": found})
    return text, 0


# -- main -----------------------------------------------------------------------------------------
HARNESS_MODULES = ("alternation", "machine", "memory", "optimizers", "processes", "report", "states", "workloads")


def select_workloads(spec, ap):
    keys = []
    for token in (t for t in spec.split(",") if t):
        match = [k for k in WORKLOADS if k == token or k.startswith(token + "-")]
        if not match:
            ap.error(f"unknown workload {token!r}; choose from {', '.join(WORKLOADS)} "
                     "or a prefix (mobilenet, gpt2, mlp)")
        keys += [k for k in match if k not in keys]
    return keys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; without CUDA the script says so and exits 0) or cpu: small shapes")
    ap.add_argument("--out", help="directory for the Markdown and JSON results (required when there is a GPU "
                                  "or with --device cpu)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x 2 steps, short warm-up and check")
    ap.add_argument("--workloads", default="mobilenet,gpt2,mlp",
                    help="comma-separated workloads or prefixes: " + ", ".join(WORKLOADS))
    ap.add_argument("--contenders", default=",".join(c.name for c in TABLE),
                    help="comma-separated subset of the table's contenders (unpatched is always in)")
    ap.add_argument("--rounds", type=int, help="rounds of turns (default 10, quick 2)")
    ap.add_argument("--steps", type=int, help="timed steps per contender per round (default 8, quick 2)")
    ap.add_argument("--warmup", type=int, help="warm-up steps at least (default 15, quick 6)")
    ap.add_argument("--check-steps", type=int, help="deterministic steps of the training-result check "
                                                    "(default 8, quick 6: past autopatch's 3 watched steps)")
    ap.add_argument("--max-model", action="store_true", help="bisect the largest GPT-2-style model per mode")
    ap.add_argument("--max-model-layers", type=int, nargs=2, default=(1, 48), metavar=("LO", "HI"),
                    help="layer range of the bisection (default 1 48)")
    ap.add_argument("--chunk-sweep", action="store_true", help="multi_layer and backward over chunk sizes")
    ap.add_argument("--fsdp", action="store_true", help="1-rank FSDP2 GPT-2, unpatched vs autopatch default")
    ap.add_argument("--table", action="store_true", help="the main table (the default when no other run is named)")
    args = ap.parse_args()
    args.keys = select_workloads(args.workloads, ap)
    args.contenders = {"unpatched"} | set(args.contenders.split(","))
    unknown = args.contenders - {c.name for c in TABLE}
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(c.name for c in TABLE)}")
    args.tag = "all" if args.workloads == ap.get_default("workloads") else "-".join(
        t for t in args.workloads.split(",") if t)
    if not (args.max_model or args.chunk_sweep or args.fsdp):
        args.table = True

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
              f"nothing to measure. `--device cpu` runs the harness on small shapes.")
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    cuda = args.device == "cuda"
    opts = {"device": args.device,
            "rounds": args.rounds or (2 if args.quick else 10),
            "steps": args.steps or (2 if args.quick else 8),
            "warmup": args.warmup if args.warmup is not None else (6 if args.quick else 15),
            "check_steps": args.check_steps or (6 if args.quick else 8),
            "parallel_checks": 4 if cuda else 2, "sync_check": True,
            "timeout": 300 if cuda else 900}
    ignored = sorted(k for k in os.environ if k.startswith("FUSEDOPT_"))
    for k in ignored:      # every contender names its own policy; nothing from the environment
        del os.environ[k]
    ctx = multiprocessing.get_context("forkserver")
    # Imported once in the fork server, so each contender starts in milliseconds. Named one by one:
    # the server does not import the main script itself.
    ctx.set_forkserver_preload(["torch", "autopatch"] + [f"harness.{m}" for m in HARNESS_MODULES]
                               + ([] if TRANSFORMERS else ["transformers.models.gpt2.modeling_gpt2"])
                               + ([] if TORCHVISION else ["torchvision.models"]))
    started = time.perf_counter()
    w = Worker(ctx, info_worker, args.device, timeout=opts["timeout"])
    info = w.answer()
    w.close()
    log(f"# bench_gpu on {info['device']}, torch {info['torch']} (CUDA {info['cuda']}); {autopatch_source()}"
        + (f"; ignoring {', '.join(ignored)}" if ignored else ""))
    runs = [(flag, fn) for flag, fn in ((args.table, run_table), (args.max_model, run_max_model),
                                        (args.chunk_sweep, run_chunk_sweep), (args.fsdp, run_fsdp)) if flag]
    texts, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for _, fn in runs:
            text, rc = fn(ctx, args, opts, info, tmp)
            texts.append(text)
            status = max(status, rc)
    print("\n\n".join(texts))
    log(f"\nResults in {Path(args.out).resolve()}; total {time.perf_counter() - started:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
