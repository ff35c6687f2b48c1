"""Check a normalised ``Layout`` against the model and the mesh before anything is mutated.

Example::

    validate(model, layout, mesh_axes={"data": 2, "model": 4})   # raises PlanError or returns None
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from .errors import PlanError
from .plan.layout import Layout


def validate(module: nn.Module, layout: Layout, mesh_axes: Mapping[str, int]) -> None:
    """Raise ``PlanError`` naming the first parameter, axis or module the layout cannot shard."""
    params = dict(module.named_parameters())
    for name, spec in layout.params.items():
        p = params[name]
        owner = _owner(layout, name)
        if len(spec) != p.dim():
            raise PlanError(f"{owner}: parameter {name!r} has {p.dim()} dims {tuple(p.shape)} but the "
                            f"spec {spec} has {len(spec)}")
        for dim, axes in enumerate(spec):
            if axes is None:
                continue
            names = axes if isinstance(axes, tuple) else (axes,)
            for a in names:
                if a not in mesh_axes:
                    raise PlanError(f"{owner}: parameter {name!r} is sharded over axis {a!r}, which the "
                                    f"mesh lacks (axes: {list(mesh_axes)})")
            n = math.prod(mesh_axes[a] for a in names)
            if p.shape[dim] % n:
                raise PlanError(f"{owner}: parameter {name!r} dim {dim} has size {p.shape[dim]}, not "
                                f"divisible by {n} (axis {axes!r}); pick a mesh whose {axes!r} size "
                                f"divides {p.shape[dim]} or leave this module out of the plan")
    _check_meta(module)


def _owner(layout: Layout, param_fqn: str) -> str:
    for fqn, ml in layout.modules.items():
        prefix = f"{fqn}." if fqn else ""
        if param_fqn.startswith(prefix) and param_fqn[len(prefix):] in ml.params:
            return f"plan key {ml.source!r} ({ml.style} on {fqn or '<root>'!r})"
    return "fsdp sharding"


def _check_meta(module: nn.Module) -> None:
    """A meta tensor can only be materialised by its module's ``reset_parameters()``."""
    for fqn, mod in module.named_modules():
        meta = [n for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
                if t is not None and t.device == torch.device("meta")]
        if meta and not callable(getattr(mod, "reset_parameters", None)):
            raise PlanError(f"module {fqn or '<root>'!r} ({type(mod).__name__}) has tensors {meta} on the "
                            f"meta device and no reset_parameters() to initialise them; add one or "
                            f"materialise the module before parallelize_xla")
