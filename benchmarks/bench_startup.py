"""Start-up cost of installing autopatch: `python -c pass` with FUSEDOPT_ENABLE unset.

What is compared: two throw-away virtual environments on the same base interpreter whose
site-packages hold symlinks to every entry of the measured environment's site-packages (default:
the one running this script). "with" links everything; "without" leaves out autopatch's own entries
(autopatch.pth, the package or its editable-install hook, its dist-info). Every other start-up cost
(the other .pth files, the interpreter, the disk) is the same in both, so the difference is exactly
what installing autopatch adds to a program that does not enable it. Measuring the same venv with
the .pth "hidden" any other way (python -S, -I) would also skip the other .pth files and flatter us.

How: rounds alternate with/without (the order flips each round) so drift on a shared machine hits
both; each round runs each side several times and keeps its median. Quoted: the median over rounds
of each side, and the median of the per-round differences. Also quoted, for scale: the .pth line's
own cost executed in-process (timeit), and `FUSEDOPT_ENABLE=1 python -c pass` (imports autopatch,
not torch).

    python benchmarks/bench_startup.py [--rounds 30] [--per-round 5]
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import timeit
from pathlib import Path

from harness.alternation import rotated
from harness.launch import child_env

OURS = re.compile(r"^(_editable_impl_|__editable__\.)?autopatch([-._].*)?$")


def mirror(site, dest, include_ours):
    """A venv in ``dest`` whose site-packages links every entry of ``site`` (autopatch's optional)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    for entry in site.iterdir():
        if OURS.match(entry.name) and not include_ours:
            continue
        link = target / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return python


def time_once(python, env):
    t0 = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                    help="the site-packages holding the installed autopatch")
    args = ap.parse_args()
    pth = args.site / "autopatch.pth"
    if not pth.is_file():
        sys.exit(f"{pth} not found: install autopatch there first")
    env = child_env()
    env.pop("PYTHONPATH", None)

    tmp = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    try:
        sides = {"with": mirror(args.site, tmp / "with", True), "without": mirror(args.site, tmp / "without", False)}
        probe = "import sys; print('autopatch' in sys.modules)"
        for name, python in sides.items():   # warm the disk cache; check the enabled path really differs
            for _ in range(3):
                time_once(python, env)
            on = subprocess.run([str(python), "-c", probe], env=dict(env, FUSEDOPT_ENABLE="1"),
                                capture_output=True, text=True).stdout.strip()
            assert on == ("True" if name == "with" else "False"), (name, on)

        medians = {"with": [], "without": [], "enabled": []}
        for r in range(args.rounds):
            for name in rotated(("with", "without"), r):
                medians[name].append(statistics.median(time_once(sides[name], env) for _ in range(args.per_round)))
            medians["enabled"].append(statistics.median(
                time_once(sides["with"], dict(env, FUSEDOPT_ENABLE="1")) for _ in range(args.per_round)))
        diffs = [a - b for a, b in zip(medians["with"], medians["without"])]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    line = pth.read_text().strip()
    env_backup = os.environ.pop("FUSEDOPT_ENABLE", None)
    try:
        n = 20000
        line_us = min(timeit.repeat(lambda: exec(line, {}), number=n, repeat=5)) / n * 1e6
    finally:
        if env_backup is not None:
            os.environ["FUSEDOPT_ENABLE"] = env_backup

    ms = lambda xs: f"{1e3 * statistics.median(xs):.2f} ms"
    print(f"python -c pass, FUSEDOPT_ENABLE unset, {args.rounds} rounds x {args.per_round} runs, medians:")
    print(f"  without autopatch installed: {ms(medians['without'])}")
    print(f"  with autopatch installed:    {ms(medians['with'])}")
    print(f"  added by autopatch (median of paired differences): {ms(diffs)}"
          f"  [spread of differences: {1e3 * min(diffs):+.2f} .. {1e3 * max(diffs):+.2f} ms]")
    print(f"  the .pth line itself, exec'd in-process: {line_us:.2f} us")
    print(f"FUSEDOPT_ENABLE=1 python -c pass (autopatch imported and enabled, torch not): {ms(medians['enabled'])}")


if __name__ == "__main__":
    main()
