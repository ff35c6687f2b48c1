"""``plan_for(model, mesh)``: the plan ``parallelize_xla(model, "auto")`` applies, from the model's dataflow.

One forward is traced on fake tensors (``xla_tp.dataflow``); each weight's role comes from what
its tensors do (``roles``): column-parallel when its output features feed attention or an
element-wise chain into another projection, row-parallel when it contracts them back, vocab-parallel
for embeddings looked up with the input ids and output heads. Logical axes go to mesh axes through
one table (``xla_tp.axes.LOGICAL_AXES``). Nothing is decided by module names. Example:

>>> import xla_tp
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=128))
>>> plan = plan_for(llama, mesh=xla_tp.make_mesh(data=2, model=4))
>>> plan["model.layers.*.self_attn.q_proj"].role, plan["lm_head"].role
('column-parallel', 'vocab-parallel output head')
>>> plan.replicated["model.layers.0.self_attn.k_proj.weight"].startswith("its output splits into 2 heads")
True
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from torch import nn

from ..axes import canonical_axis, sizes_of
from ..dataflow.routing import find_experts
from ..dataflow.trace import trace
from ..errors import PlanError
from .plan import Plan, build_plan
from .experts import assign as assign_experts
from .roles import decide

__all__ = ["Plan", "plan_for"]


def axis_size(mesh: Any, tp_axis: str) -> int:
    """Size of ``tp_axis`` in ``mesh``: a mesh (``xs.Mesh``, ``DeviceMesh``) or axis sizes
    (``{"data": 2, "model": 4}``, which need no XLA runtime)."""
    sizes = sizes_of(mesh)
    axis = canonical_axis(tp_axis)
    if axis not in sizes:
        raise PlanError(f"tp_axis {tp_axis!r} is not an axis of the mesh (axes: {list(sizes)})")
    return sizes[axis]


def plan_for(model: nn.Module, mesh: Any = None, tp_axis: str = "model", *,
             example_inputs: Optional[Sequence[Any]] = None,
             example_kwargs: Optional[Mapping[str, Any]] = None, experts: Optional[str] = None) -> Plan:
    """The plan ``"auto"`` would apply to ``model`` on ``mesh`` (see the module docstring).

    ``mesh`` is a mesh (``xs.Mesh``, ``DeviceMesh``) or axis sizes such as ``{"model": 4}`` (``xla_tp.plan_for``
    also takes None: the global mesh of ``make_mesh``). Without
    ``example_inputs`` an input is synthesised (token ids for a model that starts with an embedding,
    floats of its first layer's width otherwise). Attention that cannot be split is a ``PlanError``;
    a weight whose role cannot be determined stays replicated, its reason in ``plan.replicated``.
    ``experts`` picks the layout of mixture-of-experts layers (``"expert-parallel"``,
    ``"expert-tensor-parallel"``, ``"replicated"``) instead of the cheapest (``planners.experts``).
    Example: ``plan_for(LlamaForCausalLM(cfg), mesh={"data": 2, "model": 4})``.
    """
    if not isinstance(model, nn.Module):
        raise PlanError(f"plan_for takes an nn.Module, got {type(model).__name__}")
    tp = axis_size(mesh, tp_axis)
    graph = trace(model, example_inputs, example_kwargs)
    found = find_experts(graph)
    roles = decide(graph, tp, frozenset(found.nodes))
    assign_experts(roles, found, tp, experts)
    plan = build_plan(model, graph, roles)
    plan.mesh_sizes = sizes_of(mesh)
    if not plan:
        raise PlanError(f"plan 'auto' found nothing to split in {type(model).__name__}: "
                        f"{_first_reasons(plan)}; pass a plan dict instead")
    return plan


def _first_reasons(plan: Plan) -> str:
    items = list(plan.replicated.items())[:3]
    return "; ".join(f"{n}: {why}" for n, why in items) or "it has no parameters"
