"""A plan applied to a model, whatever the backend: resolved, validated, and the model's state begun.

Data flows one way: plan input -> ``Plan`` (``resolve_plan``: "auto", "hf", a dict) -> normalised ``Layout``
-> validation (``layout_for``) -> a backend. Both backends (torch_xla's ``api.parallelize_xla``, JAX's
``parallelize_jax``) go through here: nothing is touched until the whole plan has been validated; then
``begin`` makes the model's ``ModelState`` (its lease on the compatibility effects, re-laid packed
projections, the lowering's first hook) and ``install_lowering`` finishes. Needs torch only. Example::

    plan = resolve_plan(model, "auto", {"data": 2, "model": 4}, "model")
    layout = layout_for(model, plan, {"data": 2, "model": 4}, "model", True, lambda spec: None)
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from . import compat, lowering
from .adapters import has_torch_xla
from .axes import sizes_of
from .dataflow.graph import Graph
from .deferred import cancel as cancel_first_call, early_options, pending, take_early_options
from .errors import PlanError
from .lowering import packed
from .lowering.experts import MoeOptions
from .lowering.padding import padding_problem
from .lowering.routed import set_moe_options as set_layer_options, update_options
from .plan.hf import expert_packings, hf_plan
from .plan.layout import Layout, Spec
from .plan.normalize import build_layout
from . import planners
from .planners import Plan
from .planners.alternatives import Pick
from .state import (ModelState, all_states, clear_param_state, drop, outermost, record_of, register, state_of,
                    states_under)
from .validate import validate

PlanLike = Union[str, dict, ParallelStyle]


def _default_mesh() -> Any:
    """The mesh ``plan_for`` plans for when given none: torch_xla's global one (``make_mesh``)."""
    if not has_torch_xla():
        raise PlanError("plan_for: pass mesh= (axis sizes such as {'data': 2, 'model': 4}, or a DeviceMesh): "
                        "without torch_xla there is no global mesh to default to")
    from .mesh import to_xs_mesh
    return to_xs_mesh(None)


def begin(module: nn.Module, plan: Plan, layout: Layout, mesh: Any, tp: int, embeddings: bool = True) -> ModelState:
    """A new state for ``module`` (replacing its previous call's), with its lease on the compatibility
    effects, the plan's packed projections re-laid, and the lowering's first hook. Both backends start
    here after validation and finish with ``install_lowering``."""
    state = ModelState(layout, mesh, tp)
    state.modules.update(module.modules())
    state.moe_options = take_early_options(module)  # set_moe_options before a deferred plan's first call
    state.lease = compat.lease()
    forget(module)
    register(module, state, state.lease.release)
    relay(module, state, plan.packings)
    state.sites = lowering.packed_sites(module, plan.slicers)
    state.concats, state.tagged_concats = dict(plan.concats), set(plan.tagged_concats)
    lowering.enter(module, state, embeddings)
    return state


def install_lowering(module: nn.Module, state: ModelState, plan: Plan, embeddings: bool = True) -> None:
    """The lowering's last hooks on ``module`` (after every other), and what it found: now (the plan's
    trace, or one on a synthesised input) when ``module`` is the outermost parallelized module; else its
    model finds it again at its next forward (torch's idiom parallelizes the root, then each block)."""
    root = outermost(module)
    lowering.install(module, state, plan.graph, embeddings, find_now=root is module)
    if root is not module:
        state_of(root).pending = True


def plan_for(model: nn.Module, mesh: Any = None, tp_axis: str = "model", *,
             example_inputs: Optional[Sequence[Any]] = None,
             example_kwargs: Optional[Mapping[str, Any]] = None, strict: bool = False,
             pick: Optional[Pick] = None, experts: Optional[str] = None,
             graph: Optional[Graph] = None) -> Plan:
    """The plan ``parallelize_xla(model, "auto")`` would apply (``xla_tp.planners.plan_for``; ``experts=`` picks
    the layout of MoE layers, ``graph=`` reuses a trace of the model from its plan on another mesh); ``mesh``
    may also be None here: the global mesh of ``make_mesh``, else a 1-D ``model`` mesh over all devices (with
    torch_xla; without it, pass axis sizes). Needs torch only.
    Example: ``xla_tp.plan_for(model, mesh={"data": 2, "model": 4})["lm_head"].role``."""
    return planners.plan_for(model, _default_mesh() if mesh is None else mesh, tp_axis,
                             example_inputs=example_inputs, example_kwargs=example_kwargs, strict=strict, pick=pick,
                             check=padding_problem, experts=experts, graph=graph)


def resolve_plan(module: nn.Module, plan: PlanLike, mesh: Any, tp_axis: str, strict: bool = False,
                 experts: Optional[str] = None) -> Plan:
    """The ``Plan`` for ``plan``: ``"hf"`` -> the model's own tp_plan, ``"auto"`` -> ``plan_for`` (``experts``:
    the layout it gives MoE layers, None: the cheapest).

    ``mesh`` is anything ``plan_for`` takes (an ``xs.Mesh``, axis sizes). Example:
    ``resolve_plan(model, "auto", {"data": 2, "model": 4}, "model")["lm_head"].role == "vocab-parallel output head"``.
    """
    if plan == "hf":
        out = Plan.of(hf_plan(module))
        out.packings = expert_packings(module, out, sizes_of(mesh).get(tp_axis, 1))
        return out
    if isinstance(plan, str):
        if plan != "auto":
            raise PlanError(f"plan {plan!r} is not a plan; pass a dict of FQN pattern -> style, "
                            f"'auto' (the rule-based planner) or 'hf' (the model's own tp_plan)")
        return planners.plan_for(module, mesh=mesh, tp_axis=tp_axis, strict=strict, check=padding_problem,
                                 experts=experts)
    if isinstance(plan, ParallelStyle):
        return Plan.of({"": plan})
    if not isinstance(plan, dict):
        raise PlanError(f"plan must be a dict of FQN pattern -> style (or one style), got {type(plan).__name__}")
    return Plan.of(plan)


def layout_for(module: nn.Module, plan: Plan, axes: dict[str, int], tp_axis: str,
               strict: bool, check_spec: Callable[[Spec], Optional[str]]) -> Layout:
    """Normalise and validate ``plan``: the validated ``Layout``. Any backend calls this before it
    touches the model. Example: ``layout_for(model, plan, {"model": 4}, "model", True, lambda spec: None)``.
    """
    layout = build_layout(module, plan, axes, tp_axis, strict)
    validate(module, layout, axes, check_spec)
    return layout


def relay(module: nn.Module, state: ModelState, packings: dict[str, Any]) -> None:
    """Re-lay ``packings`` (parameter FQN -> ``Packing``) device-major, after validation (same shapes,
    so the layout holds); a parameter re-laid by another call is put back first."""
    for name, packing in packings.items():
        owner_fqn, _, local = name.rpartition(".")
        owner = module.get_submodule(owner_fqn)
        for _, other in all_states():
            taken = [fqn for fqn, (mod_ref, pname, _, _) in other.relaid.items() if mod_ref() is owner and pname == local]
            for fqn in taken:
                _, _, was, handles = other.relaid.pop(fqn)
                packed.unrelayout(owner, local, was, handles)
        state.relaid[name] = (weakref.ref(owner), local, packing, packed.relayout(owner, local, packing))


def forget(module: nn.Module) -> None:
    """Take the previous call on ``module`` off: its hooks, its re-laid weights, its lease."""
    state = drop(module)
    if state is None:
        return
    state.remove_hooks()
    for mod_ref, name, packing, handles in state.relaid.values():
        if mod_ref() is not None:
            packed.unrelayout(mod_ref(), name, packing, handles)


def unparallelize(model: nn.Module, *, keep_sharding: bool = False) -> nn.Module:
    """Take xla_tp off ``model``: every call made on it or inside it is undone (hooks, re-laid packed
    weights, the lowering, parameter records), and once no parallelized model remains, torch's
    functions are the originals again (``compat``). Parameters stay on the XLA device with their
    values; their shardings are cleared (replicated) unless ``keep_sharding``. A module inside a
    parallelized model is made plain on its own: the model around it finds its lowering again at its
    next forward. Returns ``model``. Example::

        model = xla_tp.unparallelize(xla_tp.parallelize_xla(model, "auto", mesh=mesh))
    """
    inside = {id(m) for m in model.modules()}
    cancel_first_call(model)  # "auto" waiting for the first call to plan: nothing else was done
    for _, mod, _ in list(states_under(model)):
        forget(mod)
    for root, state in all_states():  # a call on a model around this one: what it did inside goes
        for key in [k for k in state.constraints if k in inside]:
            state.remove_constraint_hooks(key)
        for fqn in [f for f, (ref, *_) in state.relaid.items() if id(ref()) in inside]:
            ref, name, packing, handles = state.relaid.pop(fqn)
            packed.unrelayout(ref(), name, packing, handles)
        if id(model) in {id(m) for m in root.modules()}:
            state.pending = True
    lowering.uninstall(model)
    for p in model.parameters():
        if p.device.type == "xla" and not keep_sharding and has_torch_xla():
            if record_of(p) is not None:  # sharded by parallelize_xla: torch_xla is loaded
                import torch_xla.distributed.spmd as xs
                xs.clear_sharding(p)
        clear_param_state(p)
    return model


def set_moe_options(model: nn.Module, capacity_factor: Optional[float] = None,
                    dropless: Optional[bool] = None, route: Optional[str] = None) -> MoeOptions:
    """Set how every parallelized MoE layer of ``model`` runs (``MoeOptions``). By default they are
    dropless: the model's own results. ``capacity_factor`` (1.25 is usual) drops tokens, as training
    recipes choose to: each expert takes that factor x the even share of a batch shard's assignments, the
    rest are dropped and counted (``moe_report``); ``dropless=True`` goes back. ``route``: ``"auto"``
    (default: the grouped matmul where its kernel runs, on TPU, else slots), ``"grouped"`` or ``"slots"``.
    Returns the options. Before the first forward of a model whose layers (or whose whole plan: "auto"
    without an input it can make up) are found then, they are kept for them. Example:
    ``xla_tp.set_moe_options(model, capacity_factor=1.25)``."""
    if pending(model) and not list(states_under(model)):  # planned at its first call: its state comes then
        return update_options(early_options(model, MoeOptions), capacity_factor, dropless, route)
    return set_layer_options(model, capacity_factor, dropless, route)
