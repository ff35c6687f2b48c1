"""Make a parallelized model work under ``torch.inference_mode()`` on torch_xla 2.9.

There, taking a view of a normal XLA tensor inside inference mode fails (``Cannot set
version_counter for inference tensor``), so even ``nn.Linear`` (``weight.t()``) breaks. The
outermost parallelized forward runs under ``inference_mode(False)`` + ``no_grad()`` instead (same
numerics, no autograd graph), and its tensor outputs are handed back as inference tensors, so the
caller's own views of them work. ``lowering.scope``'s root hooks call ``leave_inference`` /
``return_to_inference`` around that forward. Example::

    with torch.inference_mode():
        logits = model(tokens)       # a parallelized model
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map_only


def leave_inference() -> Optional[contextlib.ExitStack]:
    """Outside compilation and inside ``inference_mode``: leave it (no grad instead); the context to
    close after the forward, else None."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return None
    context = contextlib.ExitStack()
    context.enter_context(torch.inference_mode(False))
    context.enter_context(torch.no_grad())
    return context


def return_to_inference(context: Optional[contextlib.ExitStack], output: Any) -> Any:
    """Close ``context`` (back in inference mode) and hand ``output``'s tensors back as inference
    tensors; ``output`` itself (None: unchanged) when there was no context."""
    if context is None:
        return None
    context.close()
    return tree_map_only(torch.Tensor, torch.clone, output)
