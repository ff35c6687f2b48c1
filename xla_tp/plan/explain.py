"""``explain(model, plan, mesh)``: what a plan does to every parameter, as text.

Per parameter: the plan key that matched (or why it stays replicated), its spec, per-device
shape and bytes (``xla_tp.report``'s table), then the per-device total against the ideal
``total / model-axis size``. Nothing is mutated. Example::

    print(explain(model, plan_for(model, mesh=mesh), mesh))
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from torch import nn

from ..mesh import canonical_axis, to_xs_mesh
from ..report import ParamRow, format_table, local_shape
from .normalize import build_layout


def param_rules(model: nn.Module, plan: Mapping, mesh: Any, tp_axis: str = "model") -> dict[str, tuple]:
    """Parameter FQN -> (plan key, spec) for every parameter the plan shards."""
    xmesh = to_xs_mesh(mesh)
    axes = dict(zip(xmesh.axis_names, (int(s) for s in xmesh.mesh_shape)))
    layout = build_layout(model, plan, axes, canonical_axis(tp_axis), strict=False)
    out = {}
    for fqn, ml in layout.modules.items():
        for local in ml.params:
            out[f"{fqn}.{local}" if fqn else local] = (ml.source, layout.params.get(f"{fqn}.{local}" if fqn else local))
    return out


def explain(model: nn.Module, plan: Mapping, mesh: Any = None, tp_axis: str = "model") -> str:
    """The sharding table, totals and the replicated list with reasons."""
    xmesh = to_xs_mesh(mesh)
    rules = param_rules(model, plan, xmesh, tp_axis)
    reasons = getattr(plan, "replicated", {})
    rows, lines = [], []
    for name, p in model.named_parameters():
        key, spec = rules.get(name, ("-", None))
        spec = spec or (None,) * p.dim()
        loc = local_shape(tuple(p.shape), spec, xmesh)
        rows.append(ParamRow(f"{name}  <- {key}", tuple(p.shape), spec, loc, math.prod(loc) * p.element_size()))
        if all(a is None for a in spec):
            lines.append(f"  {name}: {reasons.get(name, 'no plan key shards it')}")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tp = dict(zip(xmesh.axis_names, xmesh.mesh_shape)).get(canonical_axis(tp_axis), 1)
    per_device = sum(r.local_bytes for r in rows)
    head = f"family: {getattr(plan, 'family', 'user plan')}"
    summary = (f"per device: {per_device} bytes of {total} total (ideal total/{tp} = {total // tp}; "
               f"ratio {per_device / max(total / tp, 1):.2f})")
    return "\n".join([head, format_table(rows), summary, "replicated:", *lines])
