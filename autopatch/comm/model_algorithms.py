"""The algorithm objects of the DDP models a takeover is in charge of, seen from the optimizers.

Every optimizer step over a model's parameters is wrapped in its algorithm's ``before_step`` and
``after_step`` (each optimizer's controller calls ``before_step(opt)`` / ``after_step(opt)``
around its steps, through the runtime's view of the communication side). Which algorithms an
optimizer steps is found once and kept until its param groups or the models change, so a step
costs no scan of the parameters. The first time an optimizer steps a model, the algorithm says whether
it can go on with it (``fits``: qadam continues Adam and AdamW only); if not, the algorithm is
dropped for that model, which keeps the gradient allreduce, and ``on_drop(model, algorithm, why)``
says so. ``step_of(opt)`` is the algorithm that takes the optimizer's step over, if any.

Nothing here imports the algorithms: the takeover is built while torch itself is being imported.
An optimizer stepped over flat chunks (``autopatch.contrib.fuse_optimizer``, the runtime's fused
modes) updates a model's parameters through views of the same memory: those steps count as steps
over the model, and the algorithm is asked about the parameters the chunks stand for
(``stand_ins.stands_for``, which the fusion side fills; the runtime passes it in), not the chunks.
"""

import weakref

import torch


class ModelAlgorithms:
    def __init__(self, on_drop, stands_for=None):
        self.stands_for = stands_for or _itself        # a stepped tensor -> the parameters it updates
        self.by_model = weakref.WeakKeyDictionary()    # DDP model -> its Algorithm
        # The dict behind the weak one, asked at every step (a plain dict's truth costs no call):
        # a model freed a moment ago (still in it until its removal runs) only costs a look that
        # finds nothing
        self.live = self.by_model.data
        self.on_drop = on_drop
        self._fitting = weakref.WeakKeyDictionary()    # optimizer -> ids of the algorithms it fits
        self._stepping = weakref.WeakKeyDictionary()   # optimizer -> (what it was found for, algorithms)
        self._version = 0                              # changes whenever a model's algorithm does
                                                       # (a freed model leaves by_model: its count too)

    def get(self, model):
        return self.by_model.get(model)

    def add(self, model, algorithm):
        self.by_model[model] = algorithm
        self._version += 1

    def pop(self, model):
        self._version += 1
        return self.by_model.pop(model, None)

    def clear(self):
        self._version += 1
        self.by_model.clear()

    def of_model(self, model):
        """The algorithm of ``model``: the DDP model, or the module it wraps; or None."""
        return next((alg for ddp, alg in self.by_model.items() if model is ddp or model is ddp.module), None)

    def of_params(self, params):
        """The algorithm of the model holding any of ``params``, or None."""
        ids = {id(p) for p in params}
        return next((alg for alg in self.by_model.values() if any(id(p) in ids for p in alg.params)), None)

    def _stepped_by(self, opt):
        """The algorithms whose parameters ``opt`` updates and that can go on with it."""
        groups = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
        key = (self._version, len(self.by_model), groups)
        known = self._stepping.get(opt)
        if known is not None and known[0] == key:
            return known[1]
        stepped = [p for g in opt.param_groups for t in g["params"] for p in self.stands_for(t)]
        found = [alg for model, alg in list(self.by_model.items())
                 if _updates(stepped, alg.params) and self._fits(model, alg, opt, stepped)]
        self._stepping[opt] = ((self._version, len(self.by_model), groups), found)
        return found

    def _fits(self, model, alg, opt, stepped):
        fitting = self._fitting.setdefault(opt, set())
        if id(alg) in fitting:
            return True
        why = alg.fits(opt, stepped)
        if why is not None:
            self.pop(model)
            self.on_drop(model, alg, f"{why}; gradient allreduce kept")
            return False
        fitting.add(id(alg))
        return True

    # -- around each optimizer step ------------------------------------------------------------
    def before_step(self, opt):
        for alg in self._stepped_by(opt):
            alg.before_step()

    def after_step(self, opt):
        for alg in self._stepped_by(opt):
            alg.after_step()

    def step_of(self, opt):
        """The algorithm whose ``step(opt)`` replaces ``opt``'s own step now, or None."""
        return next((alg for alg in self._stepped_by(opt) if alg.takes_step_of(opt)), None)


def _itself(tensor):
    return (tensor,)


def _updates(tensors, params):
    """True when stepping ``tensors`` updates some of ``params``: one of them is among them, or
    (fused steps: chunks of flat buffers stand in for the parameters) shares their memory."""
    ids = {id(t) for t in tensors}
    if any(id(p) in ids for p in params):
        return True
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.layout == torch.strided}
    return any(p.layout == torch.strided and p.untyped_storage().data_ptr() in storages for p in params)
