"""Sub-axes on torch_xla: the same devices, with an axis split into its outer and inner groups.

A spec that names a sub-axis (``"model@4"``, ``plan.subaxis``) is lowered on a refined ``xs.Mesh``
over the same device ids in the same order, where ``model`` (8) becomes ``model`` (2, the groups)
x ``model@4`` (4, the devices within a group); a whole ``model`` in the same spec becomes the pair.
The resulting sharding is an ordinary partially replicated tile assignment. Refined meshes are
built once per mesh and split (``xs.Mesh`` caches its op shardings per object). Example::

    mesh, spec = resolve(make_mesh(model=8), ("model@4", None))
    mesh.axis_names, spec        # ('data', 'fsdp', 'model', 'model@4'), ('model@4', None)
"""
from __future__ import annotations

from typing import Any

import torch_xla.distributed.spmd as xs

from ..plan.layout import Spec, spec_axes
from ..plan.subaxis import split_sub_axis, sub_axis

_REFINED: dict[tuple, xs.Mesh] = {}


def resolve(mesh: xs.Mesh, spec: Spec) -> tuple[xs.Mesh, Spec]:
    """``(mesh, spec)`` to annotate with: unchanged when ``spec`` names no sub-axis."""
    subs = {}
    for name in (a for entry in spec for a in spec_axes(entry)):
        base, size = split_sub_axis(name)
        if size is not None:
            subs[base] = size
    if not subs:
        return mesh, spec
    refined = _refined(mesh, tuple(sorted(subs.items())))
    return refined, tuple(_entry(entry, subs) for entry in spec)


def _entry(entry: Any, subs: dict[str, int]) -> Any:
    out: list[str] = []
    for name in spec_axes(entry):
        out += [name, sub_axis(name, subs[name])] if name in subs else [name]
    return None if not out else out[0] if len(out) == 1 else tuple(out)


def _refined(mesh: xs.Mesh, subs: tuple[tuple[str, int], ...]) -> xs.Mesh:
    key = (tuple(int(i) for i in mesh.device_ids), tuple(mesh.mesh_shape), tuple(mesh.axis_names), subs)
    if key not in _REFINED:
        split = dict(subs)
        names, shape = [], []
        for name, size in zip(mesh.axis_names, mesh.mesh_shape):
            if name in split:
                names += [name, sub_axis(name, split[name])]
                shape += [int(size) // split[name], split[name]]
            else:
                names.append(name)
                shape.append(int(size))
        _REFINED[key] = xs.Mesh(mesh.device_ids, tuple(shape), tuple(names))
    return _REFINED[key]
