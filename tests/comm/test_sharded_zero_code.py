"""Sharded optimizer state as users start it: ``FUSEDOPT_ENABLE=1 FUSEDOPT_SHARD=1 torchrun`` over
an unchanged script, which ends as scripts do (with or without ``destroy_process_group()``, and
never through ``os._exit``): every rank exits 0, with nothing on stderr from the teardown, and
the script prints what it prints without autopatch."""

import pytest

from spawn import IMPORT_PATH, ROOT, clean_env, run_python, write_script

WORLD = 3


def torchrun(script, *args, **env):
    return run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", script, *args],
                      env=clean_env(OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME="lo", **env), timeout=240)


def test_the_ddp_example_prints_the_same_losses_and_weights_sharded():
    example = ROOT / "examples" / "train_ddp.py"
    args = ("--steps", "12", "--width", "64", "--depth", "4")
    plain = torchrun(example, *args, PYTHONPATH=f"{ROOT / 'examples'}")
    sharded = torchrun(example, *args, PYTHONPATH=f"{ROOT / 'examples'}:{IMPORT_PATH}",
                       FUSEDOPT_ENABLE=1, FUSEDOPT_SHARD=1)
    assert plain.returncode == 0, plain.stderr
    assert sharded.returncode == 0, sharded.stderr
    assert "weights " in plain.stdout and sharded.stdout == plain.stdout, (plain.stdout, sharded.stdout)
    assert f"sharded over {WORLD} ranks" in sharded.stderr, sharded.stderr


@pytest.mark.parametrize("policy", ["sharded", "multi_layer"])
def test_a_script_that_ends_without_tearing_the_group_down_exits_cleanly(tmp_path, policy):
    """The process group, its store and autopatch's service thread all meet the interpreter's
    teardown: none of them may abort it (a store call from the service thread there did)."""
    script = write_script(tmp_path / "short.py", """
        import torch, torch.distributed as dist
        from torch import nn
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
        print("done")
    """)
    runs = [torchrun(script, PYTHONPATH=IMPORT_PATH, FUSEDOPT_ENABLE=1, FUSEDOPT_POLICY=policy) for _ in range(3)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.count("done") == WORLD, run.stdout     # ranks' lines may interleave
        assert "terminate called" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]


FINAL_SAVE = """
    import sys, torch, torch.distributed as dist
    from torch import nn

    def main():
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(dist.get_rank())
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(8, 32, generator=g)).sum().backward()
            opt.step()
        if dist.get_rank() == 0:
            torch.save(opt.state_dict(), sys.argv[1])
        if sys.argv[2] == "destroy":
            dist.destroy_process_group()
        return opt

    {call}
"""


@pytest.mark.parametrize("call, end", [("main()", "exit"), ("opt = main()", "destroy")],
                         ids=["optimizer_freed_in_main", "optimizer_alive_group_destroyed"])
def test_rank_0_saving_alone_after_the_last_step_gets_the_whole_state(tmp_path, call, end):
    """The usual last checkpoint: ``if rank == 0: torch.save(opt.state_dict(), ...)`` after the
    loop, while the other ranks leave it, return from ``main()`` (their optimizer freed) and exit.
    They serve their shares from what they kept and wait at exit until rank 0 is done; rank 0
    saves what unpatched DDP saves."""
    import torch
    script = write_script(tmp_path / "final_save.py", FINAL_SAVE.format(call=call))
    plain = torchrun(script, tmp_path / "plain.pt", end, PYTHONPATH=IMPORT_PATH)
    sharded = torchrun(script, tmp_path / "sharded.pt", end, PYTHONPATH=IMPORT_PATH, FUSEDOPT_ENABLE=1,
                       FUSEDOPT_SHARD=1)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert f"sharded over {WORLD} ranks" in sharded.stderr
    want, got = (torch.load(tmp_path / f"{name}.pt") for name in ("plain", "sharded"))
    assert got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][i][key], value), (i, key)
