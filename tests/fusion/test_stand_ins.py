"""What code reading an optimizer's param groups inside a fused step sees through ``stand_ins``:
the user's list and the parameters behind each chunk, during the step only, however it ends."""

import pytest
import torch
from torch import nn

from autopatch.stand_ins import stands_for, user_params


class Seeing(torch.optim.SGD):
    """SGD that records, inside each step, what its first group holds and what stand_ins says;
    raises in the step numbered ``fail_at``."""

    def __init__(self, params, fail_at=None):
        super().__init__(params, lr=0.1)
        self.seen, self.fail_at, self.calls = [], fail_at, 0

    def step(self, closure=None):
        self.calls += 1
        group = self.param_groups[0]
        self.seen.append((ids(group["params"]), ids(user_params(group)),
                          {id(p) for t in group["params"] for p in stands_for(t)}))
        if self.calls == self.fail_at:
            raise RuntimeError("the user's step failed")
        return super().step(closure)


def ids(tensors):
    return [id(t) for t in tensors]


def train(opt, model, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(4, 8)).square().mean().backward()
        try:
            opt.step()
        except RuntimeError as e:
            assert "the user's step failed" in str(e)


@pytest.mark.parametrize("fail_at", [None, 4])
def test_inside_a_fused_step_the_users_list_and_the_parameters_behind_the_chunks(ap, fail_at):
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    users = list(model.parameters())
    mine = ids(users)
    opt = Seeing(users, fail_at=fail_at)
    ap.enable(mode="multi_layer", chunk_bytes=1024)
    train(opt, model, 6)
    fused = [(listed, behind) for held, listed, behind in opt.seen if held != mine]
    assert len(fused) >= 3, opt.seen
    assert fail_at is None or opt.seen[fail_at - 1][0] != mine     # it raised inside a fused step
    for listed, behind in fused:
        assert listed == mine                      # the user's list, in the user's order
        assert behind == set(mine)                 # every parameter behind the chunks, none else
    group = opt.param_groups[0]
    assert ids(group["params"]) == mine and user_params(group) is group["params"]
    group["params"] = replaced = list(users)       # nothing kept from a step that ended, or raised
    assert user_params(group) is replaced
