"""The search space: the knobs that apply to this run, their bounds and their bayes_opt encoding.

A config is a plain dict, knob -> value. Exponent knobs (``tunables.py``) are integers (bytes = 2**value);
the others are categorical and go to bayes_opt as its own categorical parameters, which it one-hot
encodes for the Gaussian process, so no order is invented between, say, ``off`` and ``forward``.
Categories are passed as strings: bayes_opt would read a pair of booleans as a float interval.
A knob with a single choice is not searched but still applied.
"""

import itertools

from ..tunables import KNOBS
from ..vocabulary import OFF


def is_exponent(knob):
    return KNOBS[knob].exponent


class Space:
    def __init__(self, bounds):
        """``bounds``: knob -> (lo, hi) for exponents, else the tuple of choices; order is kept."""
        self.bounds = dict(bounds)
        self.fixed = {}
        self.searched = {}
        for knob, b in self.bounds.items():
            choices = range(b[0], b[1] + 1) if is_exponent(knob) else b
            if len(choices) == 1:
                self.fixed[knob] = choices[0]
            else:
                self.searched[knob] = b

    @property
    def names(self):
        return list(self.bounds)

    def pbounds(self):
        return {k: (b[0], b[1], int) if is_exponent(k) else [str(c) for c in b]
                for k, b in self.searched.items()}

    def encode(self, config):
        return {k: config[k] if is_exponent(k) else str(config[k]) for k in self.searched}

    def decode(self, params):
        config = dict(self.fixed)
        for k, b in self.searched.items():
            v = params[k]
            config[k] = int(round(float(v))) if is_exponent(k) else next(c for c in b if str(c) == v)
        return {k: config[k] for k in self.bounds}

    def contains(self, config):
        for k, b in self.bounds.items():
            v = config.get(k)
            if is_exponent(k):
                if not (isinstance(v, int) and b[0] <= v <= b[1]):
                    return False
            elif v not in b:
                return False
        return True

    def key(self, config):
        """What makes two configs different runs: the chunk size means nothing unfused."""
        return tuple((k, v) for k, v in config.items()
                     if not (k == "chunk_size_2p" and config.get("mode") == OFF))

    def grid(self):
        """Every distinct config, in a fixed order (the exhaustive baseline, and the fallback
        when bayes_opt proposes a config already measured)."""
        axes = [range(b[0], b[1] + 1) if is_exponent(k) else b for k, b in self.bounds.items()]
        seen, out = set(), []
        for values in itertools.product(*axes):
            config = dict(zip(self.bounds, values))
            if self.key(config) not in seen:
                seen.add(self.key(config))
                out.append(config)
        return out
