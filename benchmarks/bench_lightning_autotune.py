"""Autotune on a Lightning fit that clips gradients: how many trials fit in 150 steps, and the
weights against the same fit unpatched.

Lightning always steps with a closure and the Trainer clips, so the search may offer only
``off`` and ``multi_layer`` (with chunk sizes). The fit is an MLP with AdamW and a per-step StepLR,
run twice in fresh processes, unpatched and with ``FUSEDOPT_ENABLE=1 FUSEDOPT_POLICY=autotune
FUSEDOPT_AUTOTUNE_TRIAL_SECONDS=0.3 FUSEDOPT_AUTOTUNE_WARMUP_SECONDS=0``; trials are time-based,
so their number depends on the machine's step time.

    python benchmarks/bench_lightning_autotune.py          # about 30 s
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.launch import child_env

STEPS = 150
AUTOTUNE_ENV = {"FUSEDOPT_ENABLE": "1", "FUSEDOPT_POLICY": "autotune",
                "FUSEDOPT_AUTOTUNE_TRIAL_SECONDS": "0.3", "FUSEDOPT_AUTOTUNE_WARMUP_SECONDS": "0"}


def fit(weights_path):
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 4))

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    module = Module()
    x, y = torch.randn(STEPS * 16, 64), torch.randint(0, 4, (STEPS * 16,))
    L.Trainer(max_steps=STEPS, gradient_clip_val=0.5, accelerator="cpu", devices=1, enable_progress_bar=False,
              logger=False, enable_checkpointing=False, enable_model_summary=False
              ).fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    torch.save(module.state_dict(), weights_path)


def run(tmp, name, env):
    weights, report = os.path.join(tmp, f"{name}.pt"), os.path.join(tmp, f"{name}.json")
    env = child_env(**env)
    if env.get("FUSEDOPT_ENABLE"):
        env["FUSEDOPT_REPORT"] = report
    subprocess.run([sys.executable, __file__, "--fit", weights], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return weights, report


def main():
    if sys.argv[1:2] == ["--fit"]:
        return fit(sys.argv[2])
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        ref, _ = run(tmp, "unpatched", {})
        got, report = run(tmp, "autotune", AUTOTUNE_ENV)
        a, b = torch.load(ref), torch.load(got)
        equal = all(torch.equal(a[k], b[k]) for k in a)
        tune = json.loads(Path(report).read_text())["autotune"]
    trials = tune.get("trials", [])
    print(f"autotune on a clipping Lightning fit, {STEPS} steps: {len(trials)} trials "
          f"({', '.join(str(t['config']) for t in trials)}); modes left out: "
          f"{sorted(tune.get('ruled_out_modes', {}))}; weights bit-for-bit equal to unpatched: {equal}")
    print(f"target >= 3 trials and equal weights: {'MET' if len(trials) >= 3 and equal else 'NOT MET'}")


if __name__ == "__main__":
    main()
