"""May mode M run this optimizer, here and now, and if not, why.

Three things can rule a mode out: the optimizer class (the probe steps a throw-away copy over
small tensors both ways: an update that is not elementwise cannot be fused), the run (what the
watch over the first steps saw, or what happened later: a closure, accumulation), and the setting
(DTensor parameters; across processes, backward fusion needs gradients averaged by autopatch's
allreduce, and a communication algorithm that moves weights allows only the modes it names).
Every answer is a reason in words, for the report.
"""

from .. import dist
from ..fusion.flattenable import holds_dtensors
from ..fusion.fusability import probe
from ..policy import class_matches
from ..torch_internals import unhooked_step
from ..vocabulary import BACKWARD, MULTI_LAYER, OFF, WATCHED_MODES
from . import dtensor_rules


class Eligibility:
    def __init__(self, qualname, fusion, comm):
        """``fusion``: the policy's fusion section; ``comm``: the communication side's view
        (runtime/comm_view.py): who averages which gradients, which algorithm moves which weights."""
        self.qualname = qualname
        self.fusion = fusion
        self.comm = comm
        self.fusable = False     # the probe accepted the class: its mode may change at run time
        self.bitwise = None      # the probe found fused steps bit for bit equal (None: not probed)
        self.watched = False     # the first steps were watched: ``blocked`` is known
        self.blocked = {}        # mode -> what this run does that the mode would get wrong

    def check(self, opt, mode):
        """None when ``mode`` cannot change this optimizer's results, else the reason it might."""
        return self._setting_refusal(opt, mode) or self._probe_refusal(opt, mode)

    def _setting_refusal(self, opt, mode):
        """What the setting rules out, whatever the run does: sharded parameters, an algorithm
        that moves weights, a step torch does not wrap, gradients averaged by someone else."""
        if why := dtensor_rules.mode_refusal(opt, mode):
            return why
        if why := self._algorithm_refusal(opt, mode):
            return why
        if mode in WATCHED_MODES and unhooked_step(opt) is None:
            return "its step() is not wrapped by torch's Optimizer hooks"
        if mode == BACKWARD and dist.world_size() > 1 and self.averager(opt) is None:
            return (f"gradients are averaged across {dist.world_size()} processes, not all of them by "
                    "autopatch's allreduce (allreduce off, or left to DDP: see the allreduce "
                    "section); an update inside backward would use the local gradient")
        return None

    def _probe_refusal(self, opt, mode):
        if self.unprobed():
            return None
        for group in opt.param_groups:
            result = probe(opt, group, split=mode != MULTI_LAYER)
            if not result.fusable:
                return result.reason
            self.bitwise = result.bitwise if self.bitwise is None else self.bitwise and result.bitwise
        if self.bitwise is False and self.fusion.exact == "bitwise":
            return ("the probe found fused updates equal to per-tensor updates only within float rounding "
                    "(torch's fused kernels round an element by where it lies in the tensor); "
                    "fusion.exact: bitwise keeps it per tensor")
        return dtensor_rules.probe_refusal(opt, self.bitwise)

    def _algorithm_refusal(self, opt, mode):
        """Gradient algorithms combine with every mode; those that exchange weights or optimizer
        state only with the modes they name."""
        algorithm = self.comm.algorithm_of([p for g in opt.param_groups for p in g["params"]])
        if algorithm is None or mode in algorithm.fusion_modes:
            return None
        return f"communication algorithm {algorithm.name}: {algorithm.fusion_refusal}"

    def why_not(self, opt, mode):
        """None when this run may use ``mode`` now, else why not: what the watch or the run
        showed, or what the check found."""
        if mode == OFF:
            return None
        if not self.fusable:
            return "this optimizer is not fused"
        if why := self._setting_refusal(opt, mode):
            return why
        if mode in self.blocked:
            return self.blocked[mode]
        if mode in WATCHED_MODES and not self.watched:
            return "the first steps were not watched"
        return self._probe_refusal(opt, mode)

    def shard_exchange(self, opt):
        """``(exchange, None)`` when ``opt``'s state may be sharded across the ranks of its DDP
        models (``fusion.shard``), else ``(None, why not)``. Asked once the probe accepted the class
        as bitwise: an elementwise update steps a share of a run exactly as it steps the whole."""
        if not dist.initialised():
            return None, "no process group (torch.distributed is not initialised)"
        if dist.world_size() < 2:
            return None, "world size is 1: one process holds the whole state"
        if self.fusion.exact != "bitwise":
            return None, "fusion.exact: rounding steps chunks through routes that do not step shares"
        if self.unprobed():
            return None, ("fused without the probe (fusion.force / fusion.probe: false): only an update "
                          "the probe found elementwise may be stepped in shares")
        if holds_dtensors(opt):
            return None, "DTensor parameters (FSDP2, tensor parallel): their mesh shards them already"
        return self.comm.shard_exchange_of([p for g in opt.param_groups for p in g["params"] if p.requires_grad])

    def averager(self, opt):
        """Across processes, backward fusion updates a chunk once autopatch's allreduce has
        averaged its gradients: the one averaging all of this optimizer's, or None."""
        return self.comm.averager_of([p for g in opt.param_groups for p in g["params"] if p.requires_grad])

    def process_group(self, opt):
        """The process group of the DDP model ``opt`` updates: the ranks the choice of its mode
        must agree with. None when no such model is known (a model each rank trains alone, or
        sharded ones whose collectives are not in the step): the choice is this rank's own."""
        return self.comm.group_of([p for g in opt.param_groups for p in g["params"]])

    def accept(self):
        """The probe accepted the class: its mode may change at run time."""
        self.fusable = True

    def watched_run(self, observation):
        """The watch is over: rule out what it saw."""
        self.watched = True
        for mode in WATCHED_MODES:
            if observation.blockers(mode):
                self.blocked.setdefault(mode, "; ".join(observation.blockers(mode)))

    def block(self, modes, what):
        """The run just did ``what``, which ``modes`` would get wrong; returns those newly ruled out."""
        new = [m for m in modes if m not in self.blocked]
        for m in new:
            self.blocked[m] = what
        return new

    def forbidden(self):
        """The policy never fuses this class (fusion.forbid)."""
        return class_matches(self.qualname, self.fusion.forbid)

    def unprobed(self):
        """The policy fuses this class without asking the probe (fusion.force, fusion.probe: false)."""
        return class_matches(self.qualname, self.fusion.force) or not self.fusion.probe

    def probe_note(self, route):
        """How far fused steps may be trusted, for the reason in the report."""
        if self.fusion.exact == "rounding":
            return route.note()
        if self.unprobed():
            return "fused without the probe (fusion.force / fusion.probe: false)"
        if self.bitwise:
            return "the probe found fused updates bit-for-bit equal to per-tensor updates"
        return "the probe found fused updates equal to per-tensor updates within float rounding"
