"""The GPU runs' figures and Markdown: medians and per-round ratios against unpatched, the mode
each contender ran, the training-result and host-sync checks, and the files under --out."""

import json
import statistics
import sys
import time
from pathlib import Path

from .alternation import median_ms, quartiles, round_ratios
from .gpu_contenders import EXACT_MODES
from .gpu_workloads import MiB, describe
from .machine import autopatch_source
from .report import first_line, markdown


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


def method_line(opts, checked=True):
    return (f"{opts['rounds']} rounds x {opts['steps']} timed steps per contender (each turn after one "
            f"untimed step), warm-up >= {opts['warmup']} steps until autopatch's report holds still"
            + (f"; training-result check over {opts['check_steps']} deterministic steps" if checked else ""))
