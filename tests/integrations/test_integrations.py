"""Lightning and Hugging Face callbacks, end to end with the real frameworks on CPU: the fit
with the callback ends with the same weights as without, its optimizer was fused, and autopatch
is off again afterwards."""

import subprocess
import sys

import lightning.pytorch as L
import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autopatch
from autopatch.integrations.huggingface import AutopatchCallback as HFCallback
from autopatch.integrations.lightning import AutopatchCallback as LightningCallback
from training import assert_same, batches, mlp, weights

STEPS = 6


def the_optimizer(report):
    (entry,) = [o for o in report["optimizers"] if o["steps"]]
    return entry


class TinyModule(L.LightningModule):
    def __init__(self, fail_at=None, optimizer_first=False):
        super().__init__()
        self.net = mlp()
        self.fail_at = fail_at
        # An optimizer that exists before the fit (and the callback's enable()) starts.
        self.early = torch.optim.AdamW(self.parameters(), lr=1e-2) if optimizer_first else None

    def training_step(self, batch, index):
        if index == self.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = self.early or torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


def lightning_fit(module, callbacks):
    xs, ys = zip(*batches(STEPS))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=callbacks,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    return weights(module)


@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize("chunk_bytes", ["auto", 4096])
def test_lightning_fit_with_the_callback_equals_without(ap, optimizer_first, chunk_bytes):
    ref = lightning_fit(TinyModule(), [])
    got = lightning_fit(TinyModule(optimizer_first=optimizer_first),
                        [LightningCallback(mode="multi_layer", chunk_bytes=chunk_bytes)])
    assert_same(got, ref)
    assert not ap.is_enabled()
    entry = the_optimizer(ap.report())
    assert entry["class"] == "torch.optim.adamw.AdamW" and entry["mode"] == "multi_layer", entry
    assert entry["steps"] == STEPS and entry["fusion"]["fused_steps"] == STEPS


class ClippedModule(TinyModule):
    """AdamW with a per-step StepLR; the Trainer clips gradients, so it steps with a closure."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def clipped_fit(callbacks, steps=150):
    xs, ys = zip(*batches(steps, batch=16))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16)
    module = ClippedModule()
    L.Trainer(max_steps=steps, gradient_clip_val=0.5, accelerator="cpu", devices=1, callbacks=callbacks,
              enable_progress_bar=False, logger=False, enable_checkpointing=False,
              enable_model_summary=False).fit(module, loader)
    return weights(module)


def test_autotune_on_a_lightning_fit_with_clipping_equals_without(ap):
    """Lightning steps with a closure and the Trainer clips: the watch rules out backward and
    forward, so the search never proposes them, and the fit ends as it does unpatched."""
    pytest.importorskip("bayes_opt")
    ref = clipped_fit([])
    got = clipped_fit([LightningCallback(policy="autotune", autotune={
        "warmup_steps": 10, "warmup_seconds": 0.0, "trial_seconds": 0.02, "windows": 3, "max_samples": 6})])
    assert_same(got, ref)
    tune = ap.report()["autotune"]
    assert len(tune["trials"]) >= 3, tune
    assert {t["config"]["mode"] for t in tune["trials"]} <= {"off", "multi_layer"}
    assert set(tune["ruled_out_modes"]) == {"backward", "forward"}
    assert "closure-based step()" in tune["ruled_out_modes"]["backward"]


def test_lightning_fit_that_raises_still_disables(ap):
    with pytest.raises(RuntimeError, match="boom"):
        lightning_fit(TinyModule(fail_at=3), [LightningCallback()])
    assert not ap.is_enabled()


def test_callback_keeps_an_outer_session_on(ap):
    ap.enable(mode="multi_layer")
    policy = ap.report()["policy"]
    with pytest.warns(RuntimeWarning, match="already enabled"):
        lightning_fit(TinyModule(), [LightningCallback(policy="safe")])
    assert ap.is_enabled() and ap.report()["policy"] == policy


def test_a_bad_policy_fails_when_the_callback_is_built():
    with pytest.raises(autopatch.PolicyError):
        LightningCallback(policy="no-such-policy")
    with pytest.raises(autopatch.PolicyError):
        HFCallback(chunk_bytes="huge")


class TinyHF(nn.Module):
    """A plain torch model with the Trainer's calling convention: no download, no config."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def hf_train(tmp_path, callbacks):
    model = TinyHF()
    data = [{"x": x[i], "labels": y[i]} for x, y in batches(STEPS) for i in range(len(y))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=2, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        optim="adamw_torch")     # not "adamw_torch_fused": torch's fused kernel stays per tensor under bitwise
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return weights(model)


def test_huggingface_trainer_with_the_callback_equals_without(ap, tmp_path):
    ref = hf_train(tmp_path, [])
    got = hf_train(tmp_path, [HFCallback(mode="multi_layer", chunk_bytes=4096)])
    assert_same(got, ref)
    assert not ap.is_enabled()
    entry = the_optimizer(ap.report())
    assert entry["class"] == "torch.optim.adamw.AdamW" and entry["mode"] == "multi_layer", entry
    assert entry["steps"] == STEPS and entry["fusion"]["fused_steps"] == STEPS


def test_lightning_callback_with_only_pytorch_lightning_installed(monkeypatch):
    import importlib

    import pytorch_lightning
    for name in ("lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)   # as if not installed
    monkeypatch.delitem(sys.modules, "autopatch.integrations.lightning")
    module = importlib.import_module("autopatch.integrations.lightning")
    assert issubclass(module.AutopatchCallback, pytorch_lightning.Callback)


def test_importing_autopatch_imports_no_framework():
    code = ("import sys, autopatch, autopatch.contrib, autopatch.integrations; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_reachable_as_attributes_of_the_package_after_import_autopatch():
    """``autopatch.integrations.lightning.AutopatchCallback`` after a bare ``import autopatch``,
    in a fresh interpreter; no framework is imported before its module is reached."""
    code = """if True:
        import sys
        import autopatch
        frameworks = lambda: [m for m in ("lightning", "transformers") if m in sys.modules]
        assert "torch" not in sys.modules and frameworks() == []
        session = autopatch.integrations.FitSession
        assert frameworks() == []
        from lightning.pytorch import Callback
        assert issubclass(autopatch.integrations.lightning.AutopatchCallback, Callback)
        from transformers import TrainerCallback
        assert issubclass(autopatch.integrations.huggingface.AutopatchCallback, TrainerCallback)
        try:
            autopatch.integrations.keras
        except AttributeError as e:
            print(e)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'autopatch.integrations' has no attribute 'keras'"


def test_enable_after_lightning_wrapped_the_optimizer_adopts_it_once():
    """LightningOptimizer copies the optimizer's __dict__ (hook dicts included): enable() must
    adopt the wrapped optimizer only, or every step would be hooked twice."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    def go(patched):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        wrapper = LightningOptimizer(opt)   # alive while enable() scans for optimizers
        if patched:
            autopatch.enable(mode="multi_layer")
        try:
            for x, y in batches(3):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            rep = autopatch.report()
            del wrapper
        finally:
            autopatch.disable()
        return weights(model), rep
    ref, (got, rep) = go(False)[0], go(True)
    assert_same(ref, got)
    assert [o["class"] for o in rep["optimizers"] if o["steps"]] == ["torch.optim.adamw.AdamW"]
