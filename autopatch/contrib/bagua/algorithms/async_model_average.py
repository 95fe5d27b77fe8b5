"""Bagua's ``bagua.torch_api.algorithms.async_model_average``."""

from ...bagua_algorithms import AsyncModelAverageAlgorithm  # noqa: F401
