"""Routed experts of a parallelized model: found, marked, and run through the static-slot lowering.

``install_experts(root, state, graph, layout)`` reads the MoE layers of ``graph``
(``dataflow.routing``) and, from the layout their weights were given, how each runs
(``experts.ExpertSet``: expert-parallel when the expert dimension is split over the model axis,
expert-tensor-parallel when the features are, replicated otherwise); the set goes on the weights'
``ParamState.experts``. Whoever wrote the plan ("auto", ``plan="hf"``'s ``grouped_gemm`` or
``packed_colwise``/``rowwise``, a rule list), the layer runs as its weights are laid out.

Transformers' experts layers dispatch through its experts interface (``config.experts_implementation``);
``experts_interface`` (installed by ``compat``) makes that dispatch hand a marked layer to
``hf_forward`` inside a parallelized forward and its backward, on XLA tensors, whatever the config
names; a layer it cannot run (no gate, a norm after the experts) keeps the model's choice,
or ``batched_mm`` where that is ``grouped_mm``, which fails on XLA (``histc`` on integers). While the
lowering is suspended (the audit's unsharded reference) a marked layer computes an even routing's
expert FLOPs: the active-expert FLOPs of the model. ``set_moe_options`` sets the capacity and
``moe_report`` reads the last forward's dropped assignments. Example::

    xla_tp.set_moe_options(model, capacity_factor=1.0)        # or dropless=True: the model's own results
    model(ids); xla_tp.moe_report(model)   # {'model.layers.0.mlp.experts': {'routed': 64, 'dropped': 3, ...}}
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..axes import EXPERT
from ..adapters import is_xla_mesh
from ..dataflow.graph import Graph
from ..dataflow.routing import find_experts
from ..errors import PlanError
from ..plan.layout import Layout, uses_axis
from ..state import ModelState, ensure_param_state, param_state, states_under
from . import scope
from ..weak import ByModule
from .experts import ExpertSet, MoeOptions, dispatched_numel, even, routing_groups, run
from .grouped import GroupedForward, install_grouped
from .selection import site_of

FALLBACK = "batched_mm"
_sets: ByModule[ExpertSet] = ByModule()  # each MoE layer's ExpertSet


def _layout_of(spec: tuple, axis: str, expert_dim: int = 0) -> str:
    """The layout of an experts weight laid out as ``spec`` (its experts on ``expert_dim``)."""
    if axis in (spec[expert_dim] if isinstance(spec[expert_dim], tuple) else (spec[expert_dim],)):
        return "expert-parallel"
    return "expert-tensor-parallel" if uses_axis(spec, axis) else "replicated"


def install_experts(root: nn.Module, state: ModelState, graph: Optional[Graph], layout: Layout) -> list[str]:
    """Mark every MoE layer of ``root`` found in ``graph`` (None: not traced) and every grouped-experts
    module its layout names (``grouped``); their module FQNs. Only on torch_xla: the JAX backend runs
    transformers' batched_mm experts (``dataflow.routing.batched_experts``)."""
    if not is_xla_mesh(state.mesh):
        return []
    from ..backends.annotate import XlaSharder
    batch, groups = routing_groups(dict(zip(state.mesh.axis_names, (int(s) for s in state.mesh.mesh_shape))),
                                   layout.batch_axes)
    options = state.moe_options or MoeOptions()
    state.moe_options = options
    marked = []
    for layer in find_experts(graph).layers if graph is not None else ():
        if len(layer.weights) != 2:
            continue
        up, down = layer.weights
        spec = layout.params.get(up.param.name, (None,) * len(up.param.shape))
        kind = _layout_of(spec, layout.tp_axis, up.expert_dim)
        ep_axis = EXPERT if EXPERT in batch and _layout_of(spec, EXPERT, up.expert_dim) == "expert-parallel" else None
        weight = root.get_parameter(up.param.name)
        names = (up.param.name.rpartition(".")[2], up.contracted == 1, down.param.name.rpartition(".")[2],
                 down.contracted == 1)
        es = ExpertSet(kind, state.tp if kind != "replicated" else 1, layout.tp_axis, XlaSharder(state.mesh), batch,
                       groups, relaid=getattr(param_state(weight), "packing", None) is not None, options=options,
                       weights=names, ep_axis=ep_axis)
        for name in (up.param.name, down.param.name):
            ensure_param_state(root.get_parameter(name)).experts = es
        _sets[root.get_submodule(layer.module)] = es
        marked.append(layer.module)
    return marked + install_grouped(root, state, layout, _layout_of, _sets)


def uninstall_experts(model: nn.Module) -> None:
    for p in model.parameters():
        ps = param_state(p)
        if ps is not None:
            ps.experts = None
    for module in model.modules():
        _sets.pop(module)
        if isinstance(module.__dict__.get("forward"), GroupedForward):
            del module.forward


def expert_set(module: nn.Module) -> Optional[ExpertSet]:
    """The set of a marked MoE layer (also while ``functional_call`` swaps its weights, as the audit does)."""
    return _sets.get(module)


def dispatch_collectives(module: nn.Module, args: tuple, sizes: dict[str, int]) -> int:
    """Elements per device of each all-to-all a call of MoE layer ``module`` on ``args`` makes (two in
    its forward, one way and back; 0: none): what the audit's minimum counts for it."""
    es = expert_set(module)
    if es is None or len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]) or not es.weights:
        return 0
    hidden, ids = args[0], args[1]
    return dispatched_numel(es, hidden.shape[0], ids.shape[-1], getattr(module, es.weights[0]).shape[0],
                            hidden.shape[-1], sizes)


def _hf_supported(module: nn.Module) -> bool:
    return not getattr(module, "has_post_expert_norm", False)


def hf_forward(module: nn.Module, es: ExpertSet, hidden: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts layer's forward (``self, hidden_states, top_k_index, top_k_weights``): gate
    and up rows concatenated (``[g..., u...]``) or interleaved (``is_concatenated=False``, gpt-oss's
    ``[g0, u0, g1, u1, ...]``), or up rows only (``has_gate=False``: NemotronH's, their activation alone), with or
    without biases (``has_bias``)."""
    up_name, up_t, down_name, down_t = es.weights
    up, down = getattr(module, up_name), getattr(module, down_name)
    up, down = up.transpose(1, 2) if up_t else up, down.transpose(1, 2) if down_t else down
    biases = (getattr(module, f"{up_name}_bias"), getattr(module, f"{down_name}_bias")) \
        if getattr(module, "has_bias", False) else None
    interleaved = not getattr(module, "is_concatenated", True)
    if interleaved:  # [E, 2I, H] as [E, 2, I, H]; the same split of I on every device
        up = up.unflatten(1, (-1, 2)).transpose(1, 2)
        biases = biases and (biases[0].unflatten(1, (-1, 2)).transpose(1, 2), biases[1])

    if not getattr(module, "has_gate", True):  # [E, I, H] as [E, 1, I, H]: one block of rows
        up, biases = up.unsqueeze(1), biases and (biases[0].unsqueeze(1), biases[1])

    def gate(g: torch.Tensor, u: Optional[torch.Tensor] = None) -> torch.Tensor:
        if u is None:
            return module.act_fn(g)
        return module._apply_gate(torch.stack([g, u], -1).flatten(-2) if interleaved else torch.cat([g, u], -1))

    if scope.lowering():
        return run(es, hidden, ids, weights, gate, up, down, biases=biases).to(hidden.dtype)
    plain, capacity = even(es, hidden.shape[0], ids.shape[-1], up.shape[0])  # the audit's unsharded reference
    return run(plain, hidden, ids, weights, gate, up, down, capacity=capacity, biases=biases).to(hidden.dtype)


def experts_interface(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ExpertsInterface.get_interface``: a marked layer, inside a parallelized model, runs ``hf_forward``."""
    @functools.wraps(original)
    def get_interface(self: Any, experts_implementation: Optional[str], default: Callable[..., Any]) -> Callable[..., Any]:
        chosen = original(self, experts_implementation, default)
        fallback = self.get(FALLBACK, chosen) if experts_implementation == "grouped_mm" else chosen
        return _DISPATCH.get((chosen, fallback)) or _DISPATCH.setdefault((chosen, fallback), _dispatch(chosen, fallback))
    return get_interface


# a dict, not functools.lru_cache: dynamo traces the model's lookup of its experts implementation
_DISPATCH: dict[tuple[Callable[..., Any], Callable[..., Any]], Callable[..., Any]] = {}


def _dispatch(chosen: Callable[..., Any], fallback: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(chosen)
    def forward(module: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not (scope.inside() and hidden.device.type == "xla"):
            return chosen(module, hidden, *args, **kwargs)
        es = expert_set(module)
        if es is None or kwargs or len(args) != 2 or not _hf_supported(module):
            _warn_unlowered(module, es)
            return fallback(module, hidden, *args, **kwargs)
        return hf_forward(module, es, hidden, *args)
    return forward


@functools.lru_cache(maxsize=None)
def _warn_once(kind: str) -> None:
    warnings.warn(f"xla_tp: an experts layer ({kind}) runs transformers' {FALLBACK} implementation, which gathers "
                  f"a copy of the expert weights per routed token: xla_tp's static-slot lowering covers gated, "
                  f"bias-free experts", stacklevel=4)


def _warn_unlowered(module: nn.Module, es: Optional[ExpertSet]) -> None:
    _warn_once(type(module).__name__ if es is not None else f"{type(module).__name__}, not planned as experts")


def set_moe_options(model: nn.Module, capacity_factor: Optional[float] = None, dropless: Optional[bool] = None,
                    route: Optional[str] = None) -> MoeOptions:
    """``xla_tp.set_moe_options`` on a parallelized ``model``: every state under it takes the options
    (MoE layers found at its first forward take them too)."""
    found = [state for _, _, state in states_under(model)]
    if not found:
        raise PlanError(f"{type(model).__name__} is not parallelized; parallelize it first (parallelize_xla) and "
                        f"pass the model it returned")
    for state in found:
        state.moe_options = update_options(state.moe_options or MoeOptions(), capacity_factor, dropless, route)
    return found[0].moe_options


def update_options(options: MoeOptions, capacity_factor: Optional[float], dropless: Optional[bool],
                   route: Optional[str] = None) -> MoeOptions:
    """``options`` with what is not None of ``capacity_factor``, ``dropless`` and ``route`` set; a capacity
    factor given without ``dropless`` asks for token dropping (``dropless=False``). Nothing changes when
    one of them is invalid."""
    if dropless is None and capacity_factor is not None:
        dropless = False
    checked = MoeOptions(capacity_factor if capacity_factor is not None else options.capacity_factor,
                         bool(dropless) if dropless is not None else options.dropless,
                         route if route is not None else options.route)
    if checked.route == "grouped" and not checked.dropless:
        raise ValueError("route='grouped' is dropless by design (every routed token in its expert's group); "
                         "drop tokens with route='slots' (or 'auto') and a capacity_factor")
    options.capacity_factor, options.dropless, options.route = checked.capacity_factor, checked.dropless, checked.route
    return options


def moe_report(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per MoE layer of ``model``: its layout on the model axis, the expert axis its experts are split
    over (None: none), its options, and of the last forward: the route it took (``"grouped"`` or
    ``"slots"``; None before one), the expert rows it computed for each routed one (``cost``: 1.0 for
    the grouped route's routed rows, before the kernel's tile padding; a dropless slot layer's ``E / k``),
    and the routed and dropped assignments (reading ``dropped`` runs the pending program if it has not run)."""
    out = {}
    for fqn, module in model.named_modules():
        es = expert_set(module) or site_of(module)
        if es is None:
            continue
        dropped, routed = es.last.get("dropped"), int(es.last.get("routed", 0))
        rows = routed if es.last.get("route") == "grouped" else es.last.get("slots")
        out[fqn] = {"layout": es.layout, "expert_axis": getattr(es, "ep_axis", None),
                    "capacity_factor": es.options.capacity_factor, "dropless": es.options.dropless,
                    "route": es.last.get("route"), "cost": round(rows / routed, 3) if rows and routed else None,
                    "routed": routed, "dropped": int(dropped) if dropped is not None else 0}
    return out


def route_notes(model: nn.Module) -> list[str]:
    """What the MoE layers of ``model`` computed in their last forward, a line per kind: the route and its
    expert rows per routed one (the audit's report says it; nothing is read from the device)."""
    kinds: dict[tuple, int] = {}
    for module in model.modules():
        es = expert_set(module)
        route, routed = (es.last.get("route"), es.last.get("routed")) if es is not None else (None, None)
        if route is not None and routed:
            rows = routed if route == "grouped" else es.last.get("slots", routed)
            key = (route, es.options.dropless, es.options.capacity_factor, round(rows / routed, 2), es.last.get("kernel"))
            kinds[key] = kinds.get(key, 0) + 1
    lines = []
    for (route, dropless, factor, cost, kernel), n in kinds.items():
        if route == "grouped" and kernel == "PallasKernel":
            how = "dropless, sorted by expert into grouped matmuls: the routed rows and the kernel's tiles (<= 15% more)"
        elif route == "grouped":
            how = ("dropless, sorted by expert into grouped matmuls, through the kernel's reference (not on a TPU): "
                   "every local expert over every row")
        elif dropless:
            how = (f"dropless in slots: {cost:.2f}x the routed expert rows (every expert a slot per token; on TPU the "
                   f"default route, grouped, runs the routed rows)")
        else:
            how = f"capacity factor {factor} in slots: {cost:.2f}x the routed rows, the rest dropped (moe_report counts them)"
        lines.append(f"{n} MoE layer{'s' if n > 1 else ''}: {how}")
    return lines
