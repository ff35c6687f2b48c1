"""torch_xla's adapter: ``parallelize_xla``, torch's drop-in ``parallelize_module``, and ``unparallelize``.

Data flows one way: plan input -> ``Plan`` -> normalised ``Layout`` -> validation (``apply``: the steps
every backend shares) -> this backend: parameters placed with their shardings, activation constraints,
the lowering.
Nothing is touched until the whole plan has been validated, so after a ``PlanError`` the model is
exactly as it was. Everything a call changes is kept in the model's ``ModelState`` (``state``) and
undone by ``unparallelize``. Example::

    mesh = xla_tp.make_mesh(model=4)
    model = xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    model = xla_tp.unparallelize(model)      # a plain model on the device again
"""
from __future__ import annotations

from typing import Any, Optional, Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from . import planners
from .apply import PlanLike, begin, install_lowering, layout_for, resolve_plan
from .axes import EXPERT, canonical_axis, mesh_axes
from .backends.annotate import XlaSharder
from .backends.place import place_module
from .backends.spmd import get_backend
from .constraints import install_constraints
from .dataflow.inputs import MadeUpInputError
from .deferred import plan_at_first_call
from .errors import PlanError
from .lowering.padding import padding_problem
from .mesh import MeshLike, XlaDeviceMesh, to_xs_mesh
from .state import record_of, stale_params



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


