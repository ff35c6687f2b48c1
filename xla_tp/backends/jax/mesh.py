"""JAX meshes: axis sizes or a ``jax.sharding.Mesh`` -> a mesh with xla_tp's axis names.

Axis names are those of ``make_mesh`` (``data``, ``fsdp``, ``model``; aliases ``tp``/``tensor``,
``dp``). Axis sizes are laid out in that order over the first devices, as ``make_mesh`` does, so
device ``i`` holds the same shard on the JAX and the torch_xla backend. Example::

    mesh = to_jax_mesh({"data": 2, "model": 4})   # Mesh('data': 2, 'model': 4) over 8 devices
    mesh = to_jax_mesh(None)                      # 1-D 'model' mesh over all devices
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Union

import jax
import numpy as np
from jax.sharding import Mesh

from ...errors import MeshError
from ...axes import AXIS_ALIASES, AXIS_ORDER, canonical_axis
from .runtime import ensure_cpu_devices

JaxMeshLike = Union[Mesh, Mapping[str, int], None]


def to_jax_mesh(mesh: JaxMeshLike) -> Mesh:
    """A ``jax.sharding.Mesh`` whose axis names went through the aliases (``tp`` -> ``model``)."""
    if isinstance(mesh, Mesh):
        names = tuple(canonical_axis(str(a)) for a in mesh.axis_names)
        if len(set(names)) != len(names):
            raise MeshError(f"mesh axis names {names} repeat after aliasing")
        return mesh if names == tuple(mesh.axis_names) else Mesh(mesh.devices, names)
    if mesh is not None and not isinstance(mesh, Mapping):
        raise MeshError(f"mesh must be a jax.sharding.Mesh, axis sizes such as {{'data': 2, 'model': 4}}, "
                        f"or None; got {type(mesh).__name__}")
    sizes = axis_sizes(mesh or {})
    needed = math.prod(sizes.values()) if sizes else None
    ensure_cpu_devices(needed or 1)
    devices = jax.devices()
    if needed is None:
        return Mesh(np.asarray(devices), ("model",))
    if needed > len(devices):
        raise MeshError(f"mesh {sizes} needs {needed} devices but jax has {len(devices)} "
                        f"({devices[0].platform}); on CPU set CPU_NUM_DEVICES={needed} (or "
                        f"jax.config.update('jax_num_cpu_devices', {needed})) before jax starts")
    return Mesh(np.asarray(devices[:needed]).reshape(tuple(sizes.values())), tuple(sizes))


def axis_sizes(axes: Mapping[str, Optional[int]]) -> dict[str, int]:
    """Canonical axis name -> size, in ``AXIS_ORDER``; ``MeshError`` naming a bad axis or size.

    ``axis_sizes({"tp": 4, "dp": 2}) == {"data": 2, "model": 4}``
    """
    sizes: dict[str, int] = {}
    for name, size in axes.items():
        axis = canonical_axis(str(name))
        if axis not in AXIS_ORDER:
            raise MeshError(f"mesh axis {name!r} is unknown; use one of {AXIS_ORDER} "
                            f"(aliases {sorted(AXIS_ALIASES)})")
        if axis in sizes:
            raise MeshError(f"mesh axis {axis!r} given twice (through {name!r})")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are positive ints")
        sizes[axis] = size
    return {a: sizes[a] for a in AXIS_ORDER if a in sizes}


def partition_ids(mesh: Mesh) -> np.ndarray:
    """The ids the compiled program's replica groups name, one array dimension per axis: a device's position
    in the mesh (the program's device assignment is the mesh's devices in order), which is not its
    ``Device.id`` across processes."""
    return np.arange(mesh.devices.size).reshape(mesh.devices.shape)
