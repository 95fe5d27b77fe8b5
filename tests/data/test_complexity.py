"""A cost function named by a string (``FUSEDOPT_DATA_BALANCE``, a policy's ``data.load_balance``)
is checked before it is called: ``len``, a function of the program's own already imported, or a
callable passed from Python; anything else leaves the user's sampler, with the reason, and never
breaks ``import torch``."""

import json
import sys

import pytest

from autopatch.data.sampling.complexity import UntrustedComplexity, complexity_function, sequence_length
from spawn import clean_env, run_python, write_script


def test_what_may_be_called(tmp_path, monkeypatch):
    assert complexity_function("len") is sequence_length
    assert complexity_function(len) is len   # a callable given from Python is the program's own choice
    (tmp_path / "costs_of_mine.py").write_text("from os import system\n\ndef tokens(sample):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UntrustedComplexity, match="has not imported"):
        complexity_function("costs_of_mine:tokens")   # not imported by the program: never imported here
    assert "costs_of_mine" not in sys.modules
    import costs_of_mine
    assert complexity_function("costs_of_mine:tokens") is costs_of_mine.tokens
    refused = {"costs_of_mine:system": "comes from 'posix'", "costs_of_mine:nothing": "has no 'nothing'",
               "os:system": "standard library", "builtins:eval": "standard library",
               "subprocess:run": "standard library", "torch:numel": "not a Python function"}
    for spec, why in refused.items():
        with pytest.raises(UntrustedComplexity, match=why):
            complexity_function(spec)


PROGRAM = """
import json, sys
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

class Commands(Dataset):
    '''Samples that are shell commands: a cost function os:system would run them.'''
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return f"touch {sys.argv[1]}-{i}"

loader = DataLoader(Commands(), batch_size=2, sampler=DistributedSampler(Commands(), num_replicas=2, rank=0))
items = [x for batch in loader for x in batch]
import autopatch
print(json.dumps({"sampler": type(loader.sampler).__name__, "items": len(items),
                  "balance": autopatch.report()["data"]["balance"]}))
"""


@pytest.mark.parametrize("spec", ["no_such_module:cost", "json_costs:cost"])
def test_a_bad_name_is_a_warning_and_the_users_sampler(spec, tmp_path, installed):
    """What only the running program shows (the module was never imported) leaves its sampler."""
    script = write_script(tmp_path / "program.py", PROGRAM)
    marker = tmp_path / "ran"
    done = run_python([script, marker], env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_DATA_BALANCE=spec))
    assert done.returncode == 0, done.stderr   # import torch, DataLoader and training all went on
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sampler"] == "DistributedSampler" and out["items"] == 4
    reason = out["balance"]["left_alone"][0]["reason"]
    assert "is not called" in reason and "is not called" in done.stderr
    assert not list(tmp_path.glob("ran-*"))


@pytest.mark.parametrize("spec", ["os:system", "builtins:eval"])
def test_a_policy_naming_the_standard_library_is_refused_before_the_program_runs(spec, tmp_path, installed):
    """What the name alone shows is the policy check's: one error, with file, line and key."""
    script = write_script(tmp_path / "program.py", PROGRAM)
    policy = tmp_path / "theirs.yaml"
    policy.write_text(f"data:\n  load_balance: {spec}\n")
    done = run_python([script, tmp_path / "ran"], env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_POLICY=policy))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"autopatch: invalid policy: {policy}:2: key 'data.load_balance': ")
    assert "standard library" in done.stderr
    assert not list(tmp_path.glob("ran-*"))


def test_a_function_of_the_program_balances(tmp_path, installed):
    (tmp_path / "my_costs.py").write_text("def cost(sample):\n    return len(sample)\n")
    script = write_script(tmp_path / "program.py", "import my_costs\n" + PROGRAM)
    done = run_python([script, tmp_path / "ran"], env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_DATA_BALANCE="my_costs:cost",
                                                                PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}"),
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sampler"] == "FollowingSampler" and out["items"] == 4 and out["balance"]["complexity"] == "my_costs:cost"
