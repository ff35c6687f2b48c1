"""A recipe's ``plan`` -> what ``parallelize_xla`` takes, and the per-parameter specs it implies.

``plan: auto`` (xla_tp's planner), ``plan: hf`` (the model's own ``tp_plan``), an inline mapping
or a YAML plan file. A mapping whose values are all strings is an HF-style plan (``colwise``,
``rowwise``, ...); any other mapping is a torchprime-style rule mapping (FQN -> one mesh axis per
dimension, see ``xla_tp.load_rules``). Example::

    plan = plan_input(recipe)                      # "auto", "hf" or a plan dict
    planned = plan_specs(meta_model, plan, mesh)   # specs per parameter, without touching the model
    planned.specs["model.layers.0.self_attn.q_proj.weight"]    # ('model', 'fsdp') on fsdp x model
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import yaml
from torch import nn

import xla_tp

from ..dataflow.graph import Graph
from ..plan.layout import Spec
from ..plan.normalize import build_layout
from .recipe import Recipe, plan_file
from .schema import LaunchError

PlanInput = Union[str, dict[str, Any]]


@dataclass
class PlannedSpecs:
    """Per-parameter specs of a plan on one mesh, where the plan came from, and replicated reasons."""

    specs: dict[str, Spec]
    source: str
    replicated: dict[str, str] = field(default_factory=dict)
    graph: Optional[Graph] = None   # the model's trace, when "auto" made one (another mesh's plan reuses it)


def plan_input(recipe: Recipe) -> PlanInput:
    """The recipe's plan in a form ``parallelize_xla`` accepts."""
    plan = recipe.plan
    if plan in ("auto", "hf"):
        return plan
    where = f"{recipe.path}: plan"
    if isinstance(plan, str):
        path = plan_file(plan, where)
        plan = yaml.safe_load(path.read_text())
        where = str(path)
    if not isinstance(plan, dict) or not plan:
        raise LaunchError(f"{where}: a plan is 'auto', 'hf' or a non-empty mapping of FQN patterns")
    if all(isinstance(v, str) for v in plan.values()):
        return dict(plan)
    return xla_tp.load_rules(plan)


def plan_specs(model: nn.Module, plan: PlanInput, mesh: Any, graph: Optional[Graph] = None) -> PlannedSpecs:
    """What ``plan`` does to every parameter of ``model`` (which may be on ``meta``) on ``mesh``.

    Goes through the same front-ends as ``parallelize_xla``: ``plan_for`` for "auto",
    ``hf_plan`` for "hf", the plan normaliser for both and for user plans. Nothing is mutated.
    ``graph``: the model's trace from an earlier "auto" plan (``PlannedSpecs.graph``), not made again.
    """
    if plan == "auto":
        plan = xla_tp.plan_for(model, mesh=mesh, graph=graph)
    elif plan == "hf":
        plan = xla_tp.hf_plan(model)
    axes = {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.mesh_shape)}
    layout = build_layout(model, plan, axes, "model", strict=True)
    source = "auto: roles from the model's dataflow" if hasattr(plan, "roles") else "user plan"
    return PlannedSpecs(layout.params, source, dict(getattr(plan, "replicated", {})), getattr(plan, "graph", None))
