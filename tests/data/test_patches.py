"""The data patches on unchanged programs: which datasets the cache serves and which it leaves
alone, training unchanged either way, a cache that outlives the run and is never stale, the
DistributedSampler replaced, and DataLoader restored exactly."""

import json
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from autopatch.data import LoadBalancingDistributedSampler
from autopatch.data.zero_code.patches import DataPatches
from autopatch.policy import cache_backend
from spawn import clean_env, run_python, spawn_two_ranks, write_script
from data_fixtures import (Features, NumpyAugmented, PythonAugmented, Stream, TorchAugmented, policy_for, run_job,
                           same_batches)


@pytest.fixture
def data_patches(tmp_path):
    """Install with the local store in a fresh directory; uninstall however the test ends."""
    installed = []

    def install(**settings):
        patches = DataPatches(**{"cache": "1", "path": tmp_path / "cache", **settings})
        patches.install()
        installed.append(patches)
        return patches

    yield install
    for patches in installed:
        patches.uninstall()


def rng_states():
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())


def train(datasets, epochs=2):
    """A seeded model trained on every dataset in turn, through 2 workers; its weights."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loaders = [DataLoader(d, batch_size=8, shuffle=True, num_workers=2) for d in datasets]
    for _ in range(epochs):
        for loader in loaders:
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    return [p.detach().clone() for p in model.parameters()], loaders


def test_cached_and_augmented_datasets_train_as_unpatched(data_patches):
    datasets = [Features(48), TorchAugmented(48), NumpyAugmented(48), PythonAugmented(48)]
    plain, _ = train(datasets)
    patches = data_patches()
    patched, loaders = train(datasets)
    assert all(torch.equal(a, b) for a, b in zip(plain, patched))
    report = patches.describe()["cache"]
    assert [d["dataset"] for d in report["datasets"]] == ["data_fixtures.Features"]
    assert report["hits"] > 0 and report["errors"] == 0
    assert sorted(u["dataset"] for u in report["uncached"]) == \
        ["data_fixtures.NumpyAugmented", "data_fixtures.PythonAugmented", "data_fixtures.TorchAugmented"]
    assert all("differs between loads" in u["reason"] for u in report["uncached"])
    assert loaders[0].dataset.n == 48 and isinstance(loaders[0].dataset, Features)   # looks like itself
    assert loaders[1].dataset is datasets[1]


def test_probing_leaves_every_random_state_as_it_was(data_patches):
    data_patches()
    before = rng_states()
    DataLoader(TorchAugmented(16))
    DataLoader(Features(16))
    after = rng_states()
    assert before[0] == after[0] and before[1] == after[1] and torch.equal(before[2], after[2])


def test_iterable_and_cheap_datasets_left_alone_with_the_reason(data_patches):
    patches = data_patches()
    stream, tensors = Stream(), TensorDataset(torch.arange(64.0))
    assert DataLoader(stream).dataset is stream
    assert DataLoader(tensors, batch_size=4).dataset is tensors
    reasons = {u["dataset"]: u["reason"] for u in patches.describe()["cache"]["uncached"]}
    assert "no index" in reasons["data_fixtures.Stream"]
    assert "would not pay" in reasons["torch.utils.data.dataset.TensorDataset"]


def test_a_sample_that_changes_during_the_run_turns_the_cache_off(data_patches):
    patches = data_patches()
    dataset = Features(16)
    loader = DataLoader(dataset, batch_size=4)
    list(loader)
    dataset.version = 7   # the program changes its data between epochs
    fresh = [x for x, _ in DataLoader(Features(16, version=7), batch_size=4)]
    assert all(torch.equal(a, b) for (a, _), b in zip(loader, fresh))
    assert "changed since it was cached" in patches.describe()["cache"]["datasets"][0]["bypassed"]


def test_install_and_uninstall_restore_dataloader_exactly(tmp_path):
    originals = {k: vars(DataLoader)[k] for k in ("__init__", "__iter__")}
    patches = DataPatches(cache="local", path=tmp_path / "c", balance="len")
    patches.install()
    assert vars(DataLoader)["__init__"] is not originals["__init__"]
    dataset = Features(16)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0)
    during = DataLoader(dataset, batch_size=4, sampler=sampler)
    patches.uninstall()
    assert {k: vars(DataLoader)[k] for k in originals} == originals
    after = DataLoader(dataset, batch_size=4, sampler=sampler)
    assert after.dataset is dataset and after.sampler is sampler
    assert list(during.sampler) == list(sampler)   # handed back to the user's own sampler
    assert patches.describe()["cache"]["datasets"][0]["bypassed"] == "autopatch was disabled"


class Ragged(Features):
    def __getitem__(self, i):
        return torch.zeros(1 + (i * 5) % 13), i


def test_distributed_sampler_replaced_and_set_epoch_on_the_users_object(data_patches):
    patches = data_patches(cache=None, balance="len")
    dataset = Ragged(30)
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=r, seed=4) for r in range(2)]
    loaders = [DataLoader(dataset, batch_size=3, sampler=s, collate_fn=list) for s in samplers]
    lengths = [float(1 + (i * 5) % 13) for i in range(30)]
    orders = {}
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)   # on the user's own objects, as training loops do
        orders[epoch] = [list(loader.sampler) for loader in loaders]
        for rank in range(2):
            same = LoadBalancingDistributedSampler(dataset, None, 2, rank, seed=4, batch_size=3, complexities=lengths)
            same.set_epoch(epoch)
            assert orders[epoch][rank] == list(same)
        assert sorted(orders[epoch][0] + orders[epoch][1]) == list(range(30))
    assert orders[0] != orders[1]
    report = patches.describe()["balance"]
    assert [s["rank"] for s in report["samplers"]] == [0, 1]
    spread = report["samplers"][0]["complexity_max_over_mean"]
    assert spread["balanced"]["steps"] == spread["distributed_sampler"]["steps"] == 5
    assert spread["balanced"]["worst"] < spread["distributed_sampler"]["worst"]


def test_distributed_sampler_subclasses_are_left_alone(data_patches):
    patches = data_patches(cache=None, balance="len")

    class Mine(DistributedSampler):
        pass

    dataset = Features(8)
    sampler = Mine(dataset, num_replicas=2, rank=1)
    assert DataLoader(dataset, sampler=sampler).sampler is sampler
    assert "subclass" in patches.describe()["balance"]["left_alone"][0]["reason"]


def test_settings_are_checked_at_once():
    assert [cache_backend(v) for v in (None, "0", "1", True, "redis", "redis://h:1")] == \
        [None, None, "local", "local", "redis", "redis://h:1"]
    with pytest.raises(ValueError):
        DataPatches(cache="memcached")
    with pytest.raises(ValueError):
        DataPatches(balance="not a function")


RUN = """
import json, sys
import torch
from torch.utils.data import DataLoader
from data_fixtures import Features

dataset = Features(40, version=int(sys.argv[1]))
seen = torch.cat([x for x, _ in DataLoader(dataset, batch_size=8, num_workers=2)])
plain = torch.cat([Features(40, version=int(sys.argv[1]))[i][0][None] for i in range(40)])
print(json.dumps({"equal": torch.equal(seen, plain)}))
"""


def test_a_second_run_reads_the_cache_and_a_changed_dataset_does_not(tmp_path, installed):
    """Zero-code: the program knows nothing of autopatch; FUSEDOPT_DATA_CACHE=1 serves its
    DataLoader through the local store (here in a fresh directory the policy names)."""
    script = write_script(tmp_path / "run.py", RUN)
    policy = tmp_path / "cache.yaml"
    policy.write_text(f"data:\n  cache:\n    path: {tmp_path / 'cache'}\n")
    runs = []
    for version in (1, 1, 2):
        report = tmp_path / f"report{len(runs)}.json"
        env = clean_env(OMP_NUM_THREADS=1, FUSEDOPT_ENABLE=1, FUSEDOPT_DATA_CACHE=1, FUSEDOPT_POLICY=policy,
                        FUSEDOPT_REPORT=report)
        done = run_python([script, version], env=env)
        assert done.returncode == 0, done.stderr
        cache = json.loads(report.read_text())["data"]["cache"]
        runs.append(dict(json.loads(done.stdout.strip().splitlines()[-1]), **cache["datasets"][0]))
    cold, warm, changed = runs
    assert all(r["equal"] for r in runs)
    assert (cold["misses"], warm["misses"], warm["hits"]) == (40, 0, 40)   # nothing the probe loaded is stored
    assert changed["misses"] == 40 and changed["hits"] == 0


def test_two_ranks_share_redis_and_train_on_balanced_samplers(tmp_path_factory):
    results, outputs, codes = spawn_two_ranks("data_worker.py", "zero_code", tmp_path_factory, timeout=150)
    assert codes == [0, 0] and len(results) == 2, "\n".join(outputs)
    r0, r1 = results[0], results[1]
    assert r0["urls"] == r1["urls"] and len(r0["urls"]) == 1   # one node: rank 0's server
    password = r0["urls"][0].split("@")[0].rpartition(":")[2]
    assert len(password) >= 32 and "@" not in r0["published"] and password not in r0["published"]   # never sent
    assert r0["sampler"] == "FollowingSampler"
    for epoch in (0, 1):
        both = r0["epochs"][epoch] + r1["epochs"][epoch]
        assert len(r0["epochs"][epoch]) == len(r1["epochs"][epoch]) == 20 and sorted(both) == list(range(40))
    assert r0["epochs"][0] != r0["epochs"][1]
    cache = [r["report"]["cache"] for r in (r0, r1)]
    assert all(c["backend"] == "redis" and c["errors"] == 0 for c in cache)
    assert sum(c["hits"] for c in cache) >= 40   # epoch 2 (and scoring) read what was written
    import redis
    with pytest.raises(redis.ConnectionError):   # rank 0 stopped its server at exit
        redis.Redis.from_url(r0["urls"][0], socket_connect_timeout=1).ping()


def test_cached_samples_are_what_the_loader_loads_where_it_runs(tmp_path, installed):
    """Workers run one torch thread, the main process several, and a float32 sum rounds with the
    number of threads: cold and warm epochs through 2 workers, and a loader without workers on
    the same cache, each equal to its unpatched run bit for bit."""
    policy = policy_for(tmp_path, tmp_path / "cache")
    common = ["--dataset", "ThreadSensitive", "--n", "32", "--threads", "2"]
    plain = run_job(tmp_path / "plain.pt", *common)
    plain_main = run_job(tmp_path / "plain0.pt", *common, "--workers", "0")
    assert not same_batches(plain, plain_main)   # the dataset really depends on where it loads
    cold = run_job(tmp_path / "cold.pt", *common, cache="1", FUSEDOPT_POLICY=policy)
    warm = run_job(tmp_path / "warm.pt", *common, cache="1", FUSEDOPT_POLICY=policy)
    main = run_job(tmp_path / "main.pt", *common, "--workers", "0", cache="1", FUSEDOPT_POLICY=policy)
    assert same_batches(cold, plain) and same_batches(warm, plain) and same_batches(main, plain_main)
    figures = [r["report"]["cache"]["datasets"][0] for r in (cold, warm, main)]
    assert [(f["hits"], f["misses"]) for f in figures] == [(32, 32), (64, 0), (32, 32)], figures


def test_a_dataset_with_its_own_generator_draws_as_unpatched(tmp_path, installed):
    """The probe loads from a copy that shares the dataset's generator: it must put it back."""
    plain = run_job(tmp_path / "plain.pt", "--dataset", "OwnGenerator", "--workers", "0")
    patched = run_job(tmp_path / "patched.pt", "--dataset", "OwnGenerator", "--workers", "0", cache="1",
                      FUSEDOPT_POLICY=policy_for(tmp_path, tmp_path / "cache"))
    assert same_batches(plain, patched)
    assert "differs between loads" in patched["report"]["cache"]["uncached"][0]["reason"]


def test_a_change_outside_the_signature_is_found_and_never_served(tmp_path, installed):
    """Version 1 and 2 share the samples the signature loads and differ everywhere else: the
    second run's first epoch rechecks other samples, finds them changed, drops the entries and
    serves the dataset uncached."""
    from autopatch.data.probe.signature import spread_indices
    base = ",".join(map(str, spread_indices(48)))
    policy = policy_for(tmp_path, tmp_path / "cache")
    first = run_job(tmp_path / "v1.pt", "--dataset", "Patched", "--base", base, "--version", "1", cache="1",
                    FUSEDOPT_POLICY=policy)
    assert first["report"]["cache"]["datasets"][0]["misses"] == 48
    plain = run_job(tmp_path / "plain.pt", "--dataset", "Patched", "--base", base, "--version", "2")
    second = run_job(tmp_path / "v2.pt", "--dataset", "Patched", "--base", base, "--version", "2", cache="1",
                     FUSEDOPT_POLICY=policy)
    assert same_batches(plain, second)
    figures = second["report"]["cache"]["datasets"][0]
    assert figures["name"] == first["report"]["cache"]["datasets"][0]["name"]   # one signature
    assert "changed since it was cached" in figures["bypassed"] and figures["hits"] == 0, figures


def test_every_sample_is_rechecked_within_a_cycle_of_epochs():
    from autopatch.data.probe.signature import RECHECK_SAMPLES, recheck_indices
    for n in (1, 7, 48, 1000):
        epochs = -(-n // RECHECK_SAMPLES)
        seen = [i for e in range(epochs) for i in recheck_indices(n, b"\x07" * 16, e)]
        assert sorted(set(seen)) == list(range(n)) and len(seen) == n
        assert recheck_indices(n, b"\x07" * 16, 0) != recheck_indices(n, b"\x07" * 16, 1) or n <= RECHECK_SAMPLES


def test_ranks_that_would_decide_differently_share_one_decision(tmp_path_factory):
    """Lengths from a generator seeded by the rank: without one set of scores, ranks deal
    differently and samples are skipped and repeated. A dataset slow on rank 0 only: without one
    decision, rank 0 caches it and rank 1 does not."""
    results, outputs, codes = spawn_two_ranks("data_worker.py", "agreement", tmp_path_factory, timeout=150)
    assert codes == [0, 0] and len(results) == 2, "\n".join(outputs)
    r0, r1 = results[0], results[1]
    for epoch in (0, 1):
        both = r0["epochs"][epoch] + r1["epochs"][epoch]
        assert sorted(both) == list(range(40)), both   # every sample once
    notes = [r["report"]["balance"]["samplers"][0]["scores"] for r in (r0, r1)]
    assert sum("every rank uses" in n for n in notes) == 1 and sum("scored first" in n for n in notes) == 1, notes
    caches = [r["report"]["cache"] for r in (r0, r1)]
    assert r0["cached_type"] == r1["cached_type"]
    decided = [c["datasets"][0]["decided"] if c["datasets"] else c["uncached"][0]["reason"] for c in caches]
    assert sum("the job's decision" in d for d in decided) == 1, decided
