"""torch_xla's two ways of giving one parameter its sharding. Both leave a plain XLA tensor.

- ``mark_sharding``: ``xs.mark_sharding`` annotates the tensor in place.
- ``distribute_tensor``: torch's ``distribute_tensor`` on an XLA ``DeviceMesh``; the resulting
  ``XLAShardedTensor`` is unwrapped to its ``global_tensor`` (docs/torch_xla.md: DTensor parameters hit
  a functionalization assert inside ``F.linear``).
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
import torch_xla.distributed.spmd as xs
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..errors import PlanError
from ..plan.layout import Spec, spec_axes

ShardFn = Callable[[torch.Tensor, xs.Mesh, Spec], torch.Tensor]
_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # xs.Mesh -> its DeviceMesh twin


def shard_mark(t: torch.Tensor, mesh: xs.Mesh, spec: Spec) -> torch.Tensor:
    """Annotate ``t`` in place; returns ``t`` itself (never the ``XLAShardedTensor`` wrapper)."""
    xs.mark_sharding(t, mesh, spec)
    return t


def shard_distribute(t: torch.Tensor, mesh: xs.Mesh, spec: Spec) -> torch.Tensor:
    """``distribute_tensor`` with the placements equivalent to ``spec``, unwrapped."""
    placements = []
    for axis in mesh.axis_names:
        dims = [d for d, a in enumerate(spec) if axis in spec_axes(a)]
        placements.append(Shard(dims[0]) if dims else Replicate())
    device_mesh = _device_mesh(mesh)
    return distribute_tensor(t, device_mesh, placements).global_tensor


def _device_mesh(mesh: xs.Mesh) -> DeviceMesh:
    """The ``DeviceMesh("xla", ...)`` twin of ``mesh``, built once per mesh."""
    twin = _twins.get(mesh)
    if twin is None:
        ids = torch.as_tensor(mesh.device_ids).reshape(tuple(mesh.mesh_shape))
        twin = _twins[mesh] = DeviceMesh("xla", ids, mesh_dim_names=tuple(mesh.axis_names))
    return twin


def distribute_problem(spec: Spec) -> Optional[str]:
    """Placements say one tensor dimension per mesh axis: a dimension over several axes is not one."""
    if any(isinstance(a, tuple) for a in spec):
        return (f"backend='distribute_tensor' cannot express spec {spec} (a dimension over several "
                f"axes); use backend='mark_sharding'")
    return None


BACKENDS: dict[str, tuple[ShardFn, Callable[[Spec], Optional[str]]]] = {
    "mark_sharding": (shard_mark, lambda spec: None),
    "distribute_tensor": (shard_distribute, distribute_problem),
}


def get_backend(name: str) -> tuple[ShardFn, Callable[[Spec], Optional[str]]]:
    """``(shard, check_spec)`` of backend ``name``; ``PlanError`` listing the backends otherwise."""
    if name not in BACKENDS:
        raise PlanError(f"backend {name!r} is unknown; use one of {sorted(BACKENDS)}")
    return BACKENDS[name]
