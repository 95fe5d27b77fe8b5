"""Autotune: Bayesian search over autopatch's knobs while the job trains, then the best frozen.

``space`` (which knobs, their bounds and encoding), ``tuner`` (bayes_opt ask/tell), ``knobs``
(reading and switching them in the run through the session), ``score`` (throughput of a trial),
``trials_log`` (CSV and best-config JSON), ``scheduler`` (the phases on the step clock). Rank 0
decides for every rank (autopatch/agreement.py).
"""

from .scheduler import Autotuner

__all__ = ["Autotuner"]
