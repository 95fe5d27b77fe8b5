"""torch.distributed's process groups: background averaging stops before its group is destroyed.

Targets: ``destroy_process_group`` of ``torch.distributed`` and of ``distributed_c10d`` (wrapped,
where each module defines it). Internals: none.
"""

from .ledger import Patch


class ProcessGroupPatch(Patch):
    target = "process_group"

    def __init__(self, before_destroy):
        """``before_destroy(group)``: called first (``group`` None: every group)."""
        self._before_destroy = before_destroy

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        section = self._open()
        for module in (dist, c10d):
            if "destroy_process_group" in vars(module):
                section.wrap(module, "destroy_process_group", self._destroying)

    def _destroying(self, wrapped, instance, args, kwargs):
        self._before_destroy(args[0] if args else kwargs.get("group"))
        return wrapped(*args, **kwargs)
