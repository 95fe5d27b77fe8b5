"""Optimizers and DDP models built before enable() are adopted when next used, and only then: one
that is dropped (garbage kept by a reference cycle, the collector not yet run) is never taken for
a live one, and enable() itself looks at none of them."""

import json

from spawn import run_python, write_script

SCRIPT = """
    import gc, json, sys, tempfile
    import torch, torch.distributed as dist
    from torch import nn
    import autopatch

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    gc.disable()                      # what follows stays garbage until the end
    dropped = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
    dropped.me = dropped
    dropped_ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    dropped_ddp.__dict__["me"] = dropped_ddp
    del dropped, dropped_ddp
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    autopatch.enable(mode="multi_layer")
    before = autopatch.report()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    after = autopatch.report()
    print(json.dumps({"before": [before["optimizers"], before["allreduce"]["left_to_ddp"]],
                      "after": [after["optimizers"], after["allreduce"]["left_to_ddp"]]}))
"""


def test_built_before_enable_adopted_at_first_use_and_garbage_never(tmp_path):
    out = run_python([write_script(tmp_path / "late.py", SCRIPT)])
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["before"] == [[], []]
    [optimizer], [model] = facts["after"]
    assert (optimizer["class"], optimizer["mode"], optimizer["steps"]) == ("torch.optim.adam.Adam", "multi_layer", 3)
    assert optimizer["fusion"]["fused_steps"] == 3            # its first step since enable() was fused
    assert model == {"model": "Linear", "reason": "world size is 1: there is nothing to synchronise"}
