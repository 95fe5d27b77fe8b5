"""A short autotune search on a small model: trials of about 20 steps, a few seconds in all."""

import torch

from training import batches, mlp, train

FAST = {"warmup_steps": 3, "trial_seconds": 0.02, "windows": 3, "max_samples": 6,
        "bounds": {"chunk_size_2p": [10, 14]}}
FAST_YAML = """
version: 1
autotune:
  enabled: true
  knobs: [mode, chunk_size_2p]
  warmup_steps: 3
  trial_seconds: 0.02
  windows: 3
  max_samples: 6
  bounds: {chunk_size_2p: [10, 14]}
"""


def job(steps=None, until_frozen=None, limit=5000, after=20):
    """Train ``steps`` steps, or (autotuned) until ``after`` steps past the freeze: trials last
    seconds, so how many steps a search takes depends on the machine's speed. The optimizer is
    dropped on return, as a script's ``train(model)`` drops it."""
    torch.manual_seed(0)
    model = mlp(width=32, depth=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, frozen_at = [], None
    for i, batch in enumerate(batches(steps or limit, width=32, batch=16)):
        losses += train(model, opt, [batch])
        if until_frozen and frozen_at is None and i % 10 == 0 and until_frozen.report()["autotune"]["phase"] == "frozen":
            frozen_at = i
        if frozen_at is not None and i == frozen_at + after:
            break
    return model, losses
