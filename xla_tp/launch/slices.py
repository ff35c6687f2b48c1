"""Multi-slice runs: N identical TPU slices joined over the data-center network (DCN).

Inside a slice chips talk over ICI; between slices only over DCN, which is far slower, so only the ``data``
axis crosses it (one gradient all-reduce per step). A topology with ``slices: N`` (``tpu_configs/v5e-256x2``)
counts the chips and hosts of all N slices, and its mesh's ``data`` axis is a multiple of N. torch_xla's
``HybridMesh`` lays the devices out that way: ``dcn_mesh_shape`` puts the N slices on the data axis,
``ici_mesh_shape`` the rest of every axis within each slice. Example:

>>> hybrid_shapes({"data": 2, "fsdp": 64, "model": 4}, slices=2)
(('data', 'fsdp', 'model'), (1, 64, 4), (2, 1, 1))

``hybrid_mesh(axes, slices)`` builds it on the slices' TPU VMs (``HybridMesh`` reads each device's slice
index from the TPU runtime; it refuses to run elsewhere).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..axes import DATA, axis_names
from .schema import LaunchError


def hybrid_shapes(axes: Mapping[str, int], slices: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """``(axis names, ici_mesh_shape, dcn_mesh_shape)`` of the mesh ``axes`` over ``slices`` slices: the
    data axis split ``slices`` ways over DCN, everything else within a slice. ``LaunchError`` when the data
    axis is not a multiple of ``slices``."""
    data = axes.get(DATA, 1)
    if data % slices:
        raise LaunchError(f"mesh {dict(axes)}: data={data} must be a multiple of the {slices} slices (the data "
                          f"axis is the one that crosses slices, over DCN); use data={slices} or a multiple")
    names = axis_names(axes)
    ici = tuple(axes.get(a, 1) // (slices if a == DATA else 1) for a in names)
    dcn = tuple(slices if a == DATA else 1 for a in names)
    return names, ici, dcn


def hybrid_mesh(axes: Mapping[str, int], slices: int) -> Any:
    """torch_xla's ``HybridMesh`` for ``axes`` over ``slices`` slices, made the global mesh. TPU only."""
    import torch_xla.distributed.spmd as xs
    names, ici, dcn = hybrid_shapes(axes, slices)
    mesh = xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=names)
    xs.set_global_mesh(mesh)
    return mesh
