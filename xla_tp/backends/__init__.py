"""Backends: how one parameter gets its sharding. Both leave a plain XLA tensor.

- ``mark_sharding``: ``xs.mark_sharding`` annotates the tensor in place.
- ``distribute_tensor``: torch's ``distribute_tensor`` on an XLA ``DeviceMesh``; the resulting
  ``XLAShardedTensor`` is unwrapped to its ``global_tensor`` (FACTS.md: DTensor parameters hit
  a functionalization assert inside ``F.linear``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch_xla.distributed.spmd as xs

from ..errors import PlanError
from ..plan.layout import Spec

ShardFn = Callable[[torch.Tensor, xs.Mesh, Spec], torch.Tensor]


def shard_mark(t: torch.Tensor, mesh: xs.Mesh, spec: Spec) -> torch.Tensor:
    """Annotate ``t`` in place; returns ``t`` itself (never the ``XLAShardedTensor`` wrapper)."""
    xs.mark_sharding(t, mesh, spec)
    return t


def shard_distribute(t: torch.Tensor, mesh: xs.Mesh, spec: Spec) -> torch.Tensor:
    """``distribute_tensor`` with the placements equivalent to ``spec``, unwrapped."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard

    placements = []
    for axis in mesh.axis_names:
        dims = [d for d, a in enumerate(spec) if a == axis or (isinstance(a, tuple) and axis in a)]
        placements.append(Shard(dims[0]) if dims else Replicate())
    if any(isinstance(a, tuple) for a in spec):
        raise PlanError(f"backend='distribute_tensor' cannot express spec {spec} (a dimension over "
                        f"several axes); use backend='mark_sharding'")
    device_mesh = _device_mesh(mesh)
    return distribute_tensor(t, device_mesh, placements).global_tensor


def _device_mesh(mesh: xs.Mesh):
    """The ``DeviceMesh("xla", ...)`` twin of ``mesh``, built once and kept on it."""
    from torch.distributed.device_mesh import DeviceMesh
    if getattr(mesh, "_xla_tp_device_mesh", None) is None:
        ids = torch.as_tensor(mesh.device_ids).reshape(tuple(mesh.mesh_shape))
        mesh._xla_tp_device_mesh = DeviceMesh("xla", ids, mesh_dim_names=tuple(mesh.axis_names))
    return mesh._xla_tp_device_mesh


BACKENDS: dict[str, ShardFn] = {"mark_sharding": shard_mark, "distribute_tensor": shard_distribute}


def get_backend(name: str) -> ShardFn:
    if name not in BACKENDS:
        raise PlanError(f"backend {name!r} is unknown; use one of {sorted(BACKENDS)}")
    return BACKENDS[name]
