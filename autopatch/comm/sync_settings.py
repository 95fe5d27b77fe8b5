"""What autopatch's allreduce runs with: one frozen record, replaced whole when a knob changes.

A model's allreduce swaps a new record in at its next synchronised backward, so a step never sees
half of a change (the bucket size of one setting with the compression of another).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncSettings:
    bucket_bytes: int
    compression: str = "none"
    hierarchical: bool = False
