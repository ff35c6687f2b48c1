"""``parallelize_xla``, torch's drop-in ``parallelize_module``, and ``unparallelize``.

Data flows one way: plan input -> ``Plan`` -> normalised ``Layout`` -> validation -> backend.
Nothing is touched until the whole plan has been validated, so after a ``PlanError`` the model is
exactly as it was. Everything a call changes is kept in the model's ``ModelState`` (``state``) and
undone by ``unparallelize``. Example::

    mesh = xla_tp.make_mesh(model=4)
    model = xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    model = xla_tp.unparallelize(model)      # a plain model on the device again
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch_xla.distributed.spmd as xs
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from . import compat, lowering
from .backends import get_backend
from .backends.annotate import XlaSharder
from .backends.place import place_module
from .constraints import install_constraints
from .dataflow.graph import Graph
from .dataflow.inputs import MadeUpInputError
from .deferred import cancel as cancel_first_call, early_options, pending, plan_at_first_call, take_early_options
from .errors import PlanError
from .guard import record_of
from .lowering import packed
from .lowering.experts import MoeOptions
from .lowering.routed import set_moe_options as set_layer_options, update_options
from .lowering.padding import padding_problem
from .axes import EXPERT, canonical_axis, mesh_axes, sizes_of
from .mesh import MeshLike, XlaDeviceMesh, to_xs_mesh
from .plan.hf import expert_packings, hf_plan
from .plan.layout import Layout, Spec
from .plan.normalize import build_layout
from . import planners
from .planners import Plan
from .planners.alternatives import Pick
from .state import (ModelState, all_states, clear_param_state, drop, outermost, register, stale_params, state_of,
                    states_under)
from .validate import validate

PlanLike = Union[str, dict, ParallelStyle]


def parallelize_xla(module: nn.Module, plan: PlanLike = "auto", mesh: MeshLike = None, *,
                    tp_axis: str = "model", backend: str = "mark_sharding",
                    strict: Optional[bool] = None) -> nn.Module:
    """Shard ``module`` in place on the XLA device following ``plan``; return it.

    ``plan`` is a dict FQN pattern -> style (torch ``ParallelStyle``, HF style string such as
    ``"colwise"``, ``ShardParams``, rule-list entries), one style for the root, ``"auto"`` (the
    rule-based planner) or ``"hf"`` (the Hugging Face model's own ``tp_plan``). ``mesh`` is an
    ``xs.Mesh``, a ``DeviceMesh("xla", ...)`` or None (the global mesh of ``make_mesh``). ``strict``: for a
    plan dict, keys that match nothing are errors (default True; False: warnings); for ``"auto"``, only
    the optimum is accepted (default False: where the optimum is out of reach, the cheapest valid plan,
    see ``plan_for``). A model "auto" cannot make an input up for is planned at its first call. Example::

        model = parallelize_xla(model, {"layers.*.wq": ColwiseParallel(),
                                        "layers.*.wo": RowwiseParallel()}, mesh=make_mesh(model=4))
    """
    if not isinstance(module, nn.Module):
        raise PlanError(f"parallelize_xla takes an nn.Module, got {type(module).__name__}")
    shard, check_spec = get_backend(backend)
    xmesh = to_xs_mesh(mesh)
    axes = dict(zip(xmesh.axis_names, (int(s) for s in xmesh.mesh_shape)))
    tp_axis = canonical_axis(tp_axis)
    try:
        plan = resolve_plan(module, plan, xmesh, tp_axis, strict=bool(strict))
    except MadeUpInputError as e:  # "auto" on a model that declares no input: planned at its first call
        def at_first_call(args: tuple, kwargs: dict) -> None:
            auto = planners.plan_for(module, xmesh, tp_axis, example_inputs=args, example_kwargs=kwargs,
                                     strict=bool(strict), check=padding_problem)
            parallelize_xla(module, auto, xmesh, tp_axis=tp_axis, backend=backend, strict=strict)
        return plan_at_first_call(module, at_first_call, str(e))
    layout = layout_for(module, plan, axes, tp_axis, strict is not False, check_spec)
    # validated: from here on the model changes, and every change is kept in its state
    stale = stale_params(module, layout)
    state = begin(module, plan, layout, xmesh, axes[tp_axis])
    place_module(module, layout.params, xmesh, shard, stale=stale)
    state.home = "xla"
    params = dict(module.named_parameters())
    state.records = {name: record_of(params[name]) for name in layout.params}
    install_constraints(module, state, XlaSharder(xmesh))
    install_lowering(module, state, plan)
    return module


def begin(module: nn.Module, plan: Plan, layout: Layout, mesh: Any, tp: int, embeddings: bool = True) -> ModelState:
    """A new state for ``module`` (replacing its previous call's), with its lease on the compatibility
    effects, the plan's packed projections re-laid, and the lowering's first hook. Both backends start
    here after validation and finish with ``install_lowering``."""
    state = ModelState(layout, mesh, tp)
    state.modules.update(module.modules())
    state.moe_options = take_early_options(module)  # set_moe_options before a deferred plan's first call
    state.lease = compat.lease()
    _forget(module)
    register(module, state, state.lease.release)
    relay(module, state, plan.packings)
    state.sites = lowering.packed_sites(module, plan.slicers)
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
    may also be None here: the global mesh of ``make_mesh``, else a 1-D ``model`` mesh over all devices.
    Example: ``xla_tp.plan_for(model, mesh={"data": 2, "model": 4})["lm_head"].role``."""
    return planners.plan_for(model, to_xs_mesh(None) if mesh is None else mesh, tp_axis,
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


def _forget(module: nn.Module) -> None:
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
        _forget(mod)
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
        if record_of(p) is not None and not keep_sharding:
            xs.clear_sharding(p)
        clear_param_state(p)
    return model


def parallelize_module(module: nn.Module, device_mesh: Any = None,
                       parallelize_plan: Union[dict, ParallelStyle, None] = None, *,
                       src_data_rank: Any = 0) -> nn.Module:
    """torch's ``parallelize_module`` signature, applied the xla_tp way.

    The tensor-parallel axis is the axis a slice of ``xla_tp.init_device_mesh`` selects
    (``world["tp"]``: the batch stays sharded over the whole mesh's other axes), else the mesh's
    only axis, else its ``model``/``tp`` axis. ``src_data_rank`` is accepted for compatibility:
    under SPMD there is one process that holds the full tensor, so there is nothing to broadcast.
    Example::

        parallelize_module(model, DeviceMesh("xla", list(range(4))), {"fc1": ColwiseParallel()})
        world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, world["tp"], {"fc1": ColwiseParallel()})
    """
    xmesh = to_xs_mesh(device_mesh)
    names = tuple(xmesh.axis_names)
    sliced = device_mesh.sliced_axis() if isinstance(device_mesh, XlaDeviceMesh) else None
    tp_axis = sliced or (names[0] if len(names) == 1 else "model")
    if tp_axis not in names:
        raise PlanError(f"parallelize_module: the mesh has axes {names} and none is the tensor-parallel "
                        f"axis; pass a 1-D mesh or name one axis 'tp' or 'model'")
    if tp_axis == EXPERT:
        raise PlanError("parallelize_module: the mesh's axis 'expert' (ep) carries the batch: xla_tp sends each "
                        "batch shard's tokens to the experts split over it itself (\"auto\" on a mesh with an "
                        "expert axis), so a style cannot be applied over it alone; for torchtitan's ExpertParallel "
                        "pass the tensor-parallel slice (world['tp']: the experts split over it, as torchtitan's "
                        "expert parallelism borrowing the TP ranks), for its ExpertTensorParallel world['ep', 'tp'] "
                        "(the experts split over both)")
    if tp_axis in mesh_axes("batch"):
        raise PlanError(f"parallelize_module: the mesh's axis {tp_axis!r} carries the batch, so it cannot be "
                        f"the tensor-parallel axis; pass the tensor-parallel slice (e.g. world['tp']) or "
                        f"name the axis 'tp'")
    return parallelize_xla(module, parallelize_plan if parallelize_plan is not None else {},
                           xmesh, tp_axis=tp_axis, strict=False)


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
