"""Bagua's ``bagua.torch_api.algorithms.gradient_allreduce``."""

from ...bagua_algorithms import GradientAllReduceAlgorithm  # noqa: F401
