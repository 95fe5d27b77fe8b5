"""Bucketed allreduce on 2 real gloo ranks: equal to DDP, identical on every rank, clear errors.

Three spawns of 2 processes each (``allreduce_worker.py``) run every scenario; the tests below
read what they saved. On 2 ranks each element's sum is one addition and the 1/2 scaling is exact,
so uncompressed results must equal DDP's bit for bit whatever the bucket layout; compressed ones
must stay within the bound documented in ``autopatch.comm.compression``.
"""

import json

import pytest
import torch

from autopatch.comm.compression import error_bound
from autopatch.fusion.chunking import BACKWARD_WINDOW
from spawn import clean_env, run_python, spawn_two_ranks, write_script

SPAWN_TIMEOUT = 150


def spawn(suite, tmp_path_factory):
    """Run both ranks of ``suite``; return {rank: saved results}, the outputs and return codes."""
    return spawn_two_ranks("allreduce_worker.py", suite, tmp_path_factory, SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    results, outputs, codes = spawn("equivalence", tmp_path_factory)
    assert codes == [0, 0] and len(results) == 2, "\n".join(outputs)
    return results


def assert_bitwise(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}[{i}]: one is None"
        else:
            assert torch.equal(x, y), f"{what}[{i}] differs by {(x - y).abs().max().item()}"


def assert_same_run(got, ref):
    assert got["losses"] == ref["losses"]
    for key in ("weights", "buffers", "first_grads"):
        assert_bitwise(got[key], ref[key], key)
    assert got["grad_is_none"] == ref["grad_is_none"]


def active(run):
    section = run["report"]["allreduce"]
    assert section["active"], section
    return section


@pytest.mark.parametrize("nbytes", [1024, 8192, 25 * 2**20])
def test_bitwise_equal_to_ddp_for_each_bucket_size(equivalence, nbytes):
    for rank in (0, 1):
        run = equivalence[rank][f"bucket_{nbytes}"]
        assert_same_run(run, equivalence[rank]["ddp"])
        section = active(run)
        assert section["bucket_bytes"] == nbytes
        assert section["bytes_sent_per_step"] > 0 and section["wait_seconds"] >= 0
    buckets = active(equivalence[0][f"bucket_{nbytes}"])["buckets"]
    assert buckets == (1 if nbytes > 2**20 else buckets) and buckets >= 1


def test_smaller_buckets_mean_more_of_them(equivalence):
    counts = [active(equivalence[0][f"bucket_{n}"])["buckets"] for n in (1024, 8192, 25 * 2**20)]
    assert counts[0] > counts[1] > counts[2] == 1


def test_ranks_end_identical(equivalence):
    for name, run in equivalence[0].items():
        if isinstance(run, dict) and "weights" in run:
            assert_bitwise(run["weights"], equivalence[1][name]["weights"], f"{name}: rank 0 vs rank 1")


def test_bucket_size_changed_mid_training(equivalence):
    for rank in (0, 1):
        run = equivalence[rank]["changing"]
        assert_same_run(run, equivalence[rank]["ddp"])
        model = active(run)["models"][0]
        assert model["layouts"] == 3 and model["bucket_bytes"] == 8192
    assert active(equivalence[0]["bucket_size_2p"])["bucket_bytes"] == 1024
    assert_same_run(equivalence[0]["bucket_size_2p"], equivalence[0]["ddp"])


def test_no_sync_accumulation(equivalence):
    for rank in (0, 1):
        assert_same_run(equivalence[rank]["no_sync"], equivalence[rank]["ddp_no_sync"])
        assert active(equivalence[rank]["no_sync"])["models"][0]["synchronised_steps"] == 4


def test_unused_parameters(equivalence):
    for rank in (0, 1):
        for name in ("unused", "unused_no_sync"):
            run, ref = equivalence[rank][name], equivalence[rank][f"ddp_{name}"]
            assert_same_run(run, ref)
            assert run["grad_is_none"][-2:] == [True, True]     # `never` keeps grad None, as in DDP


@pytest.mark.parametrize("compression", ["fp16", "bf16", "minmax_uint8"])
def test_compression_within_its_bound(equivalence, compression):
    local = equivalence[0]["local_grads"]
    exact = (local[0].double() + local[1].double()) / 2
    bound = error_bound(compression, local)
    for rank in (0, 1):
        run = equivalence[rank][compression]
        got = torch.cat([g.reshape(-1) for g in run["first_grads"]]).double()
        excess = (got - exact).abs() - bound
        assert excess.max() <= 0, f"{compression}: bound exceeded by {excess.max().item()}"
        assert active(run)["compression"] == compression
        ref = equivalence[rank]["ddp"]["losses"]
        assert max(abs(a - b) for a, b in zip(run["losses"], ref)) < 0.05
    assert_bitwise(equivalence[0][compression]["first_grads"], equivalence[1][compression]["first_grads"],
                   f"{compression} gradients, rank 0 vs rank 1")


def test_compression_cuts_bytes(equivalence):
    sent = {c: active(equivalence[0][c])["bytes_sent_per_step"]
            for c in ("fp16", "bf16", "minmax_uint8")}
    plain = active(equivalence[0]["bucket_26214400"])["bytes_sent_per_step"]
    assert sent["fp16"] * 2 == plain and sent["bf16"] * 2 == plain
    assert sent["minmax_uint8"] * 3.5 < plain


def test_with_multi_layer_fusion(equivalence):
    for rank in (0, 1):
        run = equivalence[rank]["multi_layer"]
        assert_same_run(run, equivalence[rank]["ddp_adam"])
        active(run)
        assert [o["mode"] for o in run["report"]["optimizers"]] == ["multi_layer"]


def test_with_forward_fusion(equivalence):
    """Weights are read before the deferred last update lands, so the losses are compared."""
    for rank in (0, 1):
        run = equivalence[rank]["forward"]
        assert run["losses"] == equivalence[rank]["ddp_adam_6"]["losses"]
        assert [o["mode"] for o in run["report"]["optimizers"]] == ["forward"]


@pytest.mark.parametrize("scenario, reference", [
    ("backward", "ddp_adam_6"),                     # one bucket: handed over at backward's end
    ("backward_small_buckets", "ddp_adam_6"),       # many: each as soon as its allreduce is done
    ("backward_minmax", "minmax_adam_6"),           # two collectives per bucket: in bucket order
    ("backward_unused", "ddp_unused_6"),            # after the used-parameter bitmap
    ("backward_changing", "ddp_adam_7"),            # 25 MiB, then 1 KiB buckets mid-run
])
def test_with_backward_fusion(equivalence, scenario, reference):
    """Chunks are updated inside backward from the averaged gradients, never the local ones:
    weights equal DDP's with the same optimizer stepping after backward, on every rank."""
    for rank in (0, 1):
        run = equivalence[rank][scenario]
        assert_same_run(run, equivalence[rank][reference])
        (opt,) = run["report"]["optimizers"]
        assert opt["mode"] == "backward", opt["reason"]
        assert opt["fusion"]["chunk_updates_in_backward"] > 0
        assert opt["fusion"]["leftover_steps"] == 0
        model = active(run)["models"][0]
        assert "buckets_handed_over_early" in model
        assert model["layouts"] == (2 if scenario == "backward_changing" else 1)
    assert_bitwise(equivalence[0][scenario]["weights"], equivalence[1][scenario]["weights"],
                   f"{scenario} weights, rank 0 vs rank 1")


def test_mode_auto_measures_in_step_and_rank_0_decides(equivalence):
    """Every rank measures the same modes on the same schedule and takes rank 0's choice at the
    same step: the ranks' figures are rank 0's, and the weights equal DDP's."""
    reports = []
    for rank in (0, 1):
        run = equivalence[rank]["auto"]
        assert_same_run(run, equivalence[rank]["ddp_adam_24"])
        (opt,) = run["report"]["optimizers"]
        auto = opt["auto"]
        assert auto["candidates"] == ["off", "multi_layer", "backward", "forward"] and not auto["ruled_out"]
        assert opt["mode"] == auto["chosen"] and not auto["measuring"]
        reports.append(auto)
    for key in ("chosen", "ms_per_step", "ratio_vs_off", "rounds", "measurements"):
        assert reports[0][key] == reports[1][key], key


def test_backward_fusion_is_refused_where_ddp_averages(equivalence):
    """DDP's own reducer writes averaged grads only at the end of backward: an update inside
    backward would use the local gradient, so a policy asking for it gets multi_layer."""
    for rank in (0, 1):
        run = equivalence[rank]["backward_left_to_ddp"]
        assert run["losses"] == equivalence[rank]["ddp_adam_6"]["losses"]
        (opt,) = run["report"]["optimizers"]
        assert opt["mode"] == "multi_layer"
        assert "not all of them by autopatch's allreduce" in opt["reason"]


def test_hierarchical_reduce(equivalence):
    """2 ranks as 2 nodes of 1 (only the leaders' allreduce) and as 1 node of 2 (reduce + broadcast)."""
    for rank in (0, 1):
        for nodes in ("2x1", "1x2"):
            run = equivalence[rank][f"hierarchical_{nodes}"]
            assert_same_run(run, equivalence[rank]["ddp"])
            assert active(run)["hierarchical"]
        local = equivalence[0]["local_grads"]
        exact = (local[0].double() + local[1].double()) / 2
        between_nodes = equivalence[rank]["hierarchical_2x1_fp16"]
        got = torch.cat([g.reshape(-1) for g in between_nodes["first_grads"]]).double()
        assert ((got - exact).abs() <= error_bound("fp16", local)).all()
        assert not torch.equal(got, exact.float().double())     # fp16 did apply between nodes
        # Compression applies between nodes only: on one node the result stays exact.
        assert_same_run(equivalence[rank]["hierarchical_1x2_fp16"], equivalence[rank]["ddp"])


def test_model_built_before_enable_and_given_back_on_disable(equivalence):
    for rank in (0, 1):
        run, ref = equivalence[rank]["adopted_then_disabled"], equivalence[rank]["ddp_2_then_2"]
        assert_same_run(run, ref)
        assert_same_run(run["after"], ref["after"])
        assert active(run)["models"][0]["synchronised_steps"] == 2


def test_left_to_ddp_with_a_reason(equivalence):
    for rank in (0, 1):
        hooked = equivalence[rank]["comm_hook"]
        assert_same_run(hooked, equivalence[rank]["ddp"])
        section = hooked["report"]["allreduce"]
        assert not section["active"]
        assert "communication hook" in section["left_to_ddp"][0]["reason"]
        static = equivalence[rank]["static_graph"]
        assert_same_run(static, equivalence[rank]["ddp"])
        assert "static_graph" in static["report"]["allreduce"]["reason"]
        off = equivalence[rank]["disabled_policy"]["report"]["allreduce"]
        assert off == {"active": False, "reason": "allreduce.enabled is false"}


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    return spawn("failures", tmp_path_factory)


def test_layout_mismatch_is_a_clear_error(failures):
    results, outputs, codes = failures
    assert 0 in results, "\n".join(outputs)
    for r in results.values():
        error = r["mismatch"]
        assert error["type"] == "LayoutMismatch", error
        assert "rank 0: " in error["message"] and "1024 bytes" in error["message"]
        assert "rank 1: " in error["message"] and "8192 bytes" in error["message"]


def test_the_layout_check_takes_no_collective_of_its_own_once_agreed(equivalence):
    """A layout is checked on the step that first uses it: the first step, and the step after
    each change of bucket size; compressed layouts alike. Later steps add no collective."""
    for rank in (0, 1):
        checks = {name: active(equivalence[rank][name])["models"][0]["layout_checks"]
                  for name in (f"bucket_{25 * 2**20}", "bucket_1024", "changing", "fp16")}
        assert checks == {f"bucket_{25 * 2**20}": 1, "bucket_1024": 1, "changing": 3, "fp16": 1}, checks


def test_unused_parameter_without_find_unused_is_an_error_as_in_ddp(failures):
    results, outputs, codes = failures
    for r in results.values():
        error = r["unused_without_flag"]
        assert error["type"] == "RuntimeError", error
        assert "never.weight" in error["message"] and "find_unused_parameters=True" in error["message"]


def test_accumulation_under_backward_fusion_is_a_clear_error(failures):
    """Backward fusion updates inside the first synchronised backward; a second one before
    step() would need the sum of both, so it raises on every rank (and nothing hangs)."""
    results, outputs, codes = failures
    for r in results.values():
        error = r["accumulation_in_backward_mode"]
        assert error["type"] == "AccumulationError", error
        assert "second gradient before optimizer.step()" in error["message"]


def test_rank_death_is_a_clear_error(failures):
    results, outputs, codes = failures
    assert codes[1] == 17, "rank 1 was meant to die"
    error = results[0]["death"]
    assert error["type"] == "CommunicationError", error
    assert "another rank has most likely exited" in error["message"].lower()
    assert error["seconds"] < 25


@pytest.fixture(scope="module")
def stall(tmp_path_factory):
    results, outputs, codes = spawn("stall", tmp_path_factory)
    assert len(results) == 2, "\n".join(outputs)
    return results


def test_stalled_rank_times_out(stall):
    error = stall[0]["stall"]
    assert error["type"] == "CommunicationError", error
    assert "timed out" in error["message"].lower()
    # At the 1.5 s timeout, well before the process group's own 60 s; a loaded machine may add
    # seconds to raising it (had rank 1 come back first, there would be no error at all).
    assert 1.5 <= error["seconds"] < 10


ZERO_CODE_SCRIPT = """
    import json, sys, torch, torch.distributed as dist
    from torch import nn
    import autopatch

    def train():
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g)).square().mean().backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    dist.init_process_group("gloo")
    patched = train()
    section = autopatch.report()["allreduce"]
    autopatch.disable()
    plain = train()
    both = [torch.empty_like(patched) for _ in range(2)]
    dist.all_gather(both, patched)
    result = {"rank": dist.get_rank(), "equal_to_ddp": torch.equal(patched, plain),
              "ranks_identical": torch.equal(*both), "allreduce": section}
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:   # one file a rank: no interleaving
        json.dump(result, f)
"""


def test_zero_code_under_torchrun(tmp_path, installed):
    """FUSEDOPT_ENABLE=1 torchrun ...: enabled before torch is imported, DDP taken over unchanged."""
    script = write_script(tmp_path / "train.py", ZERO_CODE_SCRIPT)
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nfusion:\n  mode: 'off'\n"
                      "allreduce:\n  enabled: true\n  bucket_size_2p: 10\n  hierarchical: true\n")
    out = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
                      str(tmp_path)],
                     env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_POLICY=policy, OMP_NUM_THREADS=1),
                     timeout=SPAWN_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [line["rank"] for line in lines] == [0, 1]
    for line in lines:
        assert line["equal_to_ddp"] and line["ranks_identical"], line
        section = line["allreduce"]
        assert section["active"] and section["hierarchical"] and section["bucket_bytes"] == 1024


def test_disable_restores_the_ddp_class(ap):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopatch.torch_internals import DDP_HANDING_BACK
    names = ["__init__", "forward", *DDP_HANDING_BACK]
    before = {name: vars(DDP)[name] for name in names}
    ap.enable(allreduce={"enabled": True})
    assert all(vars(DDP)[name] is not before[name] for name in names)
    assert ap.report()["allreduce"] == {**ap.report()["allreduce"], "active": False,
                                        "reason": "no DistributedDataParallel model has been built or run since autopatch was enabled"}
    ap.disable()
    assert all(vars(DDP)[name] is before[name] for name in names)
    ap.enable(allreduce={"enabled": False})
    assert vars(DDP)["forward"] is before["forward"]
    assert ap.report()["allreduce"] == {"active": False, "reason": "allreduce.enabled is false"}


def test_backward_fusion_frees_each_bucket_once_its_chunks_are_updated(equivalence):
    """Across processes too, a bucket's buffer is freed once the chunks it feeds are updated:
    after backward no gradient memory is left but the scratch buffer that a chunk of several
    parameters gathers its gradients into (made once, kept between steps, at most the window),
    where without backward fusion all of it is (until zero_grad, as in DDP). During backward the gradients alive are those of the buckets still in
    flight, which depends on the network, so the peak can only be bounded by the worst case: all
    of them in flight, plus the optimizer's temporaries over one chunk (at most the window)."""
    for rank in (0, 1):
        off, fused = equivalence[rank]["peak_off"], equivalence[rank]["peak_backward"]
        assert (off["mode"], fused["mode"]) == ("off", "backward")
        assert fused["after_backward"] <= off["after_backward"] - 0.99 * off["grad_bytes"] + BACKWARD_WINDOW, (fused, off)
        assert fused["peak"] <= off["peak"] + 3 * BACKWARD_WINDOW, (fused, off)
