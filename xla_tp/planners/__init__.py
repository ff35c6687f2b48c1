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

import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

from torch import nn

from ..axes import EXPERT, canonical_axis, sequence_axes, sizes_of
from ..dataflow.graph import Graph
from ..dataflow.routing import find_experts
from ..dataflow.stacked import find_stacked
from ..dataflow.trace import trace
from ..errors import PlanError
from .alternatives import Pick
from .plan import Plan, build_plan
from .experts import assign as assign_experts, assign_stacked
from .roles import Roles, decide

PaddingCheck = Callable[..., str]  # why the model cannot run padded ("" if it can): ``lowering.padding``

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
             example_kwargs: Optional[Mapping[str, Any]] = None, strict: bool = False,
             pick: Optional[Pick] = None, check: Optional[PaddingCheck] = None, experts: Optional[str] = None,
             graph: Optional[Graph] = None) -> Plan:
    """The plan ``"auto"`` would apply to ``model`` on ``mesh`` (see the module docstring).

    ``mesh`` is a mesh (``xs.Mesh``, ``DeviceMesh``) or axis sizes such as ``{"model": 4}`` (``xla_tp.plan_for``
    also takes None: the global mesh of ``make_mesh``). Without
    ``example_inputs`` an input is synthesised (token ids for a model that starts with an embedding,
    floats of its first layer's width otherwise). A block that cannot be split the optimal way takes
    the cheapest valid alternative (``plan.choices``); attention nothing splits is computed whole
    (``plan.whole_attention``); a weight whose role cannot be determined stays replicated, its reason
    in ``plan.replicated``. ``strict=True`` accepts only the optimum: any of these is a ``PlanError``.
    ``pick(choice)`` may take another of a block's alternatives than the cheapest (``choice.alternatives``).
    ``check(model, packings, graph, example_inputs, example_kwargs)`` says why the model cannot run with
    zero heads added (``lowering.padding``; ``xla_tp.plan_for`` passes it): without it none are added.
    ``experts`` picks the layout of mixture-of-experts layers (``"expert-parallel"``,
    ``"expert-tensor-parallel"``, ``"replicated"``) instead of the cheapest (``planners.experts``).
    ``graph``: this model's trace on these inputs, already made (``plan.graph`` of its plan on another mesh:
    the trace does not depend on the mesh, and an 80-layer model takes seconds to trace).
    Example: ``plan_for(LlamaForCausalLM(cfg), mesh={"data": 2, "model": 4})``.
    """
    if not isinstance(model, nn.Module):
        raise PlanError(f"plan_for takes an nn.Module, got {type(model).__name__}")
    tp = axis_size(mesh, tp_axis)
    ep = sizes_of(mesh).get(EXPERT, 1)
    graph = graph if graph is not None else trace(model, example_inputs, example_kwargs)
    found, stacked = find_experts(graph), find_stacked(graph)
    on_meta = any(p.is_meta for p in model.parameters())
    meta = "the model is on meta: its own init would fill the zero heads" if on_meta else ""

    def roles(padding: str) -> Roles:
        out = _decided(graph, tp, padding, pick, not on_meta, frozenset(found.nodes), sizes_of(mesh))
        assign_experts(out, found, tp, experts, ep)
        assign_stacked(out, stacked, tp, experts)
        return out

    plan = build_plan(model, graph, roles(meta or ("" if check else "no check of the padded model was given")))
    problem = check(model, plan.packings, graph, example_inputs, example_kwargs) if check else ""
    if problem:  # zero heads were cheapest but the model does not run with them: the next best
        plan = build_plan(model, graph, roles(f"the model does not run with them ({problem})"))
    plan.mesh_sizes = sizes_of(mesh)
    if strict:
        _require_optimum(model, plan)
    if not plan:
        warnings.warn(f"xla_tp: plan 'auto' found nothing to split in {type(model).__name__} "
                      f"({_first_reasons(plan)}): every parameter is replicated", stacklevel=2)
    return plan


def _decided(graph: Graph, tp: int, padding: str, pick: Optional[Pick], copies: bool, routed: frozenset[int],
             sizes: dict[str, int]) -> Roles:
    """``roles.decide``, kept with the graph for the next plan on a mesh with the same model and context axes
    (a launcher prices several meshes on one trace; the context axis changes the blocks' prices); a copy of it
    (not with ``pick``: a function may pick anything)."""
    if pick is not None:
        return decide(graph, tp, padding, pick, copies=copies, routed=routed, sizes=sizes)
    key = ("roles", tp, padding, copies, routed, tuple((a, sizes[a]) for a in sequence_axes(sizes)))
    if key not in graph.derived:
        graph.derived[key] = decide(graph, tp, padding, copies=copies, routed=routed, sizes=sizes)
    return graph.derived[key].copy()


def _require_optimum(model: nn.Module, plan: Plan) -> None:
    """``strict=True``: a ``PlanError`` naming what keeps ``plan`` from the optimum."""
    problems = [f"{c.block}: {c.why} (cheapest alternative: {c.chosen.name})" for c in plan.choices[:3]]
    problems += [f"attention computed whole: {line}" for line in plan.whole_attention]
    if not plan:
        problems.append(f"nothing to split ({_first_reasons(plan)})")
    if problems:
        raise PlanError(f"plan 'auto' cannot reach the optimum for {type(model).__name__} (strict=True): "
                        + " | ".join(problems) + ". Pass strict=False to take the cheapest valid plan, "
                        "a plan dict, or a mesh whose model axis divides the heads")


def _first_reasons(plan: Plan) -> str:
    items = list(plan.replicated.items())[:3]
    return "; ".join(f"{n}: {why}" for n, why in items) or "it has no parameters"
