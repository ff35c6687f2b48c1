"""The layouts applied to a model, merged: one answer for a model parallelized in several calls.

torch's idiom parallelizes a model with several ``parallelize_module`` calls (the root, then each
block; or the blocks first). Each call records its ``Layout`` on the module it was given;
``layout_of`` merges every record under a model into one ``Layout`` whose FQNs are relative to
that model. Where two calls plan the same module or parameter, the later call wins; a new call on
the same module replaces that module's earlier call. Example::

    parallelize_module(model, tp_mesh, {"tok_embeddings": RowwiseParallel(), "output": ColwiseParallel()})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {"attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel()})
    layout_of(model).params   # {'tok_embeddings.weight': ..., 'layers.0.attention.wq.weight': ..., ...}
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Optional

from torch import nn

from ..errors import PlanError
from ..guard import SHARDING_ATTR
from .layout import Layout

_ATTR = "_xla_tp_applied"
_calls = itertools.count(1)


@dataclass(frozen=True)
class Applied:
    """One ``parallelize_xla`` call, as recorded on the module it was given."""

    call: int  # order of the call in the process: later calls win
    layout: Layout
    records: dict[str, Any]  # parameter FQN -> the sharding record this call left on the parameter


def applied_layout(module: nn.Module) -> Optional[Layout]:
    """The layout of the last call made on ``module`` itself (not on its parents or children)."""
    applied = getattr(module, _ATTR, None)
    return applied.layout if applied is not None else None


def record_layout(module: nn.Module, layout: Layout) -> None:
    """Record ``layout`` as the latest call on ``module`` (after its parameters were sharded)."""
    params = dict(module.named_parameters())
    records = {name: getattr(params[name], SHARDING_ATTR, None) for name in layout.params}
    setattr(module, _ATTR, Applied(next(_calls), layout, records))


def stale_params(module: nn.Module, layout: Layout) -> set[str]:
    """Parameters the previous call on ``module`` sharded that ``layout`` leaves out.

    A parameter that a later call (on a parent or a child) sharded again belongs to that call
    and is not stale. Example: MLP parallelized with fc1 and fc2, then again with fc2 only ->
    ``{"fc1.weight", "fc1.bias"}``.
    """
    previous = getattr(module, _ATTR, None)
    if previous is None:
        return set()
    params = dict(module.named_parameters())
    return {name for name, record in previous.records.items()
            if record is not None and name not in layout.params and name in params
            and getattr(params[name], SHARDING_ATTR, None) is record}


def layout_of(model: nn.Module) -> Optional[Layout]:
    """Every layout applied to ``model`` and its submodules, merged (FQNs relative to ``model``).

    None when nothing under ``model`` was parallelized. Calls that disagree on the tensor-parallel
    axis or the batch axes cannot be merged: ``PlanError``.
    """
    found = sorted(((applied.call, prefix, applied.layout) for prefix, mod in model.named_modules()
                    if (applied := getattr(mod, _ATTR, None)) is not None), key=lambda item: item[0])
    if not found:
        return None
    axes = {(layout.tp_axis, layout.batch_axes) for _, _, layout in found}
    if len(axes) > 1:
        where = ", ".join(f"{prefix or '<root>'}: tp {layout.tp_axis!r}, batch {layout.batch_axes}"
                          for _, prefix, layout in found)
        raise PlanError(f"the model was parallelized by calls on different axes ({where}); parallelize every "
                        f"part on the same mesh and tensor-parallel axis, or pass plan_layout= to the audit")
    (tp_axis, batch_axes), = axes
    merged = Layout(tp_axis=tp_axis, batch_axes=batch_axes)
    for _, prefix, layout in found:
        for fqn, module_layout in layout.modules.items():
            merged.modules[_join(prefix, fqn)] = replace(module_layout, fqn=_join(prefix, fqn))
        merged.params.update({_join(prefix, name): spec for name, spec in layout.params.items()})
    return merged


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
