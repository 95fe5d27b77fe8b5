"""Two nodes as a user's cluster has them: two network namespaces joined by a veth link, torchrun
on each, nodes with different numbers of processes. One node identity for every room: the
hierarchical algorithms and the Redis cache (a server per node) agree on the nodes, and the report
says the topology and each model's settings as they run."""

import json
import os
import shutil

import pytest

from spawn import SUPPORT, clean_env, patience

netns = pytest.importorskip("harness.netns")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("redis-server"),
                                reason="needs root (network namespaces), iproute2 and redis-server")
JOB = SUPPORT / "two_node_job.py"


def run(tmp_path, policy, cache="redis", procs=(2, 1)):
    env = clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_POLICY=policy, FUSEDOPT_DATA_CACHE=cache,
                    FUSEDOPT_REPORT=str(tmp_path / "report-{rank}.json"), OMP_NUM_THREADS=1)
    with netns.two_nodes(rate="1gbit") as nodes:
        ends = nodes.torchrun(JOB, procs, env, timeout=patience(180), args=[tmp_path])
    for node, (code, text) in enumerate(ends):
        assert code == 0, f"node {node}:\n{text[-4000:]}"
    world = sum(procs)
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(world)]
    runs = [json.loads((tmp_path / f"losses-{r}.json").read_text()) for r in range(world)]
    return reports, runs


def test_uneven_nodes_share_one_topology_and_the_redis_cache(tmp_path):
    """Two processes on one node, one on the other: bytegrad reduces hierarchically and says so;
    each node's Redis server is found by every rank, so every rank reads its second epoch from the
    cache (a rank that waited for a third server used to run uncached, 120 s late)."""
    reports, runs = run(tmp_path, "bytegrad")
    for r, rep in enumerate(reports):
        ar = rep["allreduce"]
        assert ar["topology"] == {"nodes": 2, "ranks_per_node": [2, 1], "leaders": [0, 2]}, ar
        assert ar["hierarchical"] is True and ar["algorithm"]["settings"]["hierarchical"] is True, ar
        assert all(m["hierarchical"] for m in ar["models"])
        cache = rep["data"]["cache"]
        assert cache["datasets"] and not cache["uncached"], cache
        assert cache["hits"] > 0 and cache["errors"] == 0, cache
    assert max(r["seconds"] for r in runs) < 60, runs


def test_a_weight_algorithm_runs_over_the_node_leaders(tmp_path):
    """Decentralized on two uneven nodes: each node averages onto its leader, the leaders exchange;
    the report names the nodes and the effective settings of the model."""
    reports, _ = run(tmp_path, "decentralized", cache="0")
    for rep in reports:
        ar = rep["allreduce"]
        assert ar["topology"]["leaders"] == [0, 2]
        assert ar["algorithm"]["settings"]["hierarchical"] is True and ar["hierarchical"] is True, ar
