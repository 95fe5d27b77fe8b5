"""``bench_gpu.py --fsdp``: GPT-2 under FSDP2 (``fully_shard``, one rank), unpatched against
autopatch's default policy, whole step. ``bench_fsdp.py --gpu`` times the optimizer step alone on
the same model, sharded by the same code (``harness.fsdp``)."""

import torch

from harness.gpu_contenders import UNPATCHED, Contender
from harness.gpu_report import Output, environment, figures, method_line, notes, table
from harness.gpu_runs import measure


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
