"""Instance-level forward swaps: a module's ``forward`` replaced by a lowered one, and given back.

The lowered forward reads its state from an attribute of the module (``attr``); taking the swap
off deletes both. Example::

    swap(linear, "_xla_tp_group", group, grouped_forward)
    restore(model, "_xla_tp_group")       # every swapped module of model has its own forward again
"""
from __future__ import annotations

import types
from typing import Any, Callable

from torch import nn


def swap(module: nn.Module, attr: str, state: Any, forward: Callable[..., Any]) -> None:
    """``module.forward`` becomes ``forward`` (bound), with ``state`` kept on ``module.<attr>``."""
    setattr(module, attr, state)
    module.forward = types.MethodType(forward, module)


def restore(model: nn.Module, attr: str) -> None:
    """Every module of ``model`` swapped under ``attr`` gets its class's forward back."""
    for m in model.modules():
        if attr in vars(m):
            delattr(m, attr)
            vars(m).pop("forward", None)
