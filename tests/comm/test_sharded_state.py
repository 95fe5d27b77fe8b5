"""Sharded optimizer state (``fusion.shard``) keeps unpatched DDP's results bit for bit at 2, 3
and 4 gloo ranks, holds about 1/N of the state per rank, round-trips checkpoints with unpatched
runs both ways, hands the whole state back at ``disable()``, and refuses what it cannot shard with
the reason, never a hang (``sharded_state_worker.py`` is the user's script)."""

import pytest

from spawn import results_of_every_rank

WORLDS = (2, 3, 4)
OPTIMIZERS = ("adamw", "sgd_momentum")
MODES = ("multi_layer", "auto")
CHUNK = 64 << 10


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{w}ranks" for w in WORLDS])
def sharded(request, tmp_path_factory):
    world = request.param
    return world, results_of_every_rank("sharded_state_worker.py", "sharded", tmp_path_factory, 240 + 60 * world, world)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_state_equals_unpatched_ddp_bitwise(sharded, name, mode):
    """Losses, weights and every rank's state_dict() (gathered) equal unpatched DDP's."""
    world, results = sharded
    for rank, res in results.items():
        got = res["parity", name, mode]
        assert got["differs"] is None, (world, rank, got)
        assert got["mode"] == "multi_layer" and f"sharded over {world} ranks" in got["reason"], got
        assert got["shard"]["active"] is True and got["shard"]["ranks"] == world, got
        assert got["shard"]["gathered_steps"] == 6, got      # auto too: sharded from the first step
        assert got["shard"]["state_dicts_served"] == 0, got  # every rank asked: the broadcasts gathered


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_rank_holds_its_share_of_the_state(sharded, name):
    """Shares partition the state: their sum is the unsharded state, each within a chunk per run
    and state tensor of 1/N; outside step() a rank's optimizer.state holds fewer parameters."""
    world, results = sharded
    shards = [results[r]["parity", name, "multi_layer"]["shard"] for r in range(world)]
    whole = shards[0]["state_bytes_unsharded"]
    assert all(s["state_bytes_unsharded"] == whole for s in shards)
    assert sum(s["state_bytes"] for s in shards) == whole
    keys = 2 if name == "adamw" else 1
    for s in shards:
        assert abs(s["state_bytes"] - whole / world) <= 2 * keys * CHUNK, (world, s)
        assert s["gather_bytes_per_step"] > 0 and s["received_bytes"] == 6 * s["gather_bytes_per_step"]
    params = results[0]["parity", name, "multi_layer"]["params"]
    assert all(results[r]["parity", name, "multi_layer"]["held"] < params for r in range(world))


def test_checkpoints_move_between_sharded_and_unpatched_runs(sharded):
    world, results = sharded
    for rank, res in results.items():
        assert res["sharded_to_unpatched"] is None, (world, rank, res["sharded_to_unpatched"])
        assert res["unpatched_to_sharded"]["differs"] is None, (world, rank, res["unpatched_to_sharded"])
        assert res["unpatched_to_sharded"]["shard"]["active"] is True


def test_distributed_checkpoint_saves_and_loads_sharded_state_both_ways(sharded):
    """dcp.save of a sharded run resumed unpatched, and an unpatched save resumed sharded, each
    equal to the same resume unpatched on both sides (a resumed DDP model's first buckets are not
    a running one's, so the reference resumes too)."""
    world, results = sharded
    for rank, res in results.items():
        assert res["distributed_checkpoint"] == {"save": None, "load": None}, (world, rank, res["distributed_checkpoint"])


def test_disable_mid_run_hands_the_whole_state_back(sharded):
    world, results = sharded
    for rank, res in results.items():
        assert res["disable_mid_run"]["differs"] is None, (world, rank, res["disable_mid_run"])


def test_a_new_plan_mid_run_gathers_the_state_and_shards_it_again(sharded):
    world, results = sharded
    for rank, res in results.items():
        got = res["replan_mid_run"]
        assert got["differs"] is None, (world, rank, got)
        assert got["shard"]["active"] is True and got["shard"]["unshards"] == 1, got
        assert got["shard"]["gathered_steps"] == 6, got


def test_a_join_context_gives_the_state_back_before_ranks_step_unevenly(sharded):
    world, results = sharded
    for rank, res in results.items():
        got = res["join"]
        assert got["differs"] is None, (world, rank, got)
        assert "Join context" in got["shard"]["stopped"] and got["shard"]["active"] is False, got
        assert got["shard"]["unshards"] == 1 and got["shard"]["gathered_steps"] == 2, got


def test_mode_backward_over_ddps_own_reducer_runs_sharded_multi_layer_and_says_why(sharded):
    world, results = sharded
    for rank, res in results.items():
        got = res["backward_named"]
        assert got["differs"] is None and got["mode"] == "multi_layer", got
        assert "backward cannot update shares inside backward here" in got["reason"], got
        assert "not all of them by autopatch's allreduce" in got["reason"] and got["shard"]["active"] is True, got


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_mode_backward_updates_each_share_inside_backward_under_autopatchs_allreduce(sharded, name):
    """After the watch, every rank updates the chunks of its share as their gradients are averaged:
    weights, losses and the gathered state equal the sharded multi_layer run's under the same
    allreduce bit for bit (and unpatched DDP's at two ranks, where that allreduce sums as DDP's)."""
    world, results = sharded
    for rank, res in results.items():
        got = res["backward_sharded"][name]
        assert got["differs"] is None, (world, rank, got)
        assert world > 2 or got["differs_from_ddp"] is None, (rank, got)
        assert got["mode"] == "backward" and f"sharded over {world} ranks" in got["reason"], got
        # the switch from multi_layer took the shards as they were: nothing gathered, the plan and
        # its counts go on (8 sharded steps), and the 5 steps after the watch update every chunk
        # of the share inside backward
        assert got["shard"]["active"] is True and got["shard"]["unshards"] == 0, got
        assert got["shard"]["gathered_steps"] == 8, got
        assert got["in_backward"] > 0 and got["in_backward"] % 5 == 0, got


def test_mode_backward_sharded_stays_multi_layer_on_every_rank_where_one_rank_rules_it_out(sharded):
    """Rank 0 alone reads the gradients before step(): no rank leaves sharded multi_layer (leaving
    it gathers the state, a collective), and the others say why. A DDP model finding unused
    parameters keeps multi_layer too, with the reason."""
    world, results = sharded
    for rank, res in results.items():
        reads, unused = res["backward_sharded"]["ruled_out"].values()
        assert reads["mode"] == "multi_layer" and reads["shard"]["active"] is True, reads
        assert ("gradients used between backward and step()" in reads["reason"]) if rank == 0 else ("ruled out on another rank" in reads["reason"]), reads
        assert unused["mode"] == "multi_layer" and "find_unused_parameters=True" in unused["reason"], unused


def test_state_dict_on_rank_0_alone_under_mode_backward_is_served_while_the_others_update_inside_backward(sharded):
    """Rank 0 alone saves after a step whose shares were updated inside backward, and at the last
    step, while the other ranks go on (or disable); it gets the state the sharded multi_layer run
    under the same allreduce gives it."""
    world, results = sharded
    for rank, res in results.items():
        got = res["backward_sharded"]["state_dict_on_one_rank"]
        assert got["differs"] is None, (world, rank, got)
        assert got["served"] == (2 if rank == 0 else 0), got


def test_what_cannot_be_sharded_stays_unsharded_with_the_reason(sharded):
    world, results = sharded
    for rank, res in results.items():
        per_tensor, outside = res["refused"]["per_tensor"], res["refused"]["outside_ddp"]
        assert per_tensor["differs"] is None and outside["differs"] is None, res["refused"]
        assert per_tensor["shard"] == {"active": False, "reason": per_tensor["reason"]}
        assert "per-tensor update" in per_tensor["reason"]
        assert outside["shard"]["active"] is False
        assert "in no DistributedDataParallel model" in outside["shard"]["reason"]


def test_state_dict_on_rank_0_alone_returns_the_whole_state_while_the_others_train_on(sharded):
    """``if rank == 0: torch.save(opt.state_dict())`` mid-run and at the end: rank 0 gets what
    unpatched DDP gives it, served by the other ranks' service threads, and the run goes on as
    unpatched."""
    world, results = sharded
    got = results[0]["state_dict_on_one_rank"]
    assert got == {"differs": None, "served": 2}, (world, got)


def test_state_dict_calls_leave_the_jobs_store_as_they_found_it(sharded):
    """Five calls on every rank at once add no key to the job's store; five on rank 0 alone add
    at most one each (the decision that this step's askers are served, kept for one still to
    come): a long job that checkpoints often does not grow the store's server. Other keys of the
    job may come and go meanwhile, so these are bounds."""
    world, results = sharded
    grown = results[0]["store_growth"]
    assert grown["every_rank"] <= 0 and grown["rank_0"] <= 5, (world, grown)


def test_one_process_without_a_process_group_is_refused_with_the_reason(ap):
    """No process group: the optimizer runs unsharded multi_layer, as unpatched bit for bit."""
    import torch
    from training import assert_same, batches, mlp, train, weights

    data = batches(4)
    ref_model = mlp()
    train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), data)
    ap.enable(mode="multi_layer", fusion={"shard": True})
    model = mlp()
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data)
    entry = ap.report()["optimizers"][0]
    assert_same(weights(model), weights(ref_model))
    assert entry["mode"] == "multi_layer"
    assert entry["shard"] == {"active": False, "reason": "no process group (torch.distributed is not initialised)"}
