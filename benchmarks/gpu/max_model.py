"""``bench_gpu.py --max-model``: per mode, the largest GPT-2-style model (by layer count) that
trains without running out of memory, bisected, each try in a fresh process."""

import resource
import time
import traceback
import warnings

import torch

import autopatch
from harness.gpu_report import Output, environment
from harness.gpu_workloads import (GiB, MiB, TRANSFORMERS, GPT2Config, GPT2LMHeadModel, make_optimizer, shapes,
                                   transformers_logging)
from harness.memory import status_kib
from harness.processes import Worker, WorkerError
from harness.report import first_line, log, markdown
from harness.workloads import token_loss

CPU_MEMORY_CAP = 96 * MiB   # --max-model on CPU: the data segment may grow this much past start-up
# How running out of memory reads when it does not raise torch's OutOfMemoryError or MemoryError.
OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "bad_alloc", "CUBLAS_STATUS_ALLOC_FAILED")


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
