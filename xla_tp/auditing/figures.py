"""The report's figures from a partitioned program and the plan's minimum, whatever compiled it.

``report_from_hlo`` reads the collectives, their bytes and mesh axes, and the per-device matmul FLOPs of a
partitioned HLO text (torch_xla's, jaxlib's, a JAX program's); ``set_minimum`` adds the communication the
plan's own layouts imply for the calls a trace recorded (``minimum``). Both backends' audits use these
(torch_xla's ``run.audit``, JAX's ``jm.audit``). Needs torch only. Example::

    report, found = report_from_hlo(text, device_ids, ("data", "model"), backward=False, unsharded_flops=None)
    set_minimum(report, recorder.calls, model, layout, found)
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Collection, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..axes import EXPERT, sequence_axes
from ..lowering.groups import stacked_gradients
from ..lowering.routed import dispatch_collectives
from ..plan.layout import Layout, uses_axis
from .hlo import Collective, dot_flops, mesh_axes_of_groups, parse_collectives
from .minimum import ContextGather, Expected, adapters, minimum_collectives
from .params import local_numel, sharding_string
from .report import AuditReport


def report_from_hlo(text: str, device_ids: np.ndarray, axis_names: tuple[str, ...], backward: bool,
                    unsharded_flops: Optional[int]) -> tuple[AuditReport, list[Collective]]:
    """The report's collectives and FLOPs read from partitioned HLO ``text`` (any compiler's), and
    the collectives found. ``device_ids`` is the mesh's device-id array, one dimension per axis."""
    found = parse_collectives(text)
    collectives: dict[str, dict] = {}
    for c in found:
        entry = collectives.setdefault(c.kind, {"count": 0, "bytes": 0, "axes": []})
        entry["count"] += 1
        entry["bytes"] += c.bytes
        axes = "+".join(mesh_axes_of_groups(c.replica_groups, device_ids, axis_names)) or "-"
        if axes not in entry["axes"]:
            entry["axes"].append(axes)
    sizes = {name: int(size) for name, size in zip(axis_names, device_ids.shape)}
    report = AuditReport(mesh=sizes, backward=backward, collectives=collectives,
                         comm_bytes=sum(c.bytes for c in found), flops_per_device=dot_flops(text),
                         unsharded_flops=unsharded_flops)
    return report, found


def _sharded_numel(name: str, p: torch.Tensor) -> int:
    return local_numel(tuple(p.shape), sharding_string(p))


def set_minimum(report: AuditReport, calls: list, module: nn.Module, layout: Layout, found: list,
                grad_numel: Callable[[str, torch.Tensor], int] = _sharded_numel,
                gathers: Sequence[ContextGather] = (), zero_grads: Collection[str] = ()) -> None:
    """Fill ``report.expected`` and ``comm_minimum_bytes`` from the recorded ``calls`` (and the keys and
    values attention ``gathers`` over a context axis).

    ``grad_numel(name, param)``: elements of the largest shard of that parameter's gradient (by
    default read from the XLA tensor's sharding). ``zero_grads``: the parameters whose gradient is zero
    because nothing the outputs read uses them (known on every device: nothing to reduce).
    """
    expected = minimum_collectives(calls, module, layout, report.mesh, report.backward, gathers)
    expected += _expert_dispatch(calls, module, report.mesh, report.backward)
    if report.backward:
        tp = report.mesh.get(layout.tp_axis, 1)
        split = {f"{fqn}.weight" for fqn in adapters(calls, layout)}  # Megatron splits an adapter with its layer

        def numel(name: str, p: torch.Tensor) -> int:
            return grad_numel(name, p) // (tp if name in split else 1)
        expected += _data_grad_allreduces(module, layout, report.mesh, numel, set(zero_grads))
    if "reduce-scatter" not in {c.kind for c in found} and any(e.kind == "reduce-scatter" for e in expected):
        tp = report.mesh.get(layout.tp_axis, 1)
        expected = [Expected("all-reduce", e.elements * (e.ways or tp), e.dtype, e.where)
                    if e.kind == "reduce-scatter" else e for e in expected]
        report.notes.append("no reduce-scatter in the program (the CPU compiler emits all-reduce + "
                            "dynamic-slice): plan reduce-scatters counted as all-reduces")
    itemsize = _hlo_float_itemsize(found)
    summary: dict[str, dict] = {}
    for e in expected:
        size = itemsize if (itemsize and e.dtype.is_floating_point) else e.dtype.itemsize
        entry = summary.setdefault(e.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += e.elements * size
    report.expected = summary
    report.comm_minimum_bytes = sum(v["bytes"] for v in summary.values())
    added = sorted({c.fqn for c in calls if c.added})
    if added:
        kinds = sorted({type(module.get_submodule(fqn)).__name__ for fqn in added})
        report.notes.append(f"{len(added)} modules added after parallelize_xla ({', '.join(kinds)}; e.g. {added[0]}) "
                            f"are not in the plan: their parameters are whole on every device and their work runs "
                            f"on each; the minimum counts them as Megatron lays out an adapter beside its layer (split "
                            f"with it, one all-reduce of its rank-sized activation)")


def _expert_dispatch(calls: list, module: nn.Module, sizes: dict[str, int], backward: bool) -> list[Expected]:
    """Each call of an MoE layer whose experts are split over the expert axis: an all-to-all of its
    token slots to their experts and one back (and both again in the backward)."""
    found = []
    for call in calls:
        mod = module.get_submodule(call.fqn) if call.fqn else module
        numel = dispatch_collectives(mod, call.args, sizes)
        if numel:
            dtype = call.args[0].dtype
            found += [Expected("all-to-all", numel, dtype, f"{call.fqn} {way}")
                      for way in ("dispatch", "combine", *(("dispatch (grad)", "combine (grad)") if backward else ()))]
    return found


def _data_grad_allreduces(module: nn.Module, layout: Layout, sizes: dict[str, int],
                          grad_numel: Callable[[str, torch.Tensor], int], zero: set[str]) -> list[Expected]:
    """One all-reduce per parameter gradient (its local size; one for a stacked group's members) over the
    batch axes, where one splits the batch (all but the expert axis for a weight whose experts it splits:
    each device's own experts), and over a context axis (each device's part of the sequence); none for a
    gradient in ``zero``."""
    reduced: dict = {}  # one entry per gradient tensor: [elements, dtype, where]
    stacked = stacked_gradients(module)
    for name, p in module.named_parameters():
        split = layout.params.get(name, ())
        axes = [a for a in layout.batch_axes if sizes.get(a, 1) > 1 and not (a == EXPERT and uses_axis(split, a))]
        axes += sequence_axes(sizes)
        if p.requires_grad and axes and name not in zero:  # a column group computed stacked: one gradient
            entry = reduced.setdefault(stacked.get(id(p), name), [0, p.dtype, name + " grad"])
            entry[0] += grad_numel(name, p)
    return [Expected("all-reduce", elements, dtype, where) for elements, dtype, where in reduced.values()]


def _hlo_float_itemsize(found: list) -> Optional[int]:
    """Bytes per element of the float type most collectives use (CPU runs bf16 ones in f32)."""
    sizes = Counter({"f64": 8, "f32": 4, "bf16": 2, "f16": 2}.get(c.dtype) for c in found)
    sizes.pop(None, None)
    return sizes.most_common(1)[0][0] if sizes else None
