"""The GPU table's workloads (MobileNetV2, GPT-2, a 400-tensor MLP) and their optimizers, at the
real shapes on CUDA and at small ones on CPU, where ``--device cpu`` exercises the harness."""

from dataclasses import dataclass

import torch
from torch import nn

from .optimizers import BertAdam
from .processes import Skip
from .workloads import mobilenet_v2 as in_repo_mobilenet_v2
from .workloads import square_loss, token_loss

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging
    TRANSFORMERS = None
except ImportError as e:
    GPT2Config = GPT2LMHeadModel = transformers_logging = None
    TRANSFORMERS = f"transformers not importable: {e}"
try:
    from torchvision.models import mobilenet_v2 as torchvision_mobilenet_v2
    TORCHVISION = None
except Exception as e:   # absent, or built for another torch (then it fails with other errors)
    torchvision_mobilenet_v2 = None
    TORCHVISION = f"torchvision not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Workload:
    model: str        # mobilenet | gpt2 | mlp
    batch: int        # on CUDA; --device cpu divides it by 8
    optimizer: str    # SGD | AdamW | BertAdam


WORKLOADS = {
    "mobilenet-b32-sgd": Workload("mobilenet", 32, "SGD"),
    "mobilenet-b32-adamw": Workload("mobilenet", 32, "AdamW"),
    "mobilenet-b96-sgd": Workload("mobilenet", 96, "SGD"),
    "mobilenet-b96-adamw": Workload("mobilenet", 96, "AdamW"),
    "gpt2-b1-adamw": Workload("gpt2", 1, "AdamW"),
    "gpt2-b1-bertadam": Workload("gpt2", 1, "BertAdam"),
    "gpt2-b8-adamw": Workload("gpt2", 8, "AdamW"),
    "gpt2-b8-bertadam": Workload("gpt2", 8, "BertAdam"),
    "mlp-adamw": Workload("mlp", 128, "AdamW"),
    "mlp-bertadam": Workload("mlp", 128, "BertAdam"),
}


# Shapes per device: the real ones on CUDA, small ones that keep a 2-core CPU run short.
SHAPES = {
    "cuda": {"image": 224, "gpt2": {}, "seq": 512, "mlp_width": 256, "batch_div": 1,
             "max_model": {"n_embd": 3072, "n_head": 24}, "max_model_seq": 256},
    "cpu": {"image": 64, "gpt2": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1024,
                                  "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0},
            "seq": 64, "mlp_width": 32, "batch_div": 8,
            "max_model": {"n_embd": 128, "n_head": 4, "vocab_size": 1024, "n_positions": 128,
                          "bos_token_id": 0, "eos_token_id": 0}, "max_model_seq": 32},
}


def shapes(device):
    return SHAPES["cuda" if device.type == "cuda" else "cpu"]


def batch_size(workload, device):
    return max(1, workload.batch // shapes(device)["batch_div"])


def gpt2_config(device):
    return GPT2Config(use_cache=False, **shapes(device)["gpt2"])


def mobilenet_source(device):
    if torchvision_mobilenet_v2 is not None:
        return "torchvision"
    return f"in-repo builder x{1.0 if device.type == 'cuda' else 0.35}"


def describe(key, device):
    w, s = WORKLOADS[key], shapes(device)
    b = batch_size(w, device)
    if w.model == "mobilenet":
        what = f"MobileNetV2 ({mobilenet_source(device)}), {s['image']} px, batch {b}"
    elif w.model == "gpt2":
        c = gpt2_config(device)
        what = f"GPT-2 {c.n_layer}x{c.n_embd}, seq {s['seq']}, batch {b}, bf16 autocast"
    else:
        what = f"MLP 200 x Linear({s['mlp_width']}), batch {b}"
    return f"{what}; {w.optimizer}"


def build(key, device):
    """(model, forward, (x, y), loss, bf16) of a workload, weights from the current seed, on ``device``."""
    w, s = WORKLOADS[key], shapes(device)
    b = batch_size(w, device)
    gen = torch.Generator().manual_seed(1)
    if w.model == "mobilenet":
        with torch.device(device):
            if torchvision_mobilenet_v2 is not None:
                model, classes = torchvision_mobilenet_v2(), 1000
            elif device.type == "cuda":
                model, classes = in_repo_mobilenet_v2(width=1.0, classes=1000), 1000
            else:
                model, classes = in_repo_mobilenet_v2(), 100
        x = torch.randn(b, 3, s["image"], s["image"], generator=gen)
        y = torch.randint(0, classes, (b,), generator=gen)
        forward, loss, bf16 = model, nn.functional.cross_entropy, False
    elif w.model == "gpt2":
        if GPT2LMHeadModel is None:
            raise Skip(TRANSFORMERS)
        config = gpt2_config(device)
        with torch.device(device):
            model = GPT2LMHeadModel(config)
        x = torch.randint(0, config.vocab_size, (b, s["seq"]), generator=gen)
        y = torch.randint(0, config.vocab_size, (b, s["seq"]), generator=gen)
        forward, loss, bf16 = (lambda ids: model(input_ids=ids).logits), token_loss, True
    else:
        width = s["mlp_width"]
        with torch.device(device):
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(200)])
        x, y = torch.randn(b, width, generator=gen), None
        forward, loss, bf16 = model, square_loss, False
    model.to(device).train()
    return model, forward, (x.to(device), None if y is None else y.to(device)), loss, bf16


def make_optimizer(name, model, **options):
    """Two param groups, as training recipes have them: weights with decay, biases and norms without."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay, rate = {"SGD": (1e-4, 0.01), "AdamW": (0.01, 1e-4), "BertAdam": (0.01, 1e-4)}[name]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if name == "SGD":
        return torch.optim.SGD(groups, lr=rate, momentum=0.9, **options)
    if name == "AdamW":
        return torch.optim.AdamW(groups, lr=rate, **options)
    return BertAdam(groups, lr=rate)
