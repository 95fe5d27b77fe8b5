"""What every benchmark prints besides its numbers: the machine, the code under test, the load,
and its tables in Markdown (pasted as they are into RESULTS.md)."""

import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

import autopatch


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def autopatch_revision():
    """The commit of the autopatch under test (``git describe``), or '?' outside a checkout."""
    where = Path(autopatch.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return rev or "?"


def autopatch_source():
    """Where the autopatch under test lives, and its commit."""
    return f"autopatch from {Path(autopatch.__file__).resolve().parent.parent} at {autopatch_revision()}"


def load_average(sep=" ", digits=2):
    return sep.join(f"{x:.{digits}f}" for x in os.getloadavg())


def markdown(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


# -- figures from contenders that took turns --------------------------------------------------
def median_ms(values):
    return 1e3 * statistics.median(values)


def round_ratios(mine, theirs, seconds=sum):
    """Per round: this contender's median step over the other's, measured in the same round.
    ``mine`` and ``theirs`` hold one list of step records per round; ``seconds`` reads a record."""
    return [statistics.median(seconds(s) for s in m) / statistics.median(seconds(s) for s in t)
            for m, t in zip(mine, theirs)]


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


# -- same training result? --------------------------------------------------------------------
def _flat_state(state):
    """(name, tensor or value) pairs of a model + optimizer state; model entries first."""
    out = [(f"model.{k}", v) for k, v in state["model"].items()]
    for pid, st in state["optimizer"]["state"].items():
        out += [(f"optimizer.state[{pid}].{k}", v) for k, v in st.items()]
    return out


def compare_states(a, b):
    """(equal bit for bit, largest absolute difference in the model's weights and buffers) of two
    ``{"model": state_dict, "optimizer": state_dict}``; tensors are compared on ``a``'s device."""
    a, b = _flat_state(a), _flat_state(b)
    if [k for k, _ in a] != [k for k, _ in b]:
        raise ValueError("the model or optimizer state has different entries")
    equal, worst = True, 0.0
    for (key, va), (_, vb) in zip(a, b):
        if not isinstance(va, torch.Tensor):
            equal = equal and va == vb
            continue
        vb = vb.to(va.device)
        equal = equal and torch.equal(va, vb)
        if key.startswith("model.") and va.is_floating_point() and va.numel():
            worst = max(worst, (va.double() - vb.double()).abs().max().item())
    return equal, worst
