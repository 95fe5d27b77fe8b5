"""The gradient sync as code outside comm/ may use it: ``autopatch.session().allreduce``.

A narrow view of the DDP takeover: its knobs (what is in effect, and the setters autotune and
users call between steps), what it has waited so far, the algorithm object of a model (async's
``abort``/``resume``), running a model under another algorithm (``with_bagua``), and the report.
Installing and removing the takeover's patches stay the runtime's.
"""


class GradientSync:
    def __init__(self, takeover):
        self._takeover = takeover

    @property
    def active(self):
        """True while autopatch averages the gradients of some DDP model."""
        return self._takeover.in_charge

    @property
    def bucket_bytes(self):
        return self._takeover.settings.bucket_bytes

    @property
    def compression(self):
        return self._takeover.settings.compression

    @property
    def hierarchical(self):
        return self._takeover.settings.hierarchical

    @property
    def wait_seconds(self):
        """Seconds spent waiting for gradient communication so far, over the models in charge."""
        return self._takeover.wait_seconds

    def set_bucket_bytes(self, nbytes):
        self._takeover.set_bucket_bytes(nbytes)

    def set_compression(self, compression):
        self._takeover.set_compression(compression)

    def set_hierarchical(self, flag):
        self._takeover.set_hierarchical(flag)

    def algorithm(self, model):
        """The algorithm object of ``model`` (the DDP model, or the module it wraps), or None (a
        gradient algorithm, or a model not taken over): ``.abort()`` and ``.resume()`` stop and
        restart async averaging."""
        return self._takeover.algorithm(model)

    def use_algorithm(self, ddp, choice):
        """Run ``ddp`` with ``choice`` (an ``AlgorithmChoice``) from its next forward on. A
        collective over its process group. Returns None, or why DDP keeps its own gradient sync
        for this model."""
        return self._takeover.use_algorithm(ddp, choice)

    def describe(self):
        return self._takeover.describe()
