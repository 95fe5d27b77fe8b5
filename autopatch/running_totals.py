"""Running totals of the seconds each training iteration is split by, kept where they are spent.

The step timer and the breakdown's phase clock read these several times an iteration; as plain
attributes of one object each read is an attribute load, where asking every room for its figure
(each optimizer's step time, the gradient sync's waits, the loader's) was a chain of calls on
every iteration of every enabled run. Each figure only grows and readers take differences, so
the totals are process-wide: sessions come and go, the totals go on.

- ``optimizer``: seconds inside the user's ``step()`` calls (modes/interception.py);
- ``choosing``: of those, autopatch choosing, probing and switching modes (modes/controller.py);
- ``comm``: waits on gradient communication (comm/waiting.py);
- ``data``: waits inside DataLoader iterators' ``__next__`` (data/zero_code/loader_waits.py).

Several threads may add at once (a communication algorithm's background thread): an addition
lost to a race costs a figure of the report a few microseconds, never training.
"""


class RunningTotals:
    __slots__ = ("optimizer", "choosing", "comm", "data")

    def __init__(self):
        self.optimizer = self.choosing = self.comm = self.data = 0.0


TOTALS = RunningTotals()
