"""Activation checkpointing on XLA: ``torch.utils.checkpoint`` and transformers' ``gradient_checkpointing_enable()``.

``torch.utils.checkpoint`` saves and replays the RNG state of the device its inputs live on
through that device's runtime module, ``torch.<device>``. torch_xla registers none, so on XLA
every checkpointed block fails with ``AttributeError: module 'torch' has no attribute 'xla'``
(transformers' gradient checkpointing included). ``parallelize_xla`` registers a small runtime
module backed by torch_xla's RNG (the seed of the XLA generator): re-entrant and non-re-entrant
checkpoints then run, dropout masks replay identically in the recomputation, and the compiled
backward recomputes the checkpointed blocks instead of keeping their activations (the audit of
the backward counts their matmuls twice). ``register`` is a ``compat`` effect: ``torch.xla`` goes
away again when no parallelized model remains. Example::

    model = xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    model.gradient_checkpointing_enable()        # or torch.utils.checkpoint.checkpoint(block, x)
    model(ids).loss.backward()
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Callable, Optional

import torch
import torch_xla.core.xla_model as xm


def _runtime_module() -> types.ModuleType:
    mod = types.ModuleType("torch.xla", "torch_xla's RNG as seen by torch.utils.checkpoint (registered by xla_tp)")
    mod._initialized = True
    mod.is_available = lambda: True
    mod.device_count = lambda: 1  # one SPMD program: one logical device, one generator
    mod.current_device = lambda: 0
    mod.device = lambda index=None: contextlib.nullcontext()
    mod.get_rng_state = lambda device=None: xm.get_rng_state()
    mod.set_rng_state = lambda state, device=None: xm.set_rng_state(int(state))
    return mod


def register() -> Optional[Callable[[], None]]:
    """Register ``torch.xla`` for ``torch.utils.checkpoint`` unless something already did; its removal."""
    if getattr(torch, "xla", None) is not None:
        return lambda: None
    module = _runtime_module()
    torch._register_device_module("xla", module)

    def remove() -> None:
        if getattr(torch, "xla", None) is module:
            delattr(torch, "xla")
            sys.modules.pop("torch.xla", None)
    return remove
