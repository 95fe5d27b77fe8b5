"""Bagua's ``bagua.torch_api.algorithms.decentralized``."""

from ...bagua_algorithms import DecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithm  # noqa: F401
