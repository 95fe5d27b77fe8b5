"""Gradient synchronisation over torch.distributed: buckets, compression, the DDP takeover."""
