"""``parallelize_xla(model, "auto")`` for a model whose input cannot be made up: planned at its first call.

When ``plan_for`` cannot build an input from what the model declares (``dataflow.inputs``), the
model is left as it is, with one forward pre-hook: at the first call it plans from that call's
arguments (``dataflow.inputs.plannable``: tensors traced as fake copies, other objects deep-copied,
so nothing the caller passed is changed), parallelizes the model with that plan, runs the pre-hooks
the parallelization added (torch read the model's hooks before this one ran) and removes itself; the
call then runs on the parallelized model. Example::

    model = xla_tp.parallelize_xla(TwoInputs(), "auto", mesh=mesh)    # warns: planned at the first call
    y = model(x.to(device), gate.to(device))                           # planned, parallelized, run
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

from torch import nn

from .dataflow.inputs import plannable

Parallelize = Callable[[tuple, dict], None]  # parallelizes the module, planned from these arguments
_PENDING: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # module -> its hook
_EARLY: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # module -> options set before it


def plan_at_first_call(module: nn.Module, parallelize: Parallelize, why: str) -> nn.Module:
    """Plan and parallelize ``module`` at its first call (see the module docstring); return ``module``."""
    warnings.warn(f"xla_tp: plan 'auto' could not make up an input for {type(module).__name__} ({why}); it is "
                  f"planned and parallelized at its first call", stacklevel=3)
    cancel(module)

    def first_call(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cancel(mod)
        before = set(mod._forward_pre_hooks)
        parallelize(*plannable(args, kwargs))
        for key, hook in list(mod._forward_pre_hooks.items()):
            if key in before:
                continue
            if key in mod._forward_pre_hooks_with_kwargs:
                out = hook(mod, args, kwargs)
                args, kwargs = out if out is not None else (args, kwargs)
            else:
                out = hook(mod, args)
                args = args if out is None else out if isinstance(out, tuple) else (out,)
        return args, kwargs

    _PENDING[module] = module.register_forward_pre_hook(first_call, with_kwargs=True)
    return module


def cancel(module: nn.Module) -> None:
    """Remove a pending first-call plan from ``module`` (nothing if there is none)."""
    handle = _PENDING.pop(module, None)
    if handle is not None:
        handle.remove()


def pending(module: nn.Module) -> bool:
    """Whether ``module`` is planned at its next call."""
    return module in _PENDING


def early_options(module: nn.Module, make: Callable[[], Any]) -> Any:
    """Options set on a pending ``module`` (``set_moe_options`` before its first call), made once."""
    if module not in _EARLY:
        _EARLY[module] = make()
    return _EARLY[module]


def take_early_options(module: nn.Module) -> Any:
    """The options ``early_options`` kept for ``module`` (None: none), handed to its new state once."""
    return _EARLY.pop(module, None)
