"""FSDP2 and tensor parallelism on 2 real gloo ranks: patched equals unpatched, bit for bit.

Two spawns of 2 processes (``fsdp_worker.py``) run every scenario; the tests read what they
saved. Under FSDP2 an optimizer over DTensors steps over the plain local shards, so the weights,
the losses (which FSDP2 computes from weights it all-gathers from those shards) and the
optimizer's state, in its DTensor form, must equal unpatched FSDP2's exactly; checkpoints move
between patched and unpatched runs either way.
"""

import pytest
import torch

from spawn import spawn_two_ranks

SPAWN_TIMEOUT = 240
FSDP2_PARAMS = 26      # 7 Linears x (weight, bias) + 6 LayerNorms x (weight, bias)


def spawn(suite, tmp_path_factory):
    results, outputs, codes = spawn_two_ranks("fsdp_worker.py", suite, tmp_path_factory, SPAWN_TIMEOUT)
    assert codes == [0, 0], "\n".join(outputs)
    return results, outputs


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return spawn("fsdp", tmp_path_factory)[0]


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    return spawn("tp", tmp_path_factory)[0]


def assert_tensors_equal(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}[{i}] differs by {(x - y).abs().max().item()}"


def assert_state_same(got, ref, what):
    """Same entries, same keys, same kinds: DTensors with the same layout and local values."""
    assert got.keys() == ref.keys(), what
    for k in ref:
        assert got[k].keys() == ref[k].keys(), (what, k)
        for key, r in ref[k].items():
            g = got[k][key]
            where = f"{what}: state {k}/{key}"
            assert g["type"] == r["type"], where
            if r["type"] == "DTensor":
                for field in ("placements", "shape", "stride", "mesh"):
                    assert g[field] == r[field], (where, field)
                assert torch.equal(g["local"], r["local"]), where
            elif r["type"] == "Tensor":
                assert g["shape"] == r["shape"] and torch.equal(g["value"], r["value"]), where
            else:
                assert g["value"] == r["value"], where


def assert_same_run(got, ref, what, losses=None):
    assert got["losses"] == (ref["losses"] if losses is None else losses), what
    assert_tensors_equal(got["weights"], ref["weights"], f"{what}: weights")
    assert_state_same(got["state"], ref["state"], f"{what}: state_dict()")
    if "dcp_state" in ref and "dcp_state" in got:
        assert_state_same(got["dcp_state"], ref["dcp_state"], f"{what}: get_optimizer_state_dict()")


def stepped(report):
    """The optimizer that trained (enable() also adopts a finished job's optimizer still alive)."""
    (entry,) = [o for o in report["optimizers"] if o["steps"]]
    return entry


def local_shards(run):
    entry = stepped(run["report"])
    assert entry["mode"] == "multi_layer", entry
    assert entry["fusion"]["layout"] == "local_shards", entry
    return entry


def test_fsdp2_under_the_default_policy_trains_as_unpatched(fsdp):
    """The job that crashed planning (untyped_storage() of a DTensor) now trains as unpatched;
    mode auto watches, then measures off against multi_layer on the local shards."""
    for rank in (0, 1):
        run = fsdp[rank]["default"]
        assert_same_run(run, fsdp[rank]["ref"], f"rank {rank}")
        entry = stepped(run["report"])
        assert entry["mode"] in ("off", "multi_layer") and "fell back" not in entry["reason"], entry


def test_fsdp2_multi_layer_steps_the_local_shards(fsdp):
    for rank in (0, 1):
        assert_same_run(fsdp[rank]["multi_layer"], fsdp[rank]["ref"], f"rank {rank}")
        entry = local_shards(fsdp[rank]["multi_layer"])
        assert entry["fusion"]["fused_params"] == FSDP2_PARAMS and entry["fusion"]["excluded_params"] == {}
        # the first step runs on the DTensors, where the optimizer creates its state as unpatched
        assert entry["fusion"]["fused_steps"] == entry["steps"] - 1 == 4


def test_fsdp2_backward_falls_back_to_multi_layer_on_the_local_shards(fsdp):
    for rank in (0, 1):
        assert_same_run(fsdp[rank]["backward"], fsdp[rank]["ref"], f"backward, rank {rank}")
        local_shards(fsdp[rank]["backward"])


def test_fsdp2_auto_measures_and_trains_as_unpatched(fsdp):
    for rank in (0, 1):
        run = fsdp[rank]["auto"]
        assert_same_run(run, fsdp[rank]["ref_22"], f"auto, rank {rank}")
        entry = stepped(run["report"])
        assert entry["auto"]["chosen"] in ("off", "multi_layer") and not entry["auto"]["measuring"], entry


def test_backward_and_forward_are_refused_with_the_reason(fsdp):
    backward = stepped(fsdp[0]["backward"]["report"])["reason"]
    assert "not backward: DTensor parameters" in backward and "reduce-scatters" in backward
    ruled_out = stepped(fsdp[0]["auto"]["report"])["auto"]["ruled_out"]
    assert ruled_out["backward"].startswith("DTensor parameters") and ruled_out["forward"].startswith("DTensor parameters")


def test_weights_identical_on_both_ranks(fsdp):
    for name, run in fsdp[0].items():
        if "fsdp1" in name:
            continue        # FSDP1's flat parameters hold each rank's shard, not the full tensor
        assert_tensors_equal(run["weights"], fsdp[1][name]["weights"], f"{name}: rank 0 vs rank 1")


@pytest.mark.parametrize("optimizer", ["bert", "sgd"])
def test_hand_written_and_momentum_optimizers(fsdp, optimizer):
    for rank in (0, 1):
        assert_same_run(fsdp[rank][optimizer], fsdp[rank][f"ref_{optimizer}"], optimizer)
        assert local_shards(fsdp[rank][optimizer])["fusion"]["fused_steps"] == 4


@pytest.mark.parametrize("direction", ["ckpt_patched_to_unpatched", "ckpt_unpatched_to_patched"])
def test_dcp_checkpoint_moves_between_patched_and_unpatched(fsdp, direction):
    """Saved after 3 steps with torch.distributed.checkpoint, loaded into a fresh job, 2 more
    steps: the same run as 5 unpatched steps in one go."""
    for rank in (0, 1):
        run = fsdp[rank][direction]
        assert_same_run(run, fsdp[rank]["ref"], f"{direction}, rank {rank}")
        loaded = run["loaded"]
        assert {v["type"] for entry in loaded.values() for k, v in entry.items() if k != "step"} == {"DTensor"}
    patched_side = fsdp[0][direction]["report"]
    if patched_side is not None:        # the loading side was patched: it went on fused
        assert local_shards(fsdp[0][direction])["fusion"]["fused_steps"] == 2


@pytest.mark.parametrize("direction", ["patched_to_unpatched", "unpatched_to_patched"])
def test_get_and_set_optimizer_state_dict_round_trip(fsdp, direction):
    for rank in (0, 1):
        run, ref = fsdp[rank][direction], fsdp[rank]["ref"]
        assert_same_run(run, ref, f"{direction}, rank {rank}", losses=ref["losses"][3:])


def test_allreduce_section_leaves_fsdp_collectives_alone(fsdp):
    section = fsdp[0]["default"]["report"]["allreduce"]
    assert section["active"] is False and section["models"] == []
    assert section["sharded_params"] == FSDP2_PARAMS
    assert "takes over DistributedDataParallel only" in section["reason"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_parameters_are_never_flattened(fsdp, use_orig_params):
    """FSDP1 re-points its FlatParameter (and the views into it) at every forward."""
    for rank in (0, 1):
        run = fsdp[rank][f"fsdp1_{use_orig_params}"]
        assert_same_run(run, fsdp[rank][f"ref_fsdp1_{use_orig_params}"], f"FSDP1, rank {rank}")
        fusion = stepped(run["report"])["fusion"]
        assert fusion["fused_params"] == 0
        excluded = " ".join(fusion["excluded_params"])
        assert ("FSDP1 use_orig_params view" if use_orig_params else "FSDP1 FlatParameter") in excluded


def test_tensor_parallel_steps_local_shards(tp):
    """Column-wise then row-wise Linears (Shard(0), Shard(1), a Replicate bias) and a plain head."""
    for rank in (0, 1):
        for name in ("adamw", "bert"):
            ref = tp[rank]["ref" if name == "adamw" else "ref_bert"]
            assert_same_run(tp[rank][name], ref, f"{name}, rank {rank}")
            fusion = local_shards(tp[rank][name])["fusion"]
            assert fusion["fused_params"] == 4 and fusion["excluded_params"] == {}
        assert_tensors_equal(tp[rank]["adamw"]["weights"], tp[1 - rank]["adamw"]["weights"], "ranks")


def test_partial_placements_stay_on_their_dtensor(tp):
    for rank in (0, 1):
        run = tp[rank]["partial"]
        assert_same_run(run, tp[rank]["ref_partial"], f"Partial, rank {rank}")
        assert torch.equal(run["partial"], tp[rank]["ref_partial"]["partial"])
        fusion = local_shards(run)["fusion"]
        assert fusion["excluded_params"] == {"Partial placement: its local tensor holds unreduced values": 1}
        assert fusion["fused_params"] == 4     # the other group still steps as local shards
