"""Every way of applying one plan on XLA, measured the same way (``measure``).

A route takes ``(cpu model, plan, mesh)`` and returns the model ready on the XLA device plus the
layout that defines its communication minimum. Routes that cannot run return why. Example::

    row = run_route("b_hand_mark_sharding", "llama", "tiny", mesh, {})
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import xla_tp
from xla_tp.auditing.run import unsharded_dot_flops, audit_here
from xla_tp import layout_of
from xla_tp.plan.normalize import build_layout
from xla_tp import plan_for
from xla_tp.zoo import registry

from .jax_route import ROUTE as JAX_ROUTE, jax_row
from .models import build
from .plans import hand_apply, plan_layout, to_torch_plan
from .timing import step_stats, trace_stats


def _xla_tp(model, plan, mesh):
    model = xla_tp.parallelize_xla(model, plan_for(model, mesh=mesh), mesh=mesh)
    return model, layout_of(model), "auto"


def _hand(model, plan, mesh):
    return hand_apply(model.to(torch_xla.device()), plan, mesh), plan_layout(model, plan, mesh), \
        "mark_sharding per weight"


def _distribute_module(model, plan, mesh):
    layout = plan_layout(model, plan, mesh)

    def partition_fn(name: str, module: torch.nn.Module, device_mesh: Any) -> None:
        ml = layout.modules.get(name)
        for pname, spec in (ml.params if ml else {}).items():
            xs.mark_sharding(module.get_parameter(pname), device_mesh, spec)

    model = xs.xla_distribute_module(model.to(torch_xla.device()), mesh, partition_fn)
    return model, layout, "xla_distribute_module + partition_fn"


def _torch_parallelize_module(model, plan, mesh):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    ids = torch.tensor(mesh.device_ids).reshape(tuple(mesh.mesh_shape))
    if _sizes(mesh).get("data", 1) * _sizes(mesh).get("fsdp", 1) == 1:
        dm = DeviceMesh("xla", ids.flatten())  # 1-D: what torch's TP examples use
    else:
        dm = DeviceMesh("xla", ids, mesh_dim_names=tuple(mesh.axis_names))["model"]
    layout = plan_layout(model, plan, mesh)
    return parallelize_module(model, dm, to_torch_plan(plan, model)), layout, "torch parallelize_module"


def _replicated(model, plan, mesh):
    return model.to(torch_xla.device()), build_layout(model, {}, _sizes(mesh), "model"), "no TP"


def mesh_name(mesh) -> str:
    """``"2x4"`` for data=2, model=4 (axes of size 1 left out, model last)."""
    sizes = _sizes(mesh)
    return f"{sizes.get('data', 1) * sizes.get('fsdp', 1)}x{sizes.get('model', 1)}"


def _sizes(mesh) -> dict[str, int]:
    return {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.mesh_shape)}


ROUTES: dict[str, Callable] = {
    "a_xla_tp": _xla_tp,
    "b_hand_mark_sharding": _hand,
    "c_xla_distribute_module": _distribute_module,
    "d_torch_parallelize_module": _torch_parallelize_module,
    "g_replicated": _replicated,
}


BACKWARD_ROUTES = ("a_xla_tp", "b_hand_mark_sharding", "g_replicated")  # also audited forward+backward


def run_route(route: str, family: str, width: str, mesh, unsharded: dict, steps: int = 0,
              extras: bool = True) -> dict[str, Any]:
    """One row: the route's forward audit and compile time; with ``extras`` its trace times (forward,
    forward+backward) and for ``BACKWARD_ROUTES`` the forward+backward audit; with ``steps`` > 0 the
    training-step times per execution route over that many steps after warm-up (``timing.step_stats``);
    or the error it hit.

    ``unsharded`` caches the unsharded FLOPs per model, so each route compiles once.
    """
    row: dict[str, Any] = {"route": route, "family": family, "width": registry.WIDTHS[width],
                           "mesh": mesh_name(mesh)}
    if route == JAX_ROUTE:
        try:
            return {**row, **jax_row(family, width, _sizes(mesh))}
        except Exception as error:
            return _failed(row, error)
    model, batch, plan = build(family, width)
    try:
        model, layout, row["how"] = ROUTES[route](model, plan, mesh)
        x = batch.to(torch_xla.device())
        if _sizes(mesh).get("data", 1) > 1:
            xs.mark_sharding(x, mesh, ("data",) + (None,) * (x.dim() - 1))
        key = (family, width)
        if key not in unsharded:
            unsharded[key] = unsharded_dot_flops(model, (x,), False)
        start = time.perf_counter()
        report = audit_here(model, (x,), mesh, False, layout, unsharded[key])
        row["compile_s"] = time.perf_counter() - start  # trace + compile of the forward
        if extras:
            row["trace_fwd"], row["trace_fwdbwd"] = trace_stats(model, x, False), trace_stats(model, x, True)
        if extras and route in BACKWARD_ROUTES:
            row.update(_backward_audit(model, x, mesh, layout, unsharded, key))
        if steps:
            row["steps"] = step_stats(model, x, n=steps)
    except Exception as error:
        return _failed(row, error)
    data = report.to_dict()
    return {**row, "status": "ok", "all_gathers": report.count("all-gather"),
            **{k: data[k] for k in ("comm_ratio", "compute_balance", "param_memory_ratio", "collectives")}}


def _backward_audit(model, x, mesh, layout, unsharded: dict, key: tuple) -> dict[str, Any]:
    """The forward+backward program's audit figures (``*_bwd``)."""
    if key + ("backward",) not in unsharded:
        unsharded[key + ("backward",)] = unsharded_dot_flops(model, (x,), True)
    report = audit_here(model, (x,), mesh, True, layout, unsharded[key + ("backward",)])
    return {"comm_ratio_bwd": report.comm_ratio, "compute_balance_bwd": report.compute_balance,
            "all_gathers_bwd": report.count("all-gather")}


def _failed(row: dict[str, Any], error: Exception) -> dict[str, Any]:
    """A route failing is a result, recorded as such."""
    return {**row, "status": f"fails: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
