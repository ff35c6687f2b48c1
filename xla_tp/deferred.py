"""``parallelize_xla(model, "auto")`` for a model whose input cannot be made up: planned at its first call.

When ``plan_for`` cannot build an input from what the model declares (``dataflow.inputs``), the
model is left as it is, with its forward replaced by a one-off step: at the first call it plans from
that call's arguments (``dataflow.inputs.plannable``: tensors traced as fake copies, other objects
deep-copied, so nothing the caller passed is changed),
parallelizes the model with that plan, puts the model's own forward back and runs the call on the
parallelized model. Example::

    model = xla_tp.parallelize_xla(TwoInputs(), "auto", mesh=mesh)    # warns: planned at the first call
    y = model(x.to(device), gate.to(device))                           # planned, parallelized, run
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from torch import nn

from .dataflow.inputs import plannable

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
