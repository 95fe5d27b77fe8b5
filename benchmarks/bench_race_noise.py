"""How often mode auto's race judges a mode faster than ``off`` when none is: its statistics alone,
on simulated step times (no torch work, a few seconds).

Three equal modes (``off``, ``multi_layer``, ``forward``), one timed step each per round, each step
time drawn log-normal with the given noise. For each number of rounds judged, many races' tables
are fitted as the race fits them (``Standings``), and counted: how often ``off`` would be dropped
(the leader faster than it by ``MIN_GAIN`` beyond the measured noise), and the median noise the fit
reads. The race's own one-sided confidence aims at 2.5% per judgement. Run it against another
checkout by putting that checkout first on ``PYTHONPATH``: that is how before and after compare.

    python benchmarks/bench_race_noise.py
"""

import argparse
import math
import random
import statistics

from autopatch.modes.race import MIN_GAIN, Standings

MODES = ("off", "multi_layer", "forward")


def judge(rounds, noise, races, rng):
    """(share of races where off would be dropped, median noise read)."""
    dropped, read = 0, []
    for _ in range(races):
        table = [{m: math.exp(rng.gauss(0, noise)) for m in MODES} for _ in range(rounds)]
        s = Standings(list(MODES), table)
        read.append(s.noise)
        if s.leader != "off" and s.gain(s.leader, "off") - s.h > -math.log(1 - MIN_GAIN):
            dropped += 1
    return dropped / races, statistics.median(read)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--noise", type=float, default=0.2, help="log-normal sigma of one step's time")
    ap.add_argument("--races", type=int, default=1500)
    ap.add_argument("--rounds", default="2,3,4,6,10")
    args = ap.parse_args()
    rng = random.Random(1)
    print(f"noise {args.noise}, {args.races} races per cell\n")
    print("| rounds judged | off dropped wrongly | noise read |\n|---|---|---|")
    for rounds in map(int, args.rounds.split(",")):
        share, read = judge(rounds, args.noise, args.races, rng)
        print(f"| {rounds} | {100 * share:.1f}% | {read:.3f} |")


if __name__ == "__main__":
    main()
