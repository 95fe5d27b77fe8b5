"""Decentralized SGD: ranks average weights with each other instead of averaging gradients.

A communicating step (every ``communication_interval``-th synchronised forward, counting from
the first) copies the weights x_t as the forward starts and launches their exchange, which runs
while forward and backward compute g(x_t). At the end of backward the weights become the
exchanged average, and the user's optimizer then applies g(x_t) to it:
x_{t+1} = avg(x_t) - lr g(x_t). Steps in between are purely local.

``all`` averages over every rank (all ranks hold identical weights afterwards); ``shift_one``
averages with one partner per communication (``peers.shift_one_peer``), so each step costs one
model's worth of bytes whatever the world size.
"""

import torch
import torch.distributed as dist

from ..waiting import start
from .base import Algorithm, BackwardEnd, quietly
from .flat_tensors import FlatTensors
from .peers import check_even, shift_one_peer
from .stages import ExchangeStages


class Decentralized(Algorithm):
    name = "decentralized"
    changes = ("weights, not gradients, are exchanged: each communicating step's starting weights "
               "are averaged with every rank's (all) or one partner's (shift_one) while forward and "
               "backward run, and the optimizer applies the local gradient to that average")
    fusion_refusal = ("the weights become the exchanged average at the end of backward, which an update "
                      "inside backward would precede, and the exchange starts from the weights at forward, "
                      "which an update deferred to that forward would not have reached yet")

    def __init__(self, params, group, *, peer_selection_mode="all", communication_interval=1,
                 hierarchical=False, timeout_seconds=None):
        super().__init__(params, group, timeout_seconds=timeout_seconds)
        self.peer_selection = self.setting("peer_selection_mode", peer_selection_mode)
        self.interval = self.setting("communication_interval", communication_interval)
        self.hierarchical = bool(hierarchical)
        self.stages = ExchangeStages(group, self.hierarchical, self.name)
        if self.peer_selection == "shift_one":
            check_even(self.stages.size, self.hierarchical)
        self.flat = FlatTensors(self.params, keep=True)
        self.forwards = 0           # synchronised training forwards
        self.communications = 0
        self._inflight = None       # (weight copies, their exchanges under way)
        self._backward = BackwardEnd(self.params, self.after_backward)

    def settings(self):
        return {"peer_selection_mode": self.peer_selection, "communication_interval": self.interval,
                "hierarchical": self.hierarchical}

    def before_forward(self, sync=True):
        if not sync or self.closed:
            return
        self._complete()            # a forward whose backward never came: its exchange ends here
        communicate = self.forwards % self.interval == 0
        self.forwards += 1
        if not communicate:
            return
        copies = self.flat.gather()
        s = self.communications
        self._inflight = (copies, [start(self._exchange(c, s)) for c in copies])
        self.bytes_sent += sum(self._bytes(c.numel() * c.element_size()) for c in copies)
        self._backward.arm()

    def after_backward(self):
        self._complete()

    def _complete(self):
        if self._inflight is None:
            return
        (copies, started), self._inflight = self._inflight, None
        self.waiter.drain(started, "the weight exchange")
        self.flat.scatter(copies)
        self.communications += 1

    def _exchange(self, flat, s):
        """Stages that turn ``flat`` into its average, in communication number ``s``."""
        return self.stages.around(flat, lambda f: self._average(f, s))

    def _average(self, flat, s):
        """Stages of the average among the exchanging ranks."""
        st = self.stages
        if self.peer_selection == "all":
            flat.mul_(1.0 / st.size)
            yield dist.all_reduce(flat, group=st.group, async_op=True)
        else:
            peer = st.global_rank(shift_one_peer(st.rank, st.size, s))
            theirs = torch.empty_like(flat)
            yield dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, peer, st.group),
                                          dist.P2POp(dist.irecv, theirs, peer, st.group)])
            flat.add_(theirs).mul_(0.5)

    def _bytes(self, nbytes):
        sent = self.stages.node_bytes(nbytes)
        if self.stages.exchanging:
            n = self.stages.size
            sent += 2 * (n - 1) * nbytes // n if self.peer_selection == "all" else nbytes
        return sent

    def describe(self):
        return dict(super().describe(), communications=self.communications)

    def close(self):
        """Finish an exchange still in flight (every rank has the same one), then unhook."""
        if self.closed:
            return
        self.closed = True
        self._backward.remove()
        self.error = quietly(self._complete)
