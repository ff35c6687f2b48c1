"""Meshes: ``make_mesh``, torch's ``init_device_mesh``, and the conversion of every mesh a user
may hold into an ``xs.Mesh``.

Axis names are ``data``, ``fsdp``, ``expert`` (only when asked for) and ``model`` (aliases
``tp``/``tensor`` -> ``model``, ``dp`` -> ``data``, ``ep`` -> ``expert``). Example::

    mesh = make_mesh(data=2, model=4)     # 2 x 4 over 8 devices
    mesh = make_mesh(model=None)          # 1-D over all devices
    mesh = make_mesh(expert=2, model=4)   # MoE experts split 2 ways by all-to-all, 4-way tensor parallel
    world = init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))   # torch's idiom
    parallelize_module(model, world["tp"], plan)   # tensor parallel over tp, batch over dp
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch.distributed.device_mesh import DeviceMesh

from .axes import AXIS_ALIASES, AXIS_ORDER, axis_names, canonical_axis
from .errors import MeshError

_runtime_ready = False


LATE_SPMD = ("the XLA device was used before SPMD was on (an XLA tensor was created or torch_xla.device() "
             "was called before xla_tp was imported): torch_xla 2.9 cannot switch a running process to SPMD "
             "then (its next computation crashes). Import xla_tp (or call torch_xla.runtime.use_spmd()) before "
             "the first XLA tensor or torch_xla.device() call, e.g. at the top of the script")


def spmd_config_locked() -> bool:
    """True once torch_xla has fixed its devices (the first XLA tensor or ``torch_xla.device()`` call)."""
    return torch_xla._XLAC._xla_get_spmd_config_is_locked()


def turn_spmd_on_early() -> None:
    """Turn SPMD on now if torch_xla has not fixed its devices yet (run when xla_tp is imported).

    torch_xla fixes which device ``xla:0`` means at the first XLA tensor or ``torch_xla.device()``
    call; SPMD turned on after that leaves new tensors on a real device that the SPMD executor
    cannot run (a segmentation fault). Turning it on at import costs nothing (it sets an
    environment variable) and makes torch's order work: ``import xla_tp``, ``model.to(device)``,
    then ``make_mesh``. Example::

        turn_spmd_on_early()
        torch_xla.runtime.is_spmd()   # True unless the device was used before
    """
    if not xr.is_spmd() and not spmd_config_locked():
        xr.use_spmd()


def ensure_runtime() -> None:
    """Turn SPMD on and execute one tiny XLA computation, once per process.

    The computation avoids the CPU-backward trap (docs/torch_xla.md): a CPU backward that runs
    before the XLA runtime has executed anything breaks every later XLA backward. A process whose XLA
    device was used before SPMD was on cannot switch: ``MeshError`` says what to do, before anything runs.
    """
    global _runtime_ready
    if _runtime_ready:
        return
    if not xr.is_spmd():
        if spmd_config_locked():
            raise MeshError(LATE_SPMD)
        xr.use_spmd()
    try:
        probe = torch.ones(1, device=torch_xla.device())
    except RuntimeError as error:   # SPMD's variable set by hand after the device was fixed
        raise MeshError(LATE_SPMD) from error
    if not torch_xla._XLAC._xla_get_device_hw_type(probe).startswith("SPMD"):
        raise MeshError(LATE_SPMD)
    (probe * 2).cpu()
    _runtime_ready = True


turn_spmd_on_early()


def device_count() -> int:
    """Number of XLA devices (initialises the runtime first)."""
    ensure_runtime()
    return xr.global_runtime_device_count()


def make_mesh(**axes: Optional[int]) -> xs.Mesh:
    """Build a named ``xs.Mesh`` over all devices and make it the global mesh.

    An axis left out has size 1; ``model=None`` takes the devices left over (also the default
    when no axis is given). The ``expert`` axis is in the mesh only when given: the batch is split
    over it like ``data``, and mixture-of-experts layers split their experts over it (their tokens
    reach them by all-to-all). Example::

        mesh = make_mesh(fsdp=2, model=4)
        mesh.axis_names   # ('data', 'fsdp', 'model') with sizes (1, 2, 4)
    """
    sizes: dict[str, Optional[int]] = {}
    for name, size in axes.items():
        axis = canonical_axis(name)
        if axis not in AXIS_ORDER:
            raise MeshError(f"make_mesh: unknown axis {name!r}; use one of {AXIS_ORDER} "
                            f"(aliases {sorted(AXIS_ALIASES)})")
        if axis in sizes:
            raise MeshError(f"make_mesh: axis {axis!r} given twice (through {name!r})")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise MeshError(f"make_mesh: axis {name!r} has size {size!r}; sizes are positive ints or None")
        sizes[axis] = size
    if not sizes:
        sizes["model"] = None
    n = device_count()
    free = [a for a, s in sizes.items() if s is None]
    if len(free) > 1:
        raise MeshError(f"make_mesh: only one axis may be None, got {free}")
    known = math.prod(s for s in sizes.values() if s is not None)
    if free:
        if n % known:
            raise MeshError(f"make_mesh: fixed axes multiply to {known}, which does not divide "
                            f"the {n} devices")
        sizes[free[0]] = n // known
    names = axis_names(sizes)
    shape = tuple(sizes.get(a) or 1 for a in names)
    if math.prod(shape) != n:
        raise MeshError(f"make_mesh: axis sizes {dict(zip(names, shape))} multiply to "
                        f"{math.prod(shape)} but there are {n} devices")
    mesh = xs.Mesh(np.arange(n), shape, names)
    xs.set_global_mesh(mesh)
    return mesh


class XlaDeviceMesh(DeviceMesh):
    """A ``DeviceMesh("xla", ...)`` that slices the way torch's does on GPUs.

    Under SPMD one process drives every device and there are no process groups, so torch's own
    slicing fails on an XLA mesh. Here ``world["tp"]`` is a 1-D ``DeviceMesh`` over the ``tp``
    axis (the row through device 0) that remembers the whole mesh: xla_tp shards over ``tp``
    and keeps the batch sharded over the whole mesh's other axes. Built by ``init_device_mesh``.
    """

    def __init__(self, mesh: torch.Tensor, mesh_dim_names: Optional[tuple[str, ...]],
                 whole: Optional["XlaDeviceMesh"] = None):
        super().__init__("xla", mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
        self.whole = whole if whole is not None else self

    def __getitem__(self, mesh_dim_names: Union[str, tuple[str, ...]]) -> "XlaDeviceMesh":
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if not self.mesh_dim_names:
            raise MeshError("this DeviceMesh has no mesh_dim_names to slice by; pass mesh_dim_names= to "
                            "init_device_mesh")
        if names == self.mesh_dim_names:
            return self
        unknown = [n for n in names if n not in self.mesh_dim_names]
        if unknown or len(set(names)) != len(names):
            raise MeshError(f"cannot slice {names} out of a mesh with dims {self.mesh_dim_names}: name each "
                            f"dim at most once, from {self.mesh_dim_names}")
        dims = [self.mesh_dim_names.index(n) for n in names]
        rest = [d for d in range(self.mesh.ndim) if d not in dims]
        ids = self.mesh.permute(*rest, *dims)[(0,) * len(rest)]
        return XlaDeviceMesh(ids, names, whole=self.whole)

    def sliced_axis(self) -> Optional[str]:
        """The (canonical) axis a 1-D slice selects: ``world["tp"].sliced_axis() == "model"``."""
        if self.whole is self or self.mesh.ndim != 1:
            return None
        return canonical_axis(self.mesh_dim_names[0])

    def _no_ranks(self, *args: Any, **kwargs: Any) -> Any:
        raise MeshError("under SPMD one process drives every device of an XLA mesh: there are no ranks, "
                        "coordinates or process groups. Feed the global batch; xla_tp shards it over the "
                        "batch axes and the compiler inserts the collectives")

    get_coordinate = get_local_rank = get_group = get_all_groups = _no_ranks


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                     mesh_dim_names: Optional[tuple[str, ...]] = None,
                     backend_override: Any = None) -> XlaDeviceMesh:
    """torch's ``init_device_mesh`` signature for XLA; also the global mesh (like ``make_mesh``).

    ``backend_override`` is accepted for compatibility (there are no process groups under SPMD).
    Example::

        world = init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
        tp_mesh = world["tp"]         # parallelize_module(model, tp_mesh, plan)
    """
    if device_type != "xla":
        raise MeshError(f"init_device_mesh: device_type {device_type!r}; xla_tp builds 'xla' meshes "
                        f"(use torch.distributed.device_mesh.init_device_mesh for other devices)")
    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise MeshError(f"init_device_mesh: mesh_shape {mesh_shape!r} must be positive ints")
    n = device_count()
    if math.prod(shape) != n:
        raise MeshError(f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape)} devices but there "
                        f"are {n}")
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise MeshError(f"init_device_mesh: {len(mesh_dim_names)} mesh_dim_names {tuple(mesh_dim_names)} "
                        f"for a {len(shape)}-D mesh_shape {shape}")
    world = XlaDeviceMesh(torch.arange(n).reshape(shape), tuple(mesh_dim_names) if mesh_dim_names else None)
    xs.set_global_mesh(to_xs_mesh(world))
    return world


MeshLike = Union[xs.Mesh, DeviceMesh, None]


def to_xs_mesh(mesh: MeshLike) -> xs.Mesh:
    """Return an ``xs.Mesh`` for an ``xs.Mesh``, an XLA ``DeviceMesh`` or None.

    None means the global mesh set by ``make_mesh`` (or ``xs.set_global_mesh``), else a 1-D
    ``model`` mesh over all devices. Axis names go through the aliases; an unnamed 1-D mesh
    is the ``model`` axis.
    """
    ensure_runtime()
    if mesh is None:
        mesh = xs.get_global_mesh() or xs.Mesh(np.arange(device_count()), (device_count(),), ("model",))
    if isinstance(mesh, xs.Mesh):
        names = mesh.axis_names or _default_names(len(mesh.mesh_shape))
        shape, ids = tuple(mesh.mesh_shape), np.asarray(mesh.device_ids)
    elif isinstance(mesh, DeviceMesh):
        mesh = mesh.whole if isinstance(mesh, XlaDeviceMesh) else mesh
        if mesh.device_type != "xla":
            raise MeshError(f"DeviceMesh has device_type {mesh.device_type!r}; build it as "
                            f"DeviceMesh('xla', ...)")
        names = mesh.mesh_dim_names or _default_names(mesh.ndim)
        ids = mesh.mesh.cpu().numpy()
        shape = tuple(ids.shape)
    else:
        raise MeshError(f"mesh must be an xs.Mesh, a DeviceMesh('xla', ...) or None; got {type(mesh).__name__}")
    names = tuple(canonical_axis(a) for a in names)
    if len(set(names)) != len(names):
        raise MeshError(f"mesh axis names {names} repeat after aliasing")
    if isinstance(mesh, xs.Mesh) and tuple(mesh.axis_names or ()) == names:
        return mesh
    return xs.Mesh(ids.reshape(-1), shape, names)


def _default_names(ndim: int) -> tuple[str, ...]:
    """An unnamed 1-D mesh is the ``model`` axis; a larger one must say which axis is which."""
    if ndim == 1:
        return ("model",)
    raise MeshError(f"a {ndim}-D mesh needs axis names: pass mesh_dim_names (DeviceMesh) or axis_names "
                    f"(xs.Mesh) from {AXIS_ORDER}, e.g. ('data', 'model')")
