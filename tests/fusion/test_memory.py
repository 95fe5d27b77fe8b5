"""Memory is a measured property: no mode holds a second copy of the gradients, and backward
fusion frees them as it goes, at the default chunk size and at the 256 MiB an accelerator might
use.

The workload is 256 x Linear(256, 256, bias=False) with AdamW: 64 MiB of gradients, each
parameter 256 KiB. Peaks are the most bytes held by tensors at once during steady-state steps
(tests/memory.py), compared with the same job unpatched.
"""

import gc

import pytest
import torch
from torch import nn

import autopatch
from memory import TensorMemory

GRAD_BYTES = 256 * 256 * 256 * 4
CHUNKS = ["auto", "256MiB"]


def peak_bytes(mode, chunk, warmup=4, steps=2):
    if mode:
        autopatch.enable(mode=mode, chunk_bytes=chunk, fusion={"observe_steps": 1})
    gc.collect()      # earlier runs' tensors go now, not unseen inside the window
    with TensorMemory() as tm:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(256)])
        x = torch.randn(32, 256)
        try:
            opt = torch.optim.AdamW(model.parameters())

            def step():
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            for _ in range(warmup):
                step()
            with tm.window():
                for _ in range(steps):
                    step()
            ran = autopatch.report()["optimizers"][0]["mode"] if mode else None
        finally:
            autopatch.disable()
    assert ran == mode
    return tm.peaks()[0]


@pytest.fixture(scope="module")
def unpatched():
    return peak_bytes(None, None)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode", ["multi_layer", "forward"])
def test_no_second_copy_of_the_gradients(ap, unpatched, mode, chunk):
    """Within a tenth of the gradients of unpatched: the chunk buffers replace the grads they
    gather, and the optimizer's temporaries over a chunk stay a few percent of them."""
    assert peak_bytes(mode, chunk) <= unpatched + GRAD_BYTES // 10


@pytest.mark.parametrize("chunk", CHUNKS)
def test_backward_fusion_frees_gradients_as_it_goes(ap, unpatched, chunk):
    """At least half of the gradients never exist at once: each chunk's are freed after its
    update, whatever chunk size was asked for."""
    assert peak_bytes("backward", chunk) <= unpatched - GRAD_BYTES // 2
