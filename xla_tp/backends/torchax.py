"""Importing torchax without what it does not need here: its checkpoint helpers' flax.

Used by the JAX backend and by torch_xla's own JAX calls (``call_jax``, which its Pallas kernels go
through: the MoE grouped matmul). Example: ``torchax = import_torchax()``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Iterator

import torch


def import_torchax():
    """``torchax``, imported with torch's MultiheadAttention fast-path setting left as it was.

    Some builds of torchax 0.0.13 import ``flax.training.checkpoints`` at import time, for their
    own checkpoint helpers, which this backend does not use. Without flax installed, those builds
    import with a placeholder there (its use raises an ImportError saying to install flax); the
    placeholder is gone from ``sys.modules`` afterwards.
    """
    before = torch.backends.mha.get_fastpath_enabled()
    with _flax_placeholder():
        import torchax
        import torchax.interop  # noqa: F401
    _bind_submodules("torchax")
    torch.backends.mha.set_fastpath_enabled(before)
    return torchax


def _bind_submodules(package: str) -> None:
    """Each imported submodule of ``package`` set as its parent's attribute. An import of ``package`` that
    failed (torch_xla's ``mark_sharding`` tries one, which fails without flax) leaves the submodules it had
    imported in ``sys.modules``; the next import of ``package`` finds them there and binds none of them
    (``torchax.ops`` would be missing, which ``call_jax`` reads)."""
    for name in sorted(n for n in list(sys.modules) if n.startswith(package + ".")):
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and not hasattr(sys.modules[parent], child):
            setattr(sys.modules[parent], child, sys.modules[name])


@contextlib.contextmanager
def _flax_placeholder() -> Iterator[None]:
    """``flax.training.checkpoints`` importable while inside, if flax is not installed."""
    if "flax" in sys.modules or importlib.util.find_spec("flax") is not None:
        yield
        return

    def missing(name: str):
        raise ImportError(f"flax.training.checkpoints.{name}: torchax's checkpoint helpers need flax (pip install flax)")

    names = ("flax", "flax.training", "flax.training.checkpoints")
    stubs = {name: types.ModuleType(name) for name in names}
    stubs["flax"].training = stubs["flax.training"]
    stubs["flax.training"].checkpoints = stubs["flax.training.checkpoints"]
    stubs["flax.training.checkpoints"].__getattr__ = missing
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in names:
            if sys.modules.get(name) is stubs[name]:
                del sys.modules[name]
