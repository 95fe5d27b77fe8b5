"""The run-time setters of the session's handles take what the policy setting they change takes,
checked by that setting's declaration: a chunk or bucket size ``fusion.chunk_bytes`` or
``allreduce.bucket_bytes`` would refuse is refused in the same words, and changes nothing."""

import pytest
import torch
import torch.nn.parallel  # noqa: F401  (the gradient sync's handle exists once DDP is imported)

from training import batches, mlp, train


def test_set_chunk_bytes_takes_what_fusion_chunk_bytes_takes(ap):
    session = ap.enable("multi_layer")
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    handle = session.optimizer(opt)
    train(model, opt, batches(2))
    before = handle.chunk_bytes
    with pytest.raises(ValueError, match=r"^fusion\.chunk_bytes: must be at least 1024 bytes, got 512$"):
        handle.set_chunk_bytes(512)
    with pytest.raises(TypeError, match=r"^fusion\.chunk_bytes: expected a byte count"):
        handle.set_chunk_bytes(4.5)
    train(model, opt, batches(1))
    assert handle.chunk_bytes == before
    handle.set_chunk_bytes("1KiB")           # the spellings a policy takes
    train(model, opt, batches(1))
    assert handle.chunk_bytes == 1024


def test_the_gradient_sync_setters_take_what_the_allreduce_settings_take(ap):
    sync = ap.enable("distributed").allreduce
    with pytest.raises(ValueError, match=r"^allreduce\.bucket_bytes: must be at least 1024 bytes, got 512$"):
        sync.set_bucket_bytes(512)
    with pytest.raises(ValueError, match=r"^allreduce\.compression: expected one of none, fp16, bf16, minmax_uint8"):
        sync.set_compression("zip")
    with pytest.raises(TypeError, match=r"^allreduce\.hierarchical: expected bool"):
        sync.set_hierarchical("sometimes")
    assert (sync.bucket_bytes, sync.compression, sync.hierarchical) == (25 << 20, "none", False)
    sync.set_bucket_bytes("8MiB")
    sync.set_compression("bf16")
    sync.set_hierarchical("false")           # as FUSEDOPT_* variables spell it
    assert (sync.bucket_bytes, sync.compression, sync.hierarchical) == (8 << 20, "bf16", False)
