"""How a trial is scored: training throughput, the median over several windows.

Throughput is samples/s when the batch size is known (the policy's ``autotune.batch_size``, or the
one batch size of the DataLoaders alive when the search starts), else iterations/s. Either way
trials within one run compare fairly. The median resists a noisy neighbour slowing one window.
"""

import sys

from ..live_objects import live_instances


def detect_batch_size():
    """The batch size shared by every live DataLoader, or None when unknown or ambiguous."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return None
    sizes = {o.batch_size for o in live_instances(data.DataLoader)}
    if len(sizes) == 1:
        size = sizes.pop()
        return size if isinstance(size, int) else None
    return None


def unit(samples_per_step):
    return "samples/s" if samples_per_step else "steps/s"


def rate(window, samples_per_step):
    return window.steps * (samples_per_step or 1) / window.seconds
