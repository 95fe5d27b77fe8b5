"""Communication algorithms (decentralized, low-precision decentralized, async, QAdam) driven
through their hooks on 2 and 4 gloo ranks, as the DDP takeover drives them."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from autopatch.comm.algorithms import ALGORITHMS, build
from autopatch.comm.algorithms.peers import check_even, ring_neighbours, shift_one_pairs, shift_one_peer
from spawn import SUPPORT, clean_env, patience

pytestmark = pytest.mark.usefixtures("digits_file")   # the ranks load the digits from a file

# The schedules of the shift-one pairing, as specified for 4 and 8 ranks.
SHIFT_ONE = {
    4: [[(0, 2), (1, 3)], [(0, 3), (1, 2)]],
    8: [[(0, 4), (1, 5), (2, 6), (3, 7)], [(0, 5), (1, 6), (2, 7), (3, 4)],
        [(0, 6), (1, 7), (2, 4), (3, 5)], [(0, 7), (1, 4), (2, 5), (3, 6)]],
}


def run_ranks(suite, world, tmp_path, timeout):
    """Ranks 0..world-1 of ``algorithms_worker.py``'s ``suite``, each of which must exit 0 within
    ``timeout`` seconds (a rank still running then is killed). Returns each rank's results."""
    env = clean_env(OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME="lo")

    def rank(r):
        return subprocess.run([sys.executable, str(SUPPORT / "algorithms_worker.py"), suite, str(r), str(world),
                               str(tmp_path / "init"), str(tmp_path / f"rank{r}.pt")],
                              env=env, capture_output=True, text=True, timeout=patience(timeout))
    with ThreadPoolExecutor(world) as pool:
        done = list(pool.map(rank, range(world)))
    for r, proc in enumerate(done):
        assert proc.returncode == 0, f"rank {r} of {suite} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks("four", 4, tmp_path_factory.mktemp("four"), timeout=150)


# -- pure functions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [4, 8])
def test_shift_one_pairs_follow_the_schedule(n):
    h = n // 2
    for s in range(3 * h):
        assert shift_one_pairs(n, s) == SHIFT_ONE[n][s % h]
        for r in range(n):
            assert shift_one_peer(shift_one_peer(r, n, s), n, s) == r


def test_odd_rank_count_is_a_clear_error():
    with pytest.raises(ValueError, match="even number") as flat:
        shift_one_peer(0, 5, 0)
    assert "hierarchical" not in str(flat.value)
    with pytest.raises(ValueError, match="hierarchical=True") as nodes:
        check_even(3, hierarchical=True)
    assert "3 node(s)" in str(nodes.value)


def test_gradient_algorithms_are_the_allreduce_settings():
    assert set(ALGORITHMS) == {"decentralized", "low_precision_decentralized", "async", "qadam"}
    with pytest.raises(ValueError, match="compression setting"):
        build("bytegrad", [], None)
    with pytest.raises(ValueError, match="unknown communication algorithm 'gossip'"):
        build("gossip", [], None)


def test_ring_neighbours():
    assert ring_neighbours(0, 4) == {3: 1, 1: 1}
    assert ring_neighbours(1, 2) == {0: 2}


# -- decentralized ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["all", "shift_one"])
@pytest.mark.parametrize("interval", [1, 2])
def test_decentralized_matches_a_plain_torch_distributed_reference(four, mode, interval):
    for rank in four:
        run, ref = rank[f"{mode}_{interval}"], rank[f"{mode}_{interval}_reference"]
        assert run["losses"] == ref["losses"]
        assert torch.equal(run["weights"], ref["weights"])
        assert run["describe"]["communications"] == len(range(0, 6, interval))


def test_all_leaves_every_rank_with_the_same_average(four):
    for step in range(len(four[0]["all_1"]["exchanges"])):
        before = torch.stack([r["all_1"]["exchanges"][step][0] for r in four])
        after = [r["all_1"]["exchanges"][step][1] for r in four]
        assert all(torch.equal(a, after[0]) for a in after)
        torch.testing.assert_close(after[0], before.mean(0))
    assert four[0]["all_1"]["describe"]["bytes_sent_per_step"] == 2 * 3 * 4 * 195 // 4


def test_shift_one_partners_hold_the_average_of_their_two_weights(four):
    for s in range(6):
        before = [r["shift_one_1"]["exchanges"][s][0] for r in four]
        after = [r["shift_one_1"]["exchanges"][s][1] for r in four]
        for a, b in SHIFT_ONE[4][s % 2]:
            assert torch.equal(after[a], after[b])
            assert torch.equal(after[a], (before[a] + before[b]) * 0.5)
    assert not torch.equal(four[0]["shift_one_1"]["weights"], four[1]["shift_one_1"]["weights"])


@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_hierarchical_averages_nodes_then_leaders(four, mode):
    """Two nodes of two ranks: node averages meet between the leaders, so each exchange gives
    every rank the average of all four (shift_one pairs the two leaders)."""
    before = torch.stack([r[f"hierarchical_{mode}"]["exchanges"][1][0] for r in four])
    after = [r[f"hierarchical_{mode}"]["exchanges"][1][1] for r in four]
    assert not torch.equal(before[0], before[1])
    for a in after:
        torch.testing.assert_close(a, before.mean(0))
    assert torch.equal(after[0], after[1]) and torch.equal(after[2], after[3])


def test_bad_input_names_the_cause(four):
    for rank in (0, 1, 2):
        assert "even number" in four[rank]["errors"]["odd"] and "3" in four[rank]["errors"]["odd"]
        assert "hierarchical" not in four[rank]["errors"]["odd"]
    assert "odd" not in four[3]["errors"]
    for rank in four:
        assert "hierarchical=True" in rank["errors"]["one_node"]
        assert "1 node(s)" in rank["errors"]["one_node"]


# -- low-precision decentralized ----------------------------------------------------------------------
def check_replicas_consistent(ranks, key, ranks_of=None):
    """Each ring member's weights are its own replica, and its neighbours' replicas of it are
    bit-for-bit that replica. ``ranks_of``: the global rank of each ring member."""
    runs = [rank if key is None else rank[key] for rank in ranks]
    ranks_of = ranks_of or list(range(len(runs)))
    run_of = dict(zip(ranks_of, runs))
    for i, run in enumerate(runs):
        assert torch.equal(run["weights"], run["replica"])
        expected = {ranks_of[j]: m for j, m in ring_neighbours(i, len(runs)).items()}
        assert set(run["neighbour_replicas"]) == set(expected)
        for peer, replica in run["neighbour_replicas"].items():
            assert torch.equal(replica, run_of[peer]["replica"])


def check_update(ranks, key, interval):
    """s_new = s + Q(z) with z = x + (left + right)/3 - 5 s/3, to within half an 8-bit step."""
    n = len(ranks)
    for r, rank in enumerate(ranks):
        for i, c in enumerate(rank[key]["communications"]):
            if i % interval:
                assert torch.equal(c["s_after"], c["s"])
                continue
            mix = sum(m / 3 * c["neighbours"][p] for p, m in ring_neighbours(r, n).items())
            z = c["x"] + mix - 5 / 3 * c["s"]
            bound = (z.max() - z.min()) / 510 + 1e-6
            assert (c["s_after"] - (c["s"] + z)).abs().max() <= bound


@pytest.mark.parametrize("interval", [1, 2])
def test_low_precision_replicas_stay_consistent(four, interval):
    check_replicas_consistent(four, f"low_precision_{interval}")
    check_update(four, f"low_precision_{interval}", interval)


def test_hierarchical_low_precision_runs_the_ring_over_node_leaders(four):
    """Two nodes of two ranks: leaders 0 and 2 form a ring of two; each node's ranks end equal."""
    runs = [r["hierarchical_low_precision"] for r in four]
    assert runs[1]["replica"] is None and runs[3]["replica"] is None
    check_replicas_consistent([runs[0], runs[2]], None, ranks_of=[0, 2])
    assert torch.equal(runs[0]["weights"], runs[1]["weights"]) and torch.equal(runs[2]["weights"], runs[3]["weights"])


def test_two_ranks_share_one_neighbour(tmp_path):
    pair = run_ranks("pair", 2, tmp_path, timeout=60)
    check_replicas_consistent(pair, "low_precision")
    check_update(pair, "low_precision", 1)
    assert torch.equal(pair[0]["shift_one"]["exchanges"][2][1], pair[1]["shift_one"]["exchanges"][2][1])


# -- QAdam ------------------------------------------------------------------------------------------
def test_qadam_warmup_is_torch_adam_bit_for_bit(four):
    for rank in four:
        run = rank["qadam_warmup"]
        assert run["qadam"]["losses"] == run["adam"]["losses"]
        assert torch.equal(run["qadam"]["weights"], run["adam"]["weights"])


@pytest.mark.parametrize("kind", ["adam", "adamw", "optimizer"])
def test_qadam_after_warmup_uses_the_switch_gradient_and_weight_decay(four, kind):
    for rank in four:      # the reference writes the update out in another order: float32 rounding apart
        run = rank[f"qadam_{kind}"]
        as_float32 = lambda losses: torch.tensor(losses, dtype=torch.float32)  # noqa: E731
        torch.testing.assert_close(as_float32(run["qadam"]["losses"]), as_float32(run["reference"]["losses"]))
        torch.testing.assert_close(run["qadam"]["weights"], run["reference"]["weights"])


def test_qadam_8bit_momentum_keeps_replicas_identical(four):
    assert all(torch.equal(r["qadam_compressed"]["weights"], four[0]["qadam_compressed"]["weights"]) for r in four)
    describe = four[0]["qadam_compressed"]["describe"]
    assert describe["phase"] == "compressing" and describe["bytes_sent"] > 0


# -- accuracy -----------------------------------------------------------------------------------------
def test_every_algorithm_learns_digits_as_well_as_ddp(four):
    runs = four[0]["digits"]
    acc = {name: run["accuracy"] for name, run in runs.items()}
    assert acc["ddp"] > 90, acc
    for name, value in acc.items():
        assert value >= acc["ddp"] - 1.5, (name, acc)
        if runs[name]["describe"] is not None:
            assert runs[name]["describe"]["bytes_sent"] > 0, runs[name]["describe"]


# -- async --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["warmup", "cycles", "uneven", "destroy"])
def test_async_ranks_exit_cleanly(tmp_path, schedule):
    ranks = run_ranks(f"async_{schedule}", 2, tmp_path, timeout=60)
    for rank in ranks:
        assert rank["synced"][:10] == [True] * 10 and not any(rank["synced"][10:])
        assert "error" not in rank["describe"], rank["describe"]
    # (with uneven steps rank 0 stops as warm-up ends: it averages only while it exits)
    assert ranks[1]["describe"]["averaging_rounds"] > 0, ranks[1]["describe"]
    if schedule in ("warmup", "cycles"):      # abort()'s last round leaves everyone the average
        assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
