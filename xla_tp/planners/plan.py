"""``Plan``: the dict "auto" applies, with the roles and reasons behind it.

A ``Plan`` is a plan dict (module FQN pattern -> style) with what a planner knows beside it: each
parameter's role and reason (``roles``), which parameters stay replicated and why (``replicated``),
packed projections to re-lay before placing (``packings``), the modules that slice them
(``slicers``: the packed-output mode runs there) and the traced forward the roles came from
(``graph``). Every plan ``parallelize_xla`` takes becomes one (``Plan.of``); the planner's has its
``LogicalStyle``s built from the roles ``roles.decide`` found, with layer indices as ``*`` where every
layer has the same style. Example:

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
from typing import Any, Mapping, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..dataflow.graph import Graph
from ..errors import PlanError
from ..plan.explain import explain
from ..plan.packing import Packing
from .experts import SUMS
from .logical import LogicalStyle
from .alternatives import Choice
from .prices import Price
from .roles import ParamRole, Role, Roles

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a leading index stays: "0" must not become "*"


def pattern(fqn: str) -> str:
    """Layer indices as ``*``.

    >>> pattern("model.layers.3.mlp.up_proj"), pattern("0.weight")
    ('model.layers.*.mlp.up_proj', '0.weight')
    """
    return _INDEX.sub("*", fqn)


class Plan(dict):
    """FQN pattern -> style, plus ``roles``, ``replicated``, ``packings``, ``slicers`` and ``graph``
    (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.roles: dict[str, ParamRole] = {}
        self.replicated: dict[str, str] = {}
        self.packings: dict[str, Packing] = {}
        self.slicers: frozenset[str] = frozenset()
        self.concats: dict[tuple[int, ...], int] = {}  # concatenations laid device-major (``Roles.concats``)
        self.tagged_concats: set[tuple[int, ...]] = set()  # those read channel by channel (``Roles.tagged_concats``)
        self.graph: Optional[Graph] = None
        self.choices: list[Choice] = []  # blocks off the optimum, with their priced alternatives
        self.prices: list[tuple[str, Price]] = []  # each block split (its projections) and its price
        self.whole_attention: list[str] = []  # attention computed whole, and why
        self.blocks: list[frozenset[str]] = []  # weights decided together (``Roles.blocks``)
        self.mesh_sizes: Optional[dict[str, int]] = None  # the mesh a planner planned for

    @classmethod
    def of(cls, styles: Mapping[str, Any]) -> "Plan":
        """``styles`` (a plan dict) as a ``Plan``; a ``Plan`` itself is returned as it is."""
        return styles if isinstance(styles, Plan) else cls(styles)

    def explain(self, model: nn.Module, mesh: Any = None, tp_axis: str = "model") -> str:
        """Text: per parameter its role and why, spec, per-device shape and bytes; totals; padding.
        ``mesh`` (a mesh or axis sizes) defaults to the one the plan was made for."""
        if mesh is None and self.mesh_sizes is None:
            raise PlanError("explain needs the mesh: pass mesh= (a mesh or axis sizes such as {'model': 4})")
        return explain(model, self, self.mesh_sizes if mesh is None else mesh, tp_axis)

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
            if role is None or role.kind == Role.REPLICATED:
                plan.replicated[name] = role.why if role is not None else default_reason(graph, group[0])
                continue
            owner, _, local = name.rpartition(".")
            by_module.setdefault(owner, {})[local] = role
            plan.roles[name] = role
        if role is not None and role.packing is not None:
            plan.packings[group[0]] = role.packing
    styles = {fqn: _style(params, roles.natural.get(fqn)) for fqn, params in by_module.items()}
    for fqn, natural in roles.natural.items():  # a module whose own math sums split stacked experts
        if natural == SUMS and fqn not in styles:
            styles[fqn] = LogicalStyle({}, "sums split stacked experts (a partial sum)", Partial())
    _compress(plan, styles, [f for f, _ in model.named_modules()])
    plan.slicers = frozenset(roles.sites)
    plan.concats, plan.tagged_concats = dict(roles.concats), set(roles.tagged_concats)
    plan.graph = graph
    plan.choices, plan.whole_attention, plan.blocks = roles.choices, roles.whole_attention, roles.blocks
    plan.prices = roles.prices
    return plan


def _style(params: dict[str, ParamRole], natural: Optional[str]) -> LogicalStyle:
    """``natural``: what the module's own output is where the trace saw it used (a tied weight's
    embedding module emits partial sums, its head module split logits); else from its parameters."""
    kinds = {r.kind for r in params.values()}
    kind = next(k for k in (Role.ROW, Role.VOCAB, Role.HEAD, Role.COLUMN, Role.EXPERTS) if k in kinds)
    if natural is None:
        natural = next((n for n in ("partial", "whole input", "rows") if any(r.natural == n for r in params.values())),
                       "shard")
    if kind in (Role.VOCAB, Role.HEAD):
        kind = Role.HEAD if natural == "shard" else Role.VOCAB
    # an output head's logits are held split (and their gradient): a compiler left to choose may
    # compute part of the head's backward whole (measured with JAX's partitioner)
    outputs = ((Shard(-1),),) if kind == Role.HEAD else ()
    # "rows": stacked experts split by experts emit their experts' rows of a [E * tokens, ...] output (the sum
    # over the experts, after them, is the reduction); a routed layer's own math contracts its split input back,
    # as torch's MultiheadAttention's does (its column-split in_proj_weight, then out_proj inside its forward)
    placement = {"partial": Partial(), "whole input": Partial(), "rows": Shard(0)}.get(natural, Shard(-1))
    # "whole input": a row-parallel projection alone (``roles._set_alone``) reads the whole activation, held so at
    # run time (a chain of two: ``constraints.runtime_chain`` leaves out a single Replicate as implied); left free,
    # the compiler carries the weight's split input features back into the residual stream (all-gathers in the layers)
    inputs = ((Replicate(), Replicate()),) if natural == "whole input" else ()
    return LogicalStyle({n: r.axes for n, r in sorted(params.items())}, kind.text, placement, outputs,
                        input_grad=kind in (Role.EXPERTS, Role.COLUMN) and natural == "partial", inputs=inputs)


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
