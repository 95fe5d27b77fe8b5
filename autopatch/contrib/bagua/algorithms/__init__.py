"""Bagua's ``bagua.torch_api.algorithms``: one module per algorithm, as Bagua's scripts import them
(``from bagua.torch_api.algorithms import gradient_allreduce``)."""

from . import async_model_average, bytegrad, decentralized, gradient_allreduce, q_adam  # noqa: F401

__all__ = ["async_model_average", "bytegrad", "decentralized", "gradient_allreduce", "q_adam"]
