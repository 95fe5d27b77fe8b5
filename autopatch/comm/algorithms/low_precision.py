"""Low-precision decentralized SGD on a ring (Tang et al., arXiv 1803.06443, DCD-PSGD).

Every rank keeps float32 replicas x_hat of itself and of its left and right ring neighbours; the
neighbours' replicas of a rank are bit-for-bit its own, because all of them only ever add the
same decoded bytes. After a communicating optimizer step, with x the weights and
s = x_hat_self, a rank sends both neighbours the 8-bit code Q(z) of

    z = x + x_hat_left / 3 + x_hat_right / 3 - 5 s / 3
      = (x - s) + (mix(x_hat) - s),   mix = the ring average with weights 1/3, 1/3, 1/3,

that is, its local progress since the last communication plus its step towards the neighbours.
Each replica then advances by the code it belongs to (s += Q(z), x_hat_left += Q(z_left), ...)
and the weights become s, which is exactly what the neighbours hold of them. Compared with the
paper, whose x carries on beside s, the gradient is taken at s: one model-sized buffer fewer,
and no rank trains on weights its neighbours do not know.

Codes have a min and max per row of ``row_elements`` values (``row_codes.py``). With two ranks
both neighbours are one rank, weighted 2/3 and sent one message. ``hierarchical`` runs the ring
over node leaders on node averages; a single node then just averages its ranks.
"""

import torch
import torch.distributed as dist

from ..waiting import start
from .base import Algorithm, whole_number
from .row_codes import DEFAULT_ROW, decode, encode, padded
from .flat_tensors import FlatTensors
from .peers import ring_neighbours
from .stages import ExchangeStages


class LowPrecisionDecentralized(Algorithm):
    name = "low_precision_decentralized"
    changes = ("weights, not gradients, are exchanged in 8 bits: after each communicating optimizer "
               "step a rank sends its two ring neighbours an 8-bit code of its weights' movement and "
               "its weights become the replica its neighbours keep of them")
    fusion_refusal = ("the ring exchange reads and rewrites the weights right after each optimizer step, "
                      "which an update inside backward or one deferred to the next forward would cross")

    def __init__(self, params, group, *, hierarchical=False, communication_interval=1,
                 row_elements=DEFAULT_ROW, timeout_seconds=None):
        super().__init__(params, group, timeout_seconds=timeout_seconds)
        self.hierarchical = bool(hierarchical)
        self.interval = self.setting("communication_interval", communication_interval)
        self.row = whole_number("row_elements", row_elements, 1)
        self.stages = ExchangeStages(group, self.hierarchical, self.name)
        st = self.stages
        # global rank -> how many of this rank's two ring places it fills
        self.neighbours = ({st.global_rank(r): m for r, m in ring_neighbours(st.rank, st.size).items()}
                           if st.exchanging else {})
        self.flat = FlatTensors(self.params, keep=True)
        self.scratch = {}                                       # dtype group -> see _scratch
        self.communications = 0
        self.replica = []                                       # s, one flat float32 per dtype group
        self.neighbour_replicas = {peer: [] for peer in self.neighbours}
        weights = self.flat.gather()
        self.waiter.drain([start(self._first_replicas(w)) for w in weights], "the first replica exchange")
        self.flat.scatter(weights)

    def settings(self):
        return {"hierarchical": self.hierarchical, "communication_interval": self.interval,
                "row_elements": self.row}

    def _exchange(self, sends, receives):
        """One message to and from each neighbour, all in flight together."""
        ops = [dist.P2POp(dist.isend, sends, peer, self.stages.group) for peer in self.neighbours]
        ops += [dist.P2POp(dist.irecv, receives[peer], peer, self.stages.group) for peer in self.neighbours]
        return dist.batch_isend_irecv(ops)

    def _first_replicas(self, w):
        """Replicas start as the weights themselves, exchanged once at full precision."""
        return self.stages.around(w, self._first_exchange)

    def _first_exchange(self, w):
        mine = w.float().clone()
        self.replica.append(mine)
        theirs = {peer: torch.empty_like(mine) for peer in self.neighbours}
        yield self._exchange(mine, theirs)
        for peer, t in theirs.items():
            self.neighbour_replicas[peer].append(t)

    def after_step(self):
        communicate = self.steps % self.interval == 0
        super().after_step()
        if not communicate or self.closed:
            return
        weights = self.flat.gather()
        self.waiter.drain([start(self._communicate(g, w)) for g, w in enumerate(weights)],
                          "the ring exchange")
        self.flat.scatter(weights)
        self.communications += 1

    def _communicate(self, g, w):
        """Stages of one communication for dtype group ``g`` whose weights are ``w``."""
        if self.stages.nodes is not None:
            self.bytes_sent += self.stages.node_bytes(w.numel() * w.element_size())
        return self.stages.around(w, lambda weights: self._ring_step(g, weights))

    def _ring_step(self, g, w):
        """Stages of the ring exchange of group ``g``'s codes; ``w`` becomes its replica."""
        s = self.replica[g]
        n = s.numel()
        scratch = self._scratch(g, n)      # z, then each decoded code
        z = scratch[:n]
        z.copy_(w)
        for peer, m in self.neighbours.items():
            z.add_(self.neighbour_replicas[peer][g], alpha=m / 3)
        z.add_(s, alpha=-5 / 3)
        wire = encode(z, self.row, scratch)
        received = {peer: torch.empty_like(wire) for peer in self.neighbours}
        self.bytes_sent += wire.numel() * len(self.neighbours)
        yield self._exchange(wire, received)
        s.add_(decode(wire, n, scratch))
        for peer, codes in received.items():
            self.neighbour_replicas[peer][g].add_(decode(codes, n, scratch))
        w.copy_(s)

    def _scratch(self, g, n):
        """Group ``g``'s float32 working buffer, kept between communications (fresh model-sized
        pages every step would cost more than the arithmetic on a CPU)."""
        if g not in self.scratch:
            self.scratch[g] = torch.empty(padded(n, self.row), device=self.replica[g].device)
        return self.scratch[g]

    def describe(self):
        return dict(super().describe(), communications=self.communications)
