"""disable() leaves torch as it was under every builtin policy: after a step with a DDP model, a
DataLoader and Bagua's ``model.with_bagua``, every class and module autopatch patches holds the
same objects under the same names as before the first enable(), the one ledger of patches
(autopatch/patches/ledger.py) holds nothing, and while enabled everything that differed from
torch's own was recorded in that ledger (a patch made anywhere else fails here).

One subprocess runs every policy in turn (support/restores_torch_worker.py): ``import
autopatch.contrib.bagua`` patches only the first time a process runs it, which a test process
that imported it before cannot show.
"""

import json

import pytest

from autopatch.policy import builtin_names
from spawn import SUPPORT, clean_env, run_python

CASES = [*builtin_names(), "data"]


@pytest.fixture(scope="module")
def leftovers(tmp_path_factory):
    """{case: what of torch differs after its disable()}."""
    done = run_python([SUPPORT / "restores_torch_worker.py", tmp_path_factory.mktemp("restores")],
                      env=clean_env(OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME="lo"), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_disable_leaves_torch_as_it_was(leftovers, case):
    assert leftovers[case] == []
