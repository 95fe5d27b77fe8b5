"""For code written against Bagua: its APIs, on modern PyTorch, backed by autopatch.

- ``fuse_optimizer`` / ``fuse_step`` / ``is_fused_optimizer``: Bagua's generic fused optimizer.
"""

from .fused_optimizer import LEFT_TO_FUSE_STEP, fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "LEFT_TO_FUSE_STEP"]
