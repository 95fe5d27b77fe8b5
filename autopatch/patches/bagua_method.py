"""``Module.with_bagua``: Bagua gave every module this method on import; so does
``autopatch.contrib.bagua``, for as long as autopatch is enabled (a standing patch, ledger.py).

Target: ``torch.nn.Module.with_bagua`` (added). Internals: none.
"""

from .ledger import standing

TARGET = "bagua_method"


def give_modules(with_bagua):
    """Every module has ``with_bagua`` while autopatch is enabled, from now on."""
    import torch
    standing.add(TARGET, torch.nn.Module, "with_bagua", with_bagua)
