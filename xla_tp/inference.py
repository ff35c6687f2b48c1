"""Make a parallelized model work under ``torch.inference_mode()`` on torch_xla 2.9.

There, taking a view of a normal XLA tensor inside inference mode fails (``Cannot set
version_counter for inference tensor``), so even ``nn.Linear`` (``weight.t()``) breaks. The
root module's forward runs under ``inference_mode(False)`` + ``no_grad()`` instead (same
numerics, no autograd graph), and its tensor outputs are handed back as inference tensors so
the caller's own views of them work. Example::

    make_inference_safe(model)
    with torch.inference_mode():
        logits = model(tokens)
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


def _inference_safe_forward(self: nn.Module, *args, **kwargs):
    forward = self._xla_tp_forward
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return forward(*args, **kwargs)
    with torch.inference_mode(False), torch.no_grad():
        out = forward(*args, **kwargs)
    return tree_map_only(torch.Tensor, torch.clone, out)


def make_inference_safe(module: nn.Module) -> None:
    """Route ``module``'s forward through the inference-mode workaround (idempotent)."""
    if getattr(module.forward, "__func__", None) is not _inference_safe_forward:
        module._xla_tp_forward = module.forward  # the class's, or one a planner swapped in
        module.forward = types.MethodType(_inference_safe_forward, module)
