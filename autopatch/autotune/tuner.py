"""Bayesian optimisation over a Space with bayes_opt's ask/tell interface (suggest/register).

As in Horovod's autotuner the acquisition is expected improvement. A proposal that rounds to a
config already measured (integer and categorical knobs make that common) is replaced by a random
unmeasured one, so every trial teaches something; the tuner is done when none is left.
The Gaussian process runs on one BLAS thread: idle BLAS threads spin for a while after use and
would slow the training they share the cores with, skewing the very trial being measured.
"""

import random
import warnings

from bayes_opt import BayesianOptimization, acquisition
from threadpoolctl import threadpool_limits   # scikit-learn's, which bayes_opt needs

RANDOM_FIRST = 2     # random trials after the starting config, before the Gaussian process leads
XI = 0.01            # expected-improvement margin: small, throughput differences are small


class BayesTuner:
    def __init__(self, space, seed=0):
        self.space = space
        self.scores = {}            # space.key(config) -> score
        self.excluded = set()       # keys of configs that can no longer run in this run
        self._rng = random.Random(seed)
        self._bo = None
        self._registered = 0
        if space.searched:
            with warnings.catch_warnings():   # integer and categorical bounds are "experimental"
                warnings.simplefilter("ignore", UserWarning)
                self._bo = BayesianOptimization(
                    f=None, pbounds=space.pbounds(), random_state=seed, verbose=0,
                    acquisition_function=acquisition.ExpectedImprovement(xi=XI),
                    allow_duplicate_points=True)

    def suggest(self):
        """The next config to measure, or None when every config has been measured."""
        unseen = [c for c in self.space.grid() if self.space.key(c) not in self.scores
                  and self.space.key(c) not in self.excluded]
        if not unseen:
            return None
        if self._bo is None or self._registered < 1 + RANDOM_FIRST:
            return self._rng.choice(unseen)
        with threadpool_limits(limits=1):
            config = self.space.decode(self._bo.suggest())
        if self.space.key(config) in self.scores or self.space.key(config) in self.excluded:
            return self._rng.choice(unseen)
        return config

    def exclude(self, knob, values):
        """Never propose a config whose ``knob`` is one of ``values`` again (a mode found unsafe)."""
        self.excluded.update(self.space.key(c) for c in self.space.grid() if c.get(knob) in values)

    def register(self, config, score):
        self.scores[self.space.key(config)] = score
        if self._bo is not None and self.space.contains(config):
            self._bo.register(params=self.space.encode(config), target=score)
            self._registered += 1
