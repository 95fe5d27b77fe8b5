"""Hugging Face: ``Trainer(..., callbacks=[AutopatchCallback()])`` trains with autopatch enabled."""

from transformers import TrainerCallback

from . import FitSession

__all__ = ["AutopatchCallback"]


class AutopatchCallback(TrainerCallback):
    """Enable autopatch for ``Trainer.train()`` and disable it after.

    ``policy`` and ``overrides`` are those of ``autopatch.enable()``. The Trainer builds its
    optimizer before ``on_train_begin``; ``enable()`` adopts optimizers that already exist, so
    it is fused all the same. transformers has no callback for a failed ``train()``: then
    autopatch stays on until ``autopatch.disable()`` or the end of this callback's next
    ``train()``.
    """

    def __init__(self, policy=None, **overrides):
        self.session = FitSession(policy, overrides)

    def on_train_begin(self, args, state, control, **kwargs):
        self.session.start()

    def on_train_end(self, args, state, control, **kwargs):
        self.session.stop()
