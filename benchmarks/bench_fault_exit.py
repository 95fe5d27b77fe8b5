"""How long a torchrun job takes to end after a fault, plain DDP against each communication algorithm.

Each job is ``tests/support/fault_job.py`` under ``python -m torch.distributed.run --nproc_per_node 2``
(c10d rendezvous on 127.0.0.1; ``tests/support/torchrun_job.py`` starts it): rank 1 raises, or is
SIGKILLed, at step 20 of 500, or torchrun gets SIGTERM (the script's handler runs) or SIGINT at
step 20 of a run that would not end by itself. Quoted: seconds from the fault (the rank's own clock
just before it, or the moment the signal was sent) to torchrun's exit, the median over the rounds;
contenders alternate within a round, one job at a time, the first of each round rotating.

    python benchmarks/bench_fault_exit.py --rounds 3
"""

import argparse
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from torchrun_job import CONTENDERS, run_all  # noqa: E402

CASES = {"raise": dict(fault="raise", fault_rank=1, fault_step=20, steps=500),
         "SIGKILL": dict(fault="kill", fault_rank=1, fault_step=20, steps=500),
         "SIGTERM": dict(fault="ready", fault_step=20, steps=100_000, signal_to_send=signal.SIGTERM, FAULT_HANDLER=1),
         "SIGINT": dict(fault="ready", fault_step=20, steps=100_000, signal_to_send=signal.SIGINT)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = {(c, case): [] for c in CONTENDERS for case in CASES}
    root = Path(tempfile.mkdtemp(prefix="fault_exit_"))
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
        for case, kw in CASES.items():
            for c in order:
                job = run_all({0: (c, root / f"{r}-{case}-{c}", kw)}, at_once=1)[0]
                assert job.returncode != 0 and not job.orphans and not job.leftovers, (c, case, job.log[-2000:])
                seconds[c, case].append(job.after_fault)
    print("| contender | " + " | ".join(CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    for c in CONTENDERS:
        print(f"| {c} | " + " | ".join(f"{statistics.median(seconds[c, case]):.1f}" for case in CASES) + " |")


if __name__ == "__main__":
    main()
