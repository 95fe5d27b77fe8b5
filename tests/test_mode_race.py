"""Mode auto's measuring schedule: every candidate gets the same windows in rotating order within
the budget, and a decision waits for timings that complete late (as CUDA events do) without
ever exceeding the budget."""

import time

import pytest

from autopatch.modes.race import SETTLE, ModeRace, WallClock

MODES = ["off", "multi_layer", "backward", "forward"]


class LateClock(WallClock):
    """Marks whose timing is known only ``lag`` steps later, like CUDA events on a device that
    runs that far behind the host."""

    def __init__(self, lag, grace):
        self.lag, self.grace, self.step = lag, grace, 0

    def mark(self):
        return (self.step, time.perf_counter())

    def seconds(self, start, end):
        return None if self.step < end[0] + self.lag else end[1] - start[1]


def walk(race, limit=10_000):
    """Step boundaries until the race decides; returns the mode run at each step."""
    modes = [race.mode]
    while race.result is None:
        race.clock.step = getattr(race.clock, "step", 0) + 1
        modes.append(race.boundary())
        assert len(modes) < limit
    return modes


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("budget", [16, 50, 200])
def test_schedule_gives_each_mode_the_same_windows_within_the_budget(n, budget):
    race = ModeRace(MODES[:n], budget, WallClock())
    ran = walk(race)
    assert race.result["steps"] == len(ran) - 1 <= budget
    windows = [(rnd, mode) for rnd, mode, _, _ in race.windows]
    assert sorted(windows) == sorted((r, m) for r in range(race.rounds) for m in MODES[:n])
    firsts = [race.schedule[r * n] for r in range(race.rounds)]
    assert firsts == [MODES[r % n] for r in range(race.rounds)]          # the order rotates
    assert all(ran.count(m) == race.rounds * (SETTLE + race.window) for m in MODES[:n] if m != ran[-1])
    assert race.result["rounds"] == race.rounds and set(race.result["ms_per_step"]) == set(MODES[:n])


def test_a_decision_waits_for_late_timings():
    race = ModeRace(MODES, 100, LateClock(lag=3, grace=4))
    walk(race)
    scheduled = race.rounds * len(MODES) * (SETTLE + race.window)
    assert scheduled <= 100 - 4
    assert race.result["steps"] == scheduled + 3             # waited for the last window's timing
    assert race.result["rounds"] == race.rounds


def test_timings_that_never_arrive_in_time_cost_no_more_than_the_budget():
    race = ModeRace(MODES, 100, LateClock(lag=50, grace=4))
    walk(race)
    assert race.result["steps"] == 100
    assert race.result["rounds"] < race.rounds               # only the rounds whose timings came
