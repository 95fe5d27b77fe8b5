"""Bagua's ``bagua.torch_api.algorithms.q_adam``."""

from ...bagua_algorithms import QAdamAlgorithm, QAdamOptimizer  # noqa: F401
