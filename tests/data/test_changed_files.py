"""A file a dataset reads, rewritten after its sample was cached, is served as it is now: in the
next run, and in the next epoch of the same run. Zero-code runs of ``data_job.py`` through 2
DataLoader workers and the local store, each compared with an unpatched run of the same files."""

import os

import pytest

from autopatch.data.probe import dataset_files
from autopatch.data.probe.dataset_files import DatasetFiles
from autopatch.data.probe.signature import dataset_signature, recheck_indices, spread_indices
from data_fixtures import Files, Folder, policy_for, run_job, same_batches, sample_bytes, write_samples

N, CHANGED = 96, 50


def job(tmp_path, out, root, *options, **kw):
    return run_job(tmp_path / out, "--root", root, "--n", N, "--epochs", 3, "--workers", 2, *options, **kw)


def test_the_changed_sample_is_outside_the_signature():
    assert CHANGED not in spread_indices(N)


@pytest.mark.parametrize("dataset", ["Files", "Folder"])
def test_a_file_rewritten_between_runs_is_served_new(dataset, tmp_path, installed):
    """Run 1 fills the cache; sample 50's file is rewritten (same size); run 2 serves its new bytes
    in all three epochs."""
    root = tmp_path / "data"
    paths = write_samples(root, N, name="sample_{i}.bin" if dataset == "Files" else "class_{c}/sample_{i}.bin")
    changed = paths[CHANGED] if dataset == "Files" else sorted(map(str, paths))[CHANGED]
    policy = policy_for(tmp_path, tmp_path / "cache")
    options = ("--dataset", dataset)
    first = job(tmp_path, "first.pt", root, *options, cache="1", FUSEDOPT_POLICY=policy)
    old = first["report"]["cache"]["datasets"][0]
    assert old["misses"] == N and old["hits"] == 2 * N, old   # epochs 2 and 3 came from the cache
    plain_before = job(tmp_path, "plain_before.pt", root, *options)
    with open(changed, "r+b") as f:
        new = bytes(reversed(f.read()))
        f.seek(0)
        f.write(new)
    plain = job(tmp_path, "plain.pt", root, *options)
    assert not same_batches(plain, plain_before)   # the change is one the training sees
    second = job(tmp_path, "second.pt", root, *options, cache="1", FUSEDOPT_POLICY=policy)
    assert same_batches(second, plain)
    figures = second["report"]["cache"]["datasets"][0]
    assert figures["name"] != old["name"] and figures["misses"] == N, figures   # cached afresh


def test_a_file_rewritten_between_epochs_is_served_new(tmp_path, installed):
    """Epoch 1 fills the cache, then the program rewrites the file of a sample that neither the
    signature nor the next epochs' sample rechecks load: epochs 2 and 3 load it as it is now."""
    for name in ("plain", "patched"):
        write_samples(tmp_path / name, N)
    signature = dataset_signature(Files(str(tmp_path / "patched"), N))   # as the run will find it
    looked_at = {*spread_indices(N), *(i for epoch in range(3) for i in recheck_indices(N, signature, epoch))}
    changed = CHANGED if CHANGED not in looked_at else min(set(range(N)) - looked_at)
    source = tmp_path / "new.bin"
    source.write_bytes(sample_bytes(changed, version=1))
    runs = {}
    for name, cache in (("plain", None), ("patched", "1")):
        root = tmp_path / name
        env = {} if cache is None else {"FUSEDOPT_POLICY": policy_for(tmp_path, tmp_path / "cache")}
        runs[name] = job(tmp_path, f"{name}.pt", root, "--dataset", "Files",
                         "--rewrite", f"{root / f'sample_{changed}.bin'}={source}", cache=cache, **env)
    assert same_batches(runs["patched"], runs["plain"])
    figures = runs["patched"]["report"]["cache"]["datasets"][0]
    assert figures["name"].endswith(signature.hex()[:16]), figures
    assert f"sample_{changed}.bin' changed" in figures["bypassed"], figures


def test_what_a_dataset_names_is_found(tmp_path):
    paths = write_samples(tmp_path / "d", 4, name="c{c}/s{i}.bin")
    folder = DatasetFiles.named_by(Folder(tmp_path / "d"))
    assert sorted(folder.paths) == sorted(map(str, paths))
    walked = DatasetFiles.named_by(Files(str(tmp_path / "d"), 4))   # the root, its directories, their files
    assert set(walked.paths) == {str(tmp_path / "d"), *(str(p.parent) for p in paths), *map(str, paths)}
    assert DatasetFiles.named_by(Files("not/a/directory", 4)).paths == ()


def test_a_check_stats_a_bounded_number_of_files_and_finds_every_change(tmp_path, monkeypatch):
    """Past the bound, a fixed spread is checked every time and the rest a block at a time: a
    change anywhere is found within a cycle of blocks, and no check stats more than the bound."""
    monkeypatch.setattr(dataset_files, "STATS_PER_CHECK", 8)
    paths = [str(p) for p in write_samples(tmp_path, 40)]
    stats = []
    stat = os.stat
    monkeypatch.setattr(os, "stat", lambda *a, **k: stats.append(a[0]) or stat(*a, **k))
    cycle = -(-(40 - 4) // 4)   # 4 fixed files, the other 36 in blocks of 4
    for index, found in ((0, f"file {paths[0]!r} changed"), (17, "one of the files")):
        files = DatasetFiles(paths)
        files.fingerprint()
        per_check = []
        for _ in range(cycle):   # every block seen once
            before = len(stats)
            assert files.changed() is None
            per_check.append(len(stats) - before)
        assert per_check == [8] * cycle and set(stats) == set(paths)
        os.utime(paths[index], ns=(1, 1))
        said = [files.changed() for _ in range(cycle)]
        assert any(s and s.startswith(found) for s in said), said
