"""Rule-based planners: ``plan_for(model, mesh)`` -> the ``Plan`` ``parallelize_xla(model, "auto")`` uses.

One small file per family, each a table of (FQN suffix, role) plus a structural ``detect``; the
first family whose structure matches wins (most specific first, plain Linear stacks last).
Example::

    plan = plan_for(model, mesh=xla_tp.make_mesh(data=2, model=4))
    plan.family, plan.replicated          # 'hf_decoder', {'model.norm.weight': 'norm: ...', ...}
    print(plan.explain(model, mesh))
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ..errors import PlanError
from ..mesh import canonical_axis, to_xs_mesh
from . import bert, gpt2, hf_decoder, mlp, titan, torch_transformer
from .plan import Plan

FAMILIES = (torch_transformer, gpt2, bert, hf_decoder, titan, mlp)

__all__ = ["FAMILIES", "Plan", "plan_for"]


def axis_size(mesh: Any, tp_axis: str) -> int:
    """Size of ``tp_axis`` in ``mesh``: any mesh ``parallelize_xla`` accepts, or axis sizes
    (``{"data": 2, "model": 4}``, which need no XLA runtime)."""
    if isinstance(mesh, Mapping):
        sizes = {canonical_axis(str(k)): int(v) for k, v in mesh.items()}
    else:
        xmesh = to_xs_mesh(mesh)
        sizes = dict(zip(xmesh.axis_names, (int(s) for s in xmesh.mesh_shape)))
    axis = canonical_axis(tp_axis)
    if axis not in sizes:
        raise PlanError(f"tp_axis {tp_axis!r} is not an axis of the mesh (axes: {list(sizes)})")
    return sizes[axis]


def plan_for(model: nn.Module, mesh: Any = None, tp_axis: str = "model") -> Plan:
    """The plan ``"auto"`` would apply to ``model`` on ``mesh``: recognised by module structure.

    ``mesh`` is any mesh ``parallelize_xla`` accepts, or axis sizes such as ``{"model": 4}``.

    Example: ``plan_for(LlamaForCausalLM(cfg), mesh=make_mesh(data=2, model=4)).family == "hf_decoder"``.

    A model no planner recognises is a ``PlanError`` (pass a plan instead); a recognised one whose
    dimensions do not divide the axis gets a plan that leaves them replicated, with the reasons in
    ``plan.replicated``.
    """
    tp = axis_size(mesh, tp_axis)
    for family in FAMILIES:
        if family.detect(model):
            return family.plan(model, tp)
    raise PlanError(f"no planner recognises {type(model).__name__} (families: HF decoders, GPT-2, "
                    f"BERT/RoBERTa, torch transformer layers, torchtitan Llama, Linear stacks); "
                    f"pass a plan dict instead")
