"""``parallelize_xla`` and torch's drop-in ``parallelize_module``.

Data flows one way: plan input -> normalised ``Layout`` -> validation -> backend. Nothing is
touched until the whole plan has been validated, so after a ``PlanError`` the model is exactly
as it was. Example::

    mesh = xla_tp.make_mesh(model=4)
    model = xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from .backends import get_backend
from . import dynamo, lowering
from .backends.place import place_module
from .checkpoint.export import host_save_pretrained
from .constraints import install_constraints
from .dataflow.inputs import MadeUpInputError
from .deferred import plan_at_first_call
from .errors import PlanError
from .inference import make_inference_safe
from .mesh import MeshLike, XlaDeviceMesh, canonical_axis, to_xs_mesh
from .plan.applied import applied_layout, record_layout, stale_params
from .plan.hf import hf_plan
from .plan.layout import Layout, Spec
from .plan.normalize import BATCH_AXES, build_layout
from .recompute import enable_activation_checkpointing
from .validate import validate

PlanLike = Union[str, dict, ParallelStyle]


def parallelize_xla(module: nn.Module, plan: PlanLike = "auto", mesh: MeshLike = None, *,
                    tp_axis: str = "model", backend: str = "mark_sharding",
                    strict: Optional[bool] = None) -> nn.Module:
    """Shard ``module`` in place on the XLA device following ``plan``; return it.

    ``plan`` is a dict FQN pattern -> style (torch ``ParallelStyle``, HF style string such as
    ``"colwise"``, ``ShardParams``, rule-list entries), one style for the root, ``"auto"`` (the
    rule-based planner) or ``"hf"`` (the Hugging Face model's own ``tp_plan``). ``mesh`` is an ``xs.Mesh``, a ``DeviceMesh("xla", ...)`` or None (the global
    mesh of ``make_mesh``). ``strict``: for a plan dict, keys that match nothing are errors (default
    True; False: warnings); for ``"auto"``, only the optimum is accepted (default False: where the
    optimum is out of reach, the cheapest valid plan, see ``plan_for``). Example::

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
        from .planners import plan_for

        def at_first_call(args: tuple, kwargs: dict) -> None:
            auto = plan_for(module, xmesh, tp_axis, example_inputs=args, example_kwargs=kwargs, strict=bool(strict))
            parallelize_xla(module, auto, xmesh, tp_axis=tp_axis, backend=backend, strict=strict)
        return plan_at_first_call(module, at_first_call, str(e))
    layout = layout_for(module, plan, axes, tp_axis, strict is not False, check_spec)
    place_module(module, layout.params, xmesh, shard, stale=stale_params(module, layout))
    install_constraints(module, layout, xmesh, replacing=applied_layout(module))
    lowering.install(module, lowering.packed_sites(module, getattr(plan, "slicers", frozenset())), axes[tp_axis])
    make_inference_safe(module)
    host_save_pretrained(module)
    enable_activation_checkpointing()
    dynamo.enable()
    record_layout(module, layout)
    return module


def resolve_plan(module: nn.Module, plan: PlanLike, mesh: Any, tp_axis: str,
                 strict: bool = False) -> Union[dict, ParallelStyle]:
    """The plan dict for ``plan``: ``"hf"`` -> the model's own tp_plan, ``"auto"`` -> ``plan_for``.

    ``mesh`` is anything ``plan_for`` takes (an ``xs.Mesh``, axis sizes). Example:
    ``resolve_plan(model, "auto", {"data": 2, "model": 4}, "model")["lm_head"].role == "vocab-parallel output head"``.
    """
    if plan == "hf":
        return hf_plan(module)
    if isinstance(plan, str):
        if plan != "auto":
            raise PlanError(f"plan {plan!r} is not a plan; pass a dict of FQN pattern -> style, "
                            f"'auto' (the rule-based planner) or 'hf' (the model's own tp_plan)")
        from .planners import plan_for
        return plan_for(module, mesh=mesh, tp_axis=tp_axis, strict=strict)
    return plan


def layout_for(module: nn.Module, plan: Union[dict, ParallelStyle], axes: dict[str, int], tp_axis: str,
               strict: bool, check_spec: Callable[[Spec], Optional[str]]) -> Layout:
    """Normalise and validate ``plan``, then let the plan prepare the model; the validated ``Layout``.

    Any backend calls this before it places a parameter. A planner's Plan may re-lay packed weights
    device-major (same shapes); that runs only once the plan has validated on the model as it was, so
    after a ``PlanError`` the model is untouched.
    Example: ``layout_for(model, plan, {"model": 4}, "model", True, lambda spec: None)``.
    """
    layout = build_layout(module, plan, axes, tp_axis, strict)
    validate(module, layout, axes, check_spec)
    # Nothing has been touched so far. A planner's Plan may re-lay packed weights device-major (same
    # shapes, so the layout above holds).
    getattr(plan, "relayout", lambda m: None)(module)
    return layout


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
    if tp_axis in BATCH_AXES:
        raise PlanError(f"parallelize_module: the mesh's axis {tp_axis!r} carries the batch, so it cannot be "
                        f"the tensor-parallel axis; pass the tensor-parallel slice (e.g. world['tp']) or "
                        f"name the axis 'tp'")
    return parallelize_xla(module, parallelize_plan if parallelize_plan is not None else {},
                           xmesh, tp_axis=tp_axis, strict=False)
