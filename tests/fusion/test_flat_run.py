"""FlatRun: parameters moved into one buffer keep their values, chunks are cut where promised, and
optimizer state moves in and back out per parameter."""

import torch

from autopatch.fusion.flat_run import FlatRun, state_signature
from autopatch.stand_ins import stands_for


def params(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def test_parameters_become_views_of_one_buffer_with_their_values():
    ps = params((3, 4), (5,), (2, 2))
    before = [p.detach().clone() for p in ps]
    run = FlatRun(ps, None, chunk_elems=100)
    assert run.numel == 21 and run.flat.numel() == 21
    base = run.flat.untyped_storage().data_ptr()
    for p, b in zip(ps, before):
        assert p.untyped_storage().data_ptr() == base
        assert torch.equal(p, b) and p.shape == b.shape
    run.flat.add_(1)                      # an update of the buffer is an update of the parameters
    assert all(torch.equal(p, b + 1) for p, b in zip(ps, before))


def test_chunks_group_small_parameters_and_cut_large_ones_into_their_own():
    ps = params((4,), (4,), (25,), (3,))
    run = FlatRun(ps, None, chunk_elems=10)
    # 4+4 share a chunk; the 25-element parameter gets 3 equal chunks of its own; 3 is alone after it
    assert run.chunk_bounds == [(0, 8), (8, 16), (16, 24), (24, 33), (33, 36)]
    assert run.chunk_spans == [(0, 2), (2, 3), (2, 3), (2, 3), (3, 4)]
    assert all(c.data_ptr() == run.flat[s:e].data_ptr() for c, (s, e) in zip(run.chunks, run.chunk_bounds))


def test_a_chunk_stands_for_the_parameters_it_spans_and_any_other_tensor_for_itself():
    ps = params((4,), (4,), (25,), (3,))
    run = FlatRun(ps, None, chunk_elems=10)
    assert [tuple(map(id, stands_for(c))) for c in run.chunks] == \
        [(id(ps[0]), id(ps[1]))] + [(id(ps[2]),)] * 3 + [(id(ps[3]),)]
    assert stands_for(ps[0])[0] is ps[0] and len(stands_for(ps[0])) == 1


def test_aligned_chunks_keep_every_parameter_whole():
    ps = params((4,), (4,), (25,), (3,))
    run = FlatRun(ps, None, chunk_elems=10, align=True)
    assert run.chunk_bounds == [(0, 8), (8, 33), (33, 36)]


def test_state_moves_into_flat_buffers_and_chunk_updates_come_back_per_parameter():
    ps = params((3,), (2, 2))
    states = [{"step": torch.tensor(2.0), "exp_avg": torch.full(p.shape, float(i)), "lr_seen": 0.1}
              for i, p in enumerate(ps)]
    run = FlatRun(ps, states, chunk_elems=100)
    assert set(run.flat_state) == {"exp_avg"} and set(run.scalar_state) == {"step"}
    assert torch.equal(run.flat_state["exp_avg"], torch.tensor([0.0, 0, 0, 1, 1, 1, 1]))
    cs = run.chunk_states[0]
    cs["exp_avg"].mul_(3).add_(1)         # what an optimizer does to the chunk's state
    cs["step"] = cs["step"] + 1
    by_param = dict(zip(map(id, ps), states))
    assert run.sync(lambda p: by_param[id(p)]) is None
    assert torch.equal(states[0]["exp_avg"], torch.ones(3)) and torch.equal(states[1]["exp_avg"], torch.full((2, 2), 4.0))
    assert [float(st["step"]) for st in states] == [3.0, 3.0]
    assert all(st["lr_seen"] == 0.1 for st in states)


def test_state_that_is_not_elementwise_is_refused_by_sync():
    ps = params((3,), (3,))
    run = FlatRun(ps, None, chunk_elems=100)
    run.chunk_states[0]["norm"] = torch.zeros(2)       # a per-tensor statistic
    assert "not elementwise" in run.sync(lambda p: {})


def test_a_moved_parameter_is_noticed_and_an_earlier_buffer_is_reused():
    ps = params((3,), (4,))
    first = FlatRun(ps, None, chunk_elems=100)
    again = FlatRun(ps, None, chunk_elems=100)          # already back to back: no copy, same storage
    assert again.flat.data_ptr() == first.flat.data_ptr()
    assert again.is_intact()
    ps[1].data = torch.zeros(4)
    assert not again.is_intact()


def test_state_signature_tells_which_parameters_may_share_a_run():
    p = params((3,))[0]
    assert state_signature(p, {}) == ()
    full = state_signature(p, {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)})
    assert full == (("exp_avg", "full", torch.float32), ("step", "scalar", torch.float32, 1.0))
    assert state_signature(p, {"exp_avg": torch.zeros(2)}) is None          # not parameter-sized
    assert state_signature(p, {"history": []}) is None                      # unhashable python state
