"""JAX in this process: torchax imported without what it does not need here (its checkpoint helpers'
flax), and jax's CPU device count set before jax starts (``ensure_cpu_devices``).

Used by the JAX backend and by torch_xla's own JAX calls (``call_jax``, which its Pallas kernels go
through: the MoE grouped matmul, the splash kernel per context block). Example::

    ensure_cpu_devices(8)          # before anything starts jax: later uses (the JAX backend) see 8 CPU devices
    torchax = import_torchax()
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
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


def processes() -> int:
    """How many processes ``jax.distributed.initialize`` joined (1 without it), read without starting jax."""
    from jax._src import distributed  # the public jax.process_count() starts the backend, fixing its devices
    return distributed.global_state.num_processes or 1


def ensure_cpu_devices(needed: int) -> None:
    """Ask jax's CPU client for ``max(needed, CPU_NUM_DEVICES)`` devices (``needed`` shared out over the
    processes ``jax.distributed`` joined), unless jax has started or the user chose a count
    (``jax_num_cpu_devices``, ``--xla_force_host_platform_device_count``)."""
    import jax
    if jax.config.jax_num_cpu_devices != -1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    count = max(-(-needed // processes()), int(os.environ.get("CPU_NUM_DEVICES", "0") or 0))
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # jax has started: its device count is fixed; the mesh check says so if it is too small
