"""How one bucket is averaged across ranks, as a sequence of asynchronous stages.

A bucket's reduction is a generator: it launches collectives with ``async_op=True``, yields each
work object, and goes on once the caller has waited for it (each such collective is a *stage*).
The caller advances all buckets stage by stage in bucket order (``waiting.Waiter.drain``), so every
rank issues the same collectives in the same order on every group. Buckets arrive multiplied by
1/world, so every sum here is already an average.

``bytes_sent`` estimates what this rank puts on the wire per bucket, with the usual ring
algorithms: allreduce ``2(n-1)/n`` of the buffer, all-to-all and all-gather ``(n-1)/n`` of their
output, reduce and broadcast ``(n-1)/n`` of the buffer.
"""

import torch
import torch.distributed as dist

from ..torch_internals import all_gather_into
from .compression import CAST_DTYPES, HEADER_BYTES, compresses, dequantize_rows, quantize_rows_



def _ring(n, nbytes, factor=1):
    return factor * (n - 1) * nbytes // n


class Averager:
    """Averages buckets over ``group``, optionally compressed and optionally node by node.

    ``row``: for ``minmax_uint8``, how many values share one min and max (default: each rank's
    whole share of a bucket, as ByteGrad's).
    """

    def __init__(self, group, compression="none", nodes=None, row=None):
        self.group = group
        self.compression = compression
        self.nodes = nodes          # NodeGroups (hierarchy.py) when reducing node by node
        self.row = row

    @property
    def single_collective(self):
        """One collective per bucket: once it completes, finishing the bucket issues nothing."""
        return self.nodes is None and self.compression != "minmax_uint8"

    def stages(self, tensor):
        nodes = self.nodes
        if nodes is None:
            yield from self._between_nodes(tensor, self.group)
            return
        if nodes.local_size > 1:
            yield dist.reduce(tensor, dst=nodes.leader, group=nodes.local_group, async_op=True)
        if nodes.is_leader and nodes.nodes > 1:
            yield from self._between_nodes(tensor, nodes.leaders_group)
        if nodes.local_size > 1:
            yield dist.broadcast(tensor, src=nodes.leader, group=nodes.local_group, async_op=True)

    def _between_nodes(self, tensor, group):
        """Compression applies here: with hierarchical reduce, only to traffic between nodes."""
        if not compresses(self.compression, tensor):
            yield dist.all_reduce(tensor, group=group, async_op=True)
        elif self.compression in CAST_DTYPES:
            wire = tensor.to(CAST_DTYPES[self.compression])
            yield dist.all_reduce(wire, group=group, async_op=True)
            tensor.copy_(wire)
        else:
            yield from _minmax_uint8(tensor, group, self.row)

    def bytes_sent(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        nodes = self.nodes
        if nodes is None:
            return self._bytes_between_nodes(tensor, dist.get_world_size(self.group))
        sent = 0
        if nodes.local_size > 1:
            sent += _ring(nodes.local_size, nbytes, 2)          # reduce, then broadcast
        if nodes.is_leader and nodes.nodes > 1:
            sent += self._bytes_between_nodes(tensor, nodes.nodes)
        return sent

    def _bytes_between_nodes(self, tensor, n):
        if not compresses(self.compression, tensor):
            return _ring(n, tensor.numel() * tensor.element_size(), 2)
        if self.compression in CAST_DTYPES:
            return _ring(n, tensor.numel() * CAST_DTYPES[self.compression].itemsize, 2)
        cols, rows_per_rank = _share(tensor.numel(), n, self.row)
        return 2 * (n - 1) * (cols + rows_per_rank * HEADER_BYTES)     # all-to-all, then all-gather


def _share(numel, n, row):
    """Each rank's share of a bucket of ``numel`` values (padded to whole rows), and how many
    code rows (min/max pairs) it has."""
    cols = -(-numel // n)
    per_row = row or cols
    rows = -(-cols // per_row)
    return rows * per_row, rows


def _minmax_uint8(tensor, group, row=None):
    """Bagua's ByteGrad scheme: scatter each rank's share in 8 bits, average it at its owner,
    gather the averages back. Each share is coded in rows of ``row`` values (one row without),
    each with its own min and max; one all-to-all and one all-gather whatever the number of rows.

    The bucket itself is the float scratch space: its gradients are spent once encoded.
    """
    n = dist.get_world_size(group)
    numel = tensor.numel()
    cols, k = _share(numel, n, row)
    if cols * n == numel:
        rows = tensor.view(n * k, cols // k)
    else:
        rows = tensor.new_empty(n * k, cols // k)
        rows.view(-1)[:numel] = tensor
        rows.view(-1)[numel:] = tensor[-1]     # padding that widens no row's range
    send = quantize_rows_(rows)
    recv = torch.empty_like(send)
    yield dist.all_to_all_single(recv, send, group=group, async_op=True)
    decoded = dequantize_rows(recv, out=rows).view(n, cols)
    mine = quantize_rows_(decoded.sum(0).view(k, cols // k))
    gathered = torch.empty_like(send)
    yield all_gather_into(gathered, mine, group=group, async_op=True)
    dequantize_rows(gathered, out=rows)
    if rows.data_ptr() != tensor.data_ptr():
        tensor.copy_(rows.view(-1)[:numel])
