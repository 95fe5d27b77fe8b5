"""What every benchmark prints besides its numbers: the machine, the code under test and the load."""

import os
import platform
import subprocess
import time
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


def summary():
    """One line: when, the CPU, torch and its threads, Python, the autopatch under test, the load."""
    return (f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {os.cpu_count()} x {cpu_model()}; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}; {autopatch_source()}; "
            f"load average {load_average()}")


def closing(started):
    """The end of a run: how long it took since ``started`` (``time.perf_counter()``), and the load."""
    return f"total {time.perf_counter() - started:.0f} s; load average at the end {load_average()}"
