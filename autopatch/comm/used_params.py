"""DDP's rule for parameters a backward leaves without a gradient: which were used since the last
synchronised backward on this rank, and (with ``find_unused_parameters``) on any rank, from every
rank's bitmap summed by one allreduce."""

import torch
import torch.distributed as dist


class UsedParameters:
    """Per parameter: has it received a gradient since the last synchronised backward."""

    def __init__(self, count, group, device):
        self.count, self.group, self.device = count, group, device
        self.reset()

    def reset(self):
        self.flags = [False] * self.count

    def mark(self, i):
        self.flags[i] = True

    def __getitem__(self, i):
        return self.flags[i]

    def launch_sum(self):
        """Every rank's bitmap summed, launched without waiting: (counts, work)."""
        counts = torch.tensor(self.flags, dtype=torch.int32, device=self.device)
        return counts, dist.all_reduce(counts, group=self.group, async_op=True)


def on_any_rank(launched, waiter):
    """Per parameter: did any rank use it, from ``launch_sum``'s result (None when nothing was
    launched: every parameter counts as used)."""
    if launched is None:
        return None
    counts, work = launched
    waiter.wait(work, "the unused-parameter bitmap")
    return [c > 0 for c in counts.tolist()]
