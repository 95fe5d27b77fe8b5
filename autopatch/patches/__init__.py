"""Every place autopatch changes torch: one module per target, one ledger (``ledger.py``).

Each module names its targets (the torch objects it changes) and the torch internals it relies on,
installs into a section of the ledger and removes it again; the rooms pass in what the patches
call. ``disable()`` uninstalls whatever the ledger still holds, and
``tests/runtime/test_restores_torch.py`` shows torch left exactly as it was found.

- ``optimizer``: ``Optimizer.__init__``, torch's global optimizer step pre-hook (the runtime)
- ``ddp``: ``DistributedDataParallel.__init__``, ``forward`` and the calls that hand a model back
  to DDP's reducer (comm's takeover)
- ``dataloader``: ``DataLoader.__init__`` and ``__iter__`` (the data cache and balanced sampler)
- ``loader_iterator``: the DataLoader iterator's ``__init__`` and ``__next__`` (batch waits)
- ``module_reads``: module and parameter reads, ``torch.save``, a global module forward pre-hook
  (mode forward, while some optimizer runs it)
- ``process_group``: ``destroy_process_group`` (while background averaging runs)
- ``autograd``: ``torch.autograd.backward`` (the per-step breakdown's clock)
- ``bagua_method``: ``Module.with_bagua`` (once ``autopatch.contrib.bagua`` is imported)
"""
