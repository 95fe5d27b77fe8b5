"""What a sample costs, for the load-balanced sampler: ``len`` (its sequence length) or any
function of a sample named as ``module:function``."""

import importlib
import operator

from ..policy import complexity_spec

__all__ = ["sequence_length", "complexity_function"]


def sequence_length(sample):
    """The length of a sample's sequence: a tensor's or array's first dimension, a string's or
    list's length; in a tuple or list whose first item is itself a sequence (``(tokens, label)``),
    that item's; in a dict, ``input_ids``'s or else the first sized value's."""
    if isinstance(sample, dict):
        value = sample.get("input_ids")
        if value is None:
            value = next((v for v in sample.values() if _sized(v)), None)
        if value is None:
            raise TypeError("a dict sample without a sized value has no sequence length")
        return sequence_length(value)
    if isinstance(sample, (tuple, list)) and sample and _sized(sample[0]):
        return sequence_length(sample[0])
    shape = getattr(sample, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    return len(sample)


def _sized(value):
    return hasattr(value, "shape") or (hasattr(value, "__len__") and not isinstance(value, dict))


def complexity_function(spec):
    """``"len"`` -> ``sequence_length``; ``"module:function"`` -> that function; a callable -> itself."""
    complexity_spec(spec)
    if callable(spec):
        return spec
    if spec == "len":
        return sequence_length
    module, _, attr = str(spec).partition(":")
    return operator.attrgetter(attr.strip())(importlib.import_module(module.strip()))
