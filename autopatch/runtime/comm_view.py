"""What the optimizer side may ask of the communication side, and when it tells it of a step.

Every optimizer's controller (modes/) gets this one view, and nothing else of comm/:

- ``averager_of(params)``: what averages all of ``params``' gradients inside backward (autopatch's
  allreduce), for backward fusion to wait on; None when nothing, or not all of them;
- ``algorithm_of(params)``: the communication algorithm that exchanges their weights or optimizer
  state (its ``name``, the ``fusion_modes`` it allows and its ``fusion_refusal``), or None;
- ``step_owner(opt)``: what takes ``opt``'s step over (qadam past warm-up: ``name``, ``step(opt)``);
- ``shard_exchange_of(params)``: ``(exchange, None)`` where the optimizer state of ``params`` may be
  sharded (comm/shard_exchange.py: the collectives over their DDP models' group), else
  ``(None, why not)``;
- ``group_of(params)``: the process group of the DDP model holding them, the ranks mode auto's
  decisions agree across; None: each rank decides alone (no such model, or its ranks may step
  unevenly);
- ``before_step(opt)`` / ``after_step(opt)``: called by the controller at the start of every
  step() and once the step is over, so that the algorithms of the models ``opt`` updates can hold
  and release their weights around it.

The DDP takeover appears when DistributedDataParallel is imported, possibly after optimizers were
adopted: until then every answer is "nothing". The session's events (``step_begins``, ``step``)
are for observers (the step timer, autotune); the communication side is driven from here.
"""


class CommView:
    def __init__(self):
        self.takeover = None     # comm.takeover.DDPTakeover, once DDP is imported

    def averager_of(self, params):
        t = self.takeover
        return t if t is not None and t.averages(params) else None

    def algorithm_of(self, params):
        return None if self.takeover is None else self.takeover.algorithm_of(params)

    def group_of(self, params):
        return None if self.takeover is None else self.takeover.group_of(params)

    def shard_exchange_of(self, params):
        if self.takeover is None:
            return None, ("no DistributedDataParallel model is known (DDP was never imported, or "
                          "allreduce.enabled: false leaves DDP models unseen)")
        from ..comm.shard_exchange import exchange_for
        return exchange_for(self.takeover, params)

    def step_owner(self, opt):
        return None if self.takeover is None else self.takeover.step_of(opt)

    def before_step(self, opt):
        if self.takeover is not None:
            self.takeover.before_step(opt)

    def after_step(self, opt):
        if self.takeover is not None:
            self.takeover.after_step(opt)
