"""Bagua's ``bagua.torch_api.algorithms.bytegrad``."""

from ...bagua_algorithms import ByteGradAlgorithm  # noqa: F401
