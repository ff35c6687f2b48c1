"""Routed experts in "auto": each MoE layer's weights split by experts or by their features, priced.

For each layer ``dataflow.routing`` found (a router's top-k selecting slices of ``[E, ...]`` weights),
the two layouts of the experts lowering (``xla_tp.lowering.experts``) are priced with the audit's
terms, and the cheapest that the model axis (``N`` devices) divides is taken (first in the table):

================================  ========================================  ==============================
layout                            per device                                 communication per layer
================================  ========================================  ==============================
expert-tensor-parallel            every expert's ``1/N`` of the intermediate  one all-reduce of ``[tokens,
(``I % N == 0``)                  features, every routed token                hidden]`` (and one backward)
expert-parallel (``E % N == 0``)  ``E/N`` whole experts, their tokens' rows   the same
replicated                        everything                                  none
================================  ========================================  ==============================

Both split layouts hold ``1/N`` of the expert weights and compute ``1/N`` of the expert FLOPs of an even
routing. Dropless (the default), expert-tensor-parallel is the cheaper: every device computes ``1/N`` of
each token's rows whatever the router's skew, and holds ``1/N`` of each row, where under expert-parallel
the busiest device computes its experts' rows whole (a skewed router: 1.6-1.75x the even share, the bench's
``costs``) and a dropless layer must keep room for every row. It is taken wherever ``N`` divides the
intermediate features, else expert-parallel; ``experts="expert-parallel"`` asks for it (with token dropping,
``set_moe_options(capacity_factor=...)``, it holds ``1/N`` of the dispatched tokens).

A mesh with an ``expert`` axis (``make_mesh(expert=2, model=4)``; the batch is split over it too)
splits the experts over it wherever its size divides them (``dispatched_experts``): each batch shard
sends its tokens' slots to the devices holding their experts and takes the results back (an
all-to-all each way, and two in the backward), and the model axis splits each expert's features
(expert-tensor-parallel, or nothing where it does not divide them). A
weight packing gate and up (``[E, 2I, H]``: its output is twice what the second weight contracts)
is re-laid device-major under expert-tensor-parallel. The router stays replicated (its scores pick
experts on every device); shared experts and dense layers are planned like any MLP. ``plan_for(...,
experts="expert-tensor-parallel")`` asks for a layout instead of the cheapest. Example::

    found = find_experts(graph)
    assign(roles, found, tp=4)       # roles.params["model.layers.0.mlp.experts.down_proj"].axes == ("experts", None, None)
"""
from __future__ import annotations

from typing import Optional

from ..dataflow.routing import ExpertsFound, ExpertWeight
from ..dataflow.stacked import StackedLayer
from ..errors import PlanError
from ..plan.packing import Packing
from .roles import ParamRole, Roles

SUMS = "sums"  # ``Roles.natural`` of a module summing split stacked experts' outputs: a partial sum
EXPERT_PARALLEL, EXPERT_TENSOR_PARALLEL, REPLICATED = "expert-parallel", "expert-tensor-parallel", "replicated"
LAYOUTS = (EXPERT_PARALLEL, EXPERT_TENSOR_PARALLEL, REPLICATED)


def choose(experts: int, inter: int, tp: int, wanted: Optional[str] = None) -> tuple[str, str]:
    """The layout for ``experts`` experts of ``inter`` intermediate features on ``tp`` devices, and why:
    the cheapest, or ``wanted`` where ``tp`` divides what it splits.

    >>> choose(8, 32, 4)[0], choose(8, 30, 4)[0], choose(6, 30, 4)[0], choose(8, 32, 4, "expert-parallel")[0]
    ('expert-tensor-parallel', 'expert-parallel', 'replicated', 'expert-parallel')
    """
    cost = "one all-reduce of [tokens, hidden] per layer (one more in the backward)"
    if wanted == REPLICATED:
        return REPLICATED, "replicated, as asked (experts=...): computed whole on every device"
    if wanted == EXPERT_PARALLEL and tp > 1 and experts % tp == 0:
        return EXPERT_PARALLEL, (f"expert-parallel, as asked (experts=...): {experts} experts split {tp} ways "
                                 f"({experts // tp} per device, with their token slots); {cost}")
    if tp > 1 and inter % tp == 0:
        return EXPERT_TENSOR_PARALLEL, (f"expert-tensor-parallel: each expert's {inter} intermediate features split "
                                        f"{tp} ways, every routed token on every device; {cost}; dropless (the "
                                        f"default) every device computes 1/{tp} of each token's rows, whatever the "
                                        f"router's skew, and holds 1/{tp} of each row (expert-parallel: the busiest "
                                        f"device's experts' rows, whole)")
    if tp > 1 and experts % tp == 0:
        return EXPERT_PARALLEL, (f"expert-parallel: {experts} experts split {tp} ways ({experts // tp} per device, "
                                 f"with their token slots); {cost} (their {inter} features do not split {tp} ways)")
    return REPLICATED, (f"replicated: neither the {experts} experts nor their {inter} intermediate features split "
                        f"{tp} ways; computed whole on every device (no communication)")


def over_expert_axis(experts: int, ep: int, wanted: Optional[str] = None) -> tuple[bool, str]:
    """Whether ``experts`` experts split over an expert axis of ``ep`` devices, and why.

    >>> over_expert_axis(8, 2)[0], over_expert_axis(6, 4)[0], over_expert_axis(8, 2, "replicated")[0]
    (True, False, False)
    """
    if ep <= 1 or wanted == REPLICATED:
        return False, ""
    if experts % ep:
        return False, (f"the {experts} experts do not split over the expert axis's {ep} devices: held on each of "
                       f"them (the expert axis splits only the batch here); ")
    return True, (f"{experts} experts split {ep} ways over the expert axis ({experts // ep} per device): each batch "
                  f"shard's token slots reach their experts by an all-to-all and come back by another (two more in "
                  f"the backward); ")


def assign(roles: Roles, found: ExpertsFound, tp: int, layout: Optional[str] = None, ep: int = 1) -> None:
    """Set the roles of every routed layer's weights and its router (see the module docstring);
    ``layout`` (one of ``LAYOUTS``) instead of the cheapest, where the model axis divides what it splits;
    ``ep``: the size of the mesh's expert axis."""
    if layout is not None and layout not in LAYOUTS:
        raise PlanError(f"experts={layout!r} is not an experts layout; pass one of {', '.join(LAYOUTS)} (or None: "
                        f"the cheapest)")
    for layer in found.layers:
        if len(layer.weights) != 2:
            continue  # not a two-projection expert MLP: its weights keep the reasons the trace gives
        up, down = layer.weights
        experts, inter = up.param.shape[up.expert_dim], down.param.shape[down.contracted]
        dispatched, ep_why = over_expert_axis(experts, ep, layout)
        layout_, why = _on_model_axis(experts, inter, tp, layout, dispatched)
        packing = _gate_up(up, inter, tp) if layout_ == EXPERT_TENSOR_PARALLEL else None
        for weight, feature in ((up, up.kept), (down, down.contracted)):
            axes = _axes(weight, feature, layout_, dispatched)
            roles.set(weight.param, ParamRole("experts", axes, ep_why + why, "partial",
                                              packing if weight is up else None), layer.module)
        if layer.router is not None:
            roles.set(layer.router, ParamRole("replicated", (None,) * len(layer.router.shape),
                                              f"router of {layer.module}: its top-{layer.top_k} choice picks experts "
                                              f"on every device, so it is computed whole"))


def assign_stacked(roles: Roles, layers: list[StackedLayer], tp: int, layout: Optional[str] = None) -> None:
    """Stacked experts every token runs through (``dataflow.stacked``: Llama 4's), split by experts where
    the model axis divides them: each device computes its ``E/N`` experts for all its tokens, and the module
    summing them over the experts emits a partial sum (``SUMS``; the experts' own module, when it sums them),
    reduced once as a row-parallel layer's output. ``layout="replicated"`` keeps them whole."""
    for layer in layers:
        experts = layer.experts
        if layout == REPLICATED:
            kind, natural, why = "replicated", "", "replicated, as asked (experts=...): computed whole on every device"
        elif tp > 1 and experts % tp == 0:
            kind, natural = "experts", "rows"
            why = (f"expert-parallel: {experts} stacked experts, every one computed for every token, split {tp} "
                   f"ways ({experts // tp} per device); their sum over the experts is a partial sum, reduced once "
                   f"like a row-parallel layer's output (one all-reduce of [tokens, hidden], one more in the "
                   f"backward)")
        else:
            kind, natural = "replicated", ""
            why = (f"stacked experts computed for every token: their {experts} experts do not split {tp} ways "
                   f"(a split of their features is not planned for them), computed whole on every device")
        if kind == "experts" and layer.sums == layer.module:
            natural = "partial"  # the experts' own module sums them: its output is the partial sum
        elif kind == "experts":
            roles.natural[layer.sums] = SUMS  # the module summing them emits the partial sum (``build_plan``)
        for weight in layer.weights:
            axes = ("experts",) + (None,) * (len(weight.param.shape) - 1) if kind == "experts" \
                else (None,) * len(weight.param.shape)
            roles.set(weight.param, ParamRole(kind, axes, why, natural), layer.module)


def _on_model_axis(experts: int, inter: int, tp: int, layout: Optional[str], dispatched: bool) -> tuple[str, str]:
    """``choose``, or where the expert axis holds the experts, the model axis splitting each one's features."""
    if not dispatched:
        return choose(experts, inter, tp, layout)
    if tp > 1 and inter % tp == 0:
        return EXPERT_TENSOR_PARALLEL, (f"the model axis splits each expert's {inter} intermediate features {tp} "
                                        f"ways (expert-tensor-parallel): one all-reduce of [tokens, hidden] per "
                                        f"layer (one more in the backward)")
    return REPLICATED, (f"each expert whole on the model axis ({inter} intermediate features do not split {tp} ways)"
                        if tp > 1 else "no model axis to split each expert's features")


def _axes(weight: ExpertWeight, feature: int, layout: str, dispatched: bool) -> tuple[Optional[str], ...]:
    axes: list[Optional[str]] = [None] * len(weight.param.shape)
    if dispatched:
        axes[weight.expert_dim] = "dispatched_experts"
    if layout == EXPERT_PARALLEL:
        axes[weight.expert_dim] = "experts"
    elif layout == EXPERT_TENSOR_PARALLEL:
        axes[feature] = "mlp"
    return tuple(axes)


def _gate_up(up: ExpertWeight, inter: int, tp: int) -> Optional[Packing]:
    """Gate and up packed in one weight (its output twice the features the second weight contracts):
    re-laid so each device's slice holds its part of both. Interleaved (``[g0, u0, g1, u1, ...]``), a
    plain split already holds both parts of the features the down projection's split holds."""
    if up.param.shape[up.kept] != 2 * inter or up.interleaved:
        return None
    return Packing(up.kept, ((0, inter), (inter, inter)), tp)

