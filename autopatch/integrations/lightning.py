"""Lightning: ``Trainer(callbacks=[AutopatchCallback()])`` fits with autopatch enabled.

Works with the ``lightning`` package and, when only that is installed, ``pytorch_lightning``.
"""

try:
    from lightning.pytorch import Callback
except ImportError:
    from pytorch_lightning import Callback

from . import FitSession

__all__ = ["AutopatchCallback"]

FIT = "fit"


class AutopatchCallback(Callback):
    """Enable autopatch for ``Trainer.fit`` and disable it after, also when the fit raises.

    ``policy`` and ``overrides`` are those of ``autopatch.enable()``. It switches on in
    ``setup``, before Lightning builds the optimizers, rather than in ``on_fit_start``: by then
    each optimizer has a ``LightningOptimizer`` twin sharing its state and step hooks, which
    adopting live optimizers would take for a second optimizer.
    """

    def __init__(self, policy=None, **overrides):
        super().__init__()
        self.session = FitSession(policy, overrides)

    def setup(self, trainer, pl_module, stage):
        if stage == FIT:
            self.session.start()

    def teardown(self, trainer, pl_module, stage):
        if stage == FIT:
            self.session.stop()

    def on_exception(self, trainer, pl_module, exception):
        self.session.stop()
