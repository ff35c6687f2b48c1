"""``Plan``: the dict "auto" applies, with the roles and reasons behind it.

A ``Plan`` is an ordinary plan dict (module FQN pattern -> ``LogicalStyle``) built from the roles
``roles.decide`` found. It also remembers each parameter's role and reason (``roles``), which
parameters stay replicated and why (``replicated``), packed projections to re-lay before placing
(``packings``) and the modules that slice them (``slicers``: the packed-output mode runs there).
Layer indices become ``*`` where every layer has the same style. Example:

>>> import xla_tp
>>> from torch import nn
>>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16))
>>> plan = xla_tp.plan_for(mlp, mesh=xla_tp.make_mesh(data=2, model=4))
>>> plan["0"], plan["2"]
(LogicalStyle(column-parallel: {'bias': ('mlp',), 'weight': ('mlp', 'embed')}), LogicalStyle(row-parallel: {'weight': ('embed', 'mlp')}))
>>> plan.replicated["3.weight"]
'element-wise weight (layer_norm in 3, e.g. a norm scale): small, replicated'
"""
from __future__ import annotations

import re
from typing import Any, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Partial, Shard

from ..dataflow.graph import Graph
from ..lowering import packed
from .alternatives import Choice
from .logical import LogicalStyle
from .roles import ParamRole, Roles

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a leading index stays: "0" must not become "*"
KIND_TEXT = {"column": "column-parallel", "row": "row-parallel", "vocab": "vocab-parallel embedding",
             "head": "vocab-parallel output head"}


def pattern(fqn: str) -> str:
    """Layer indices as ``*``.

    >>> pattern("model.layers.3.mlp.up_proj"), pattern("0.weight")
    ('model.layers.*.mlp.up_proj', '0.weight')
    """
    return _INDEX.sub("*", fqn)


class Plan(dict):
    """FQN pattern -> style, plus ``roles``, ``replicated``, ``packings`` and ``sites`` (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.roles: dict[str, ParamRole] = {}
        self.replicated: dict[str, str] = {}
        self.packings: dict[str, packed.Packing] = {}
        self.slicers: frozenset[str] = frozenset()
        self.choices: list[Choice] = []  # blocks off the optimum, with their priced alternatives
        self.whole_attention: list[str] = []  # attention computed whole, and why

    def relayout(self, model: nn.Module) -> None:
        """Re-lay the packed projections device-major (shapes unchanged; run after validation)."""
        for name, packing in self.packings.items():
            owner, _, local = name.rpartition(".")
            packed.relayout(model.get_submodule(owner), local, packing)

    def explain(self, model: nn.Module, mesh: Any = None, tp_axis: str = "model") -> str:
        """Text: per parameter its role and why, spec, per-device shape and bytes; totals; padding."""
        from ..plan.explain import explain
        return explain(model, self, mesh, tp_axis)

    def __repr__(self) -> str:
        return f"Plan({dict.__repr__(self)})"


def build_plan(model: nn.Module, graph: Graph, roles: Roles) -> Plan:
    """The plan dict for ``roles``: one ``LogicalStyle`` per module holding a split parameter."""
    plan = Plan()
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    by_module: dict[str, dict[str, ParamRole]] = {}
    for group in names.values():
        role = roles.params.get(group[0])
        for name in group:
            if role is None or role.kind == "replicated":
                plan.replicated[name] = role.why if role is not None else default_reason(graph, group[0])
                continue
            owner, _, local = name.rpartition(".")
            by_module.setdefault(owner, {})[local] = role
            plan.roles[name] = role
        if role is not None and role.packing is not None:
            plan.packings[group[0]] = role.packing
    styles = {fqn: _style(params, roles.natural.get(fqn)) for fqn, params in by_module.items()}
    _compress(plan, styles, [f for f, _ in model.named_modules()])
    plan.slicers = frozenset(roles.sites)
    plan.choices, plan.whole_attention = roles.choices, roles.whole_attention
    return plan


def _style(params: dict[str, ParamRole], natural: Optional[str]) -> LogicalStyle:
    """``natural``: what the module's own output is where the trace saw it used (a tied weight's
    embedding module emits partial sums, its head module split logits); else from its parameters."""
    kinds = {r.kind for r in params.values()}
    kind = next(k for k in ("row", "vocab", "head", "column") if k in kinds)
    if natural is None:
        natural = "partial" if any(r.natural == "partial" for r in params.values()) else "shard"
    if kind in ("vocab", "head") and natural == "shard":
        kind = "head"
    elif kind in ("vocab", "head"):
        kind = "vocab"
    # an output head's logits are held split (and their gradient): a compiler left to choose may
    # compute part of the head's backward whole (measured with JAX's partitioner)
    outputs = ((Shard(-1),),) if kind == "head" else ()
    return LogicalStyle({n: r.axes for n, r in sorted(params.items())}, KIND_TEXT[kind],
                        Partial() if natural == "partial" else Shard(-1), outputs)


def _compress(plan: Plan, styles: dict[str, LogicalStyle], modules: list[str]) -> None:
    """Key by ``pattern`` where every module of the pattern has the same style, else by exact FQN."""
    groups: dict[str, list[str]] = {}
    for fqn in modules:
        groups.setdefault(pattern(fqn), []).append(fqn)
    for key, fqns in groups.items():
        found = [styles.get(f) for f in fqns]
        if all(s is None for s in found):
            continue
        if all(s is not None and s == found[0] for s in found):
            plan[key] = found[0]
        else:
            plan.update({f: s for f, s in zip(fqns, found) if s is not None})


def default_reason(graph: Graph, name: str) -> str:
    """Why a parameter no role covers stays replicated, from how the forward used it."""
    v = graph.params.get(name)
    if v is None or not v.consumers:
        return "not used by the traced forward"
    node = v.consumers[0][0]
    if node.op in ("layer_norm", "rms_norm", "group_norm") or node.op in ("mul", "add", "rmul", "radd"):
        return f"element-wise weight ({node.op} in {node.module or '<root>'}, e.g. a norm scale): small, replicated"
    return f"used by '{node.op}' in {node.module or '<root>'}: no rule splits it, replicated"
