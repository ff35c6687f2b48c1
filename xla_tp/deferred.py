"""``parallelize_xla(model, "auto")`` for a model whose input cannot be made up: planned at its first call.

When ``plan_for`` cannot build an input from what the model declares (``dataflow.inputs``), the
model is left as it is, with its forward replaced by a one-off step: at the first call it plans from
that call's arguments (traced on fake copies: nothing the caller passed is read or written; an
argument that is not a tensor, a number or a string, such as a KV cache, is left out of the trace),
parallelizes the model with that plan, puts the model's own forward back and runs the call on the
parallelized model. Example::

    model = xla_tp.parallelize_xla(TwoInputs(), "auto", mesh=mesh)    # warns: planned at the first call
    y = model(x.to(device), gate.to(device))                           # planned, parallelized, run
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

_ATTR = "_xla_tp_deferred"  # on a module waiting for its first call: the forward to put back (or None)
Parallelize = Callable[[tuple, dict], None]  # parallelizes the module, planned from these arguments


def plan_at_first_call(module: nn.Module, parallelize: Parallelize, why: str) -> nn.Module:
    """Replace ``module``'s forward by the one-off step (see the module docstring); return ``module``."""
    warnings.warn(f"xla_tp: plan 'auto' could not make up an input for {type(module).__name__} ({why}); it is "
                  f"planned and parallelized at its first call", stacklevel=3)
    vars(module)[_ATTR] = vars(module).get("forward")

    def first_call(*args: Any, **kwargs: Any) -> Any:
        restore(module)
        parallelize(*plannable(args, kwargs))
        return module(*args, **kwargs)

    module.forward = first_call
    return module


def restore(module: nn.Module) -> None:
    """Put back the forward ``plan_at_first_call`` replaced (nothing if it did not)."""
    if _ATTR not in vars(module):
        return
    own = vars(module).pop(_ATTR)
    if own is None:
        vars(module).pop("forward", None)
    else:
        module.forward = own


def plannable(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments a planning trace may see: tensors (only their shapes are read), numbers, strings,
    containers of them; anything else (a KV cache object) becomes None."""
    def keep(a: Any) -> Any:
        return a if a is None or isinstance(a, (torch.Tensor, int, float, bool, str)) else None
    return tree_map(keep, args), tree_map(keep, kwargs)
