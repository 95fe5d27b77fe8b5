"""torch.autograd.backward: where each iteration's backward begins and ends, for the breakdown.

Target: ``torch.autograd.backward`` (``loss.backward()`` calls it), replaced by a plain function
(no module hook is needed, so module calls keep torch's hook-free path). Internals: none.
"""

import sys

from .ledger import Patch


class AutogradBackwardPatch(Patch):
    target = "autograd"

    def install(self, timed):
        """``timed(backward)`` returns the function that stands in for ``backward``; call once
        torch is imported."""
        if self.installed:
            return
        autograd = sys.modules["torch.autograd"]
        self._open().replace(autograd, "backward", timed(vars(autograd)["backward"]))
