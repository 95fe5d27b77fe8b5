"""What a sample costs, for the load-balanced sampler: ``len`` (its sequence length), a function of
the program's own named as ``module:function``, or a callable passed from Python.

A policy is data, and may come from someone else, so a name in it is never imported nor called as
it stands: ``os:system`` or ``builtins:eval`` would run on every sample. A named function is only
called when its module is one the program has already imported itself (in ``sys.modules`` when
the sampler is built), is not part of Python's standard library, and defines the function (a
plain Python function whose ``__module__`` is that module, not a builtin or a name it imported
from elsewhere). Anything else is ``UntrustedComplexity`` with the reason. What the name alone
shows (its form, a standard-library module) is ``policy.complexity_spec``'s rule, so that a policy
check refuses it before the run. The explicit way to use any other function is to pass it from
Python: ``autopatch.enable(load_balance=fn)``.
"""

import inspect
import operator
import sys

from ...policy import complexity_spec

__all__ = ["sequence_length", "complexity_function", "UntrustedComplexity"]

class UntrustedComplexity(ValueError):
    """A complexity named by a string that autopatch will not call."""


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
    """``"len"`` -> ``sequence_length``; a callable -> itself; ``"module:function"`` -> that
    function when it may be called (see the module's docstring), else UntrustedComplexity."""
    refused = f"load_balance {spec!r} is not called:"
    try:
        complexity_spec(spec)
    except ValueError as e:
        raise UntrustedComplexity(f"{refused} {e}") from None
    if callable(spec):
        return spec
    if spec == "len":
        return sequence_length
    module_name, _, attr = (part.strip() for part in str(spec).partition(":"))
    module = sys.modules.get(module_name)
    if module is None:
        raise UntrustedComplexity(f"{refused} the program has not imported {module_name!r} (autopatch imports "
                                  "nothing a policy names; import it before building the DataLoader, or pass "
                                  "the function itself: autopatch.enable(load_balance=fn))")
    try:
        fn = operator.attrgetter(attr)(module)
    except AttributeError:
        raise UntrustedComplexity(f"{refused} {module_name!r} has no {attr!r}") from None
    if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
        where = getattr(fn, "__module__", None)
        raise UntrustedComplexity(f"{refused} {attr!r} is not a Python function defined in {module_name!r}"
                                  + (f" (it comes from {where!r})" if where and where != module_name else ""))
    return fn
