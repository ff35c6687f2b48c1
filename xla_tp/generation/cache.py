"""Where a KV cache lives: its batch over the mesh's batch axes, its key/value heads over the
tensor-parallel axis (``LOGICAL_AXES``' ``batch`` and ``kv_heads``), as the model's k/v projections
leave them.

A dimension those axes do not divide stays whole: key/value heads fewer than the model axis (or not a
multiple of it) are on every device, as "auto" computes them whole, so the cache meets the
projections without moving. The cache is allocated inside the first compiled program (zeros, never
on the host) and then updated in place: torch_xla donates its buffers to each decode step. Example::

    placement = placement_of(model, dims=(0, 1))         # [batch, kv heads, length, head_dim] tensors
    placement.spec((8, 4, 64, 16))                       # ('data', 'model', None, None) on data=2, model=4
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..auditing.params import local_numel, sharding_string
from ..axes import batch_ways, mesh_axes, sizes_of, spec_entry
from ..errors import GenerationError
from ..state import states_under


@dataclass(frozen=True)
class Placement:
    """A parallelized model's mesh (an ``xs.Mesh``), its axis sizes and its tensor-parallel axis, and
    where a cache tensor's batch and key/value heads are (``dims``: ``(batch_dim, heads_dim)``)."""

    mesh: Any
    sizes: dict[str, int]
    tp_axis: str
    dims: tuple[int, int]
    sharder: Any  # a ``backends.annotate.XlaSharder`` over ``mesh``, made outside any compilation
    placed: dict[tuple[int, ...], tuple[Any, ...]] = field(default_factory=dict)  # shape: spec, by ``place``

    @property
    def batch_multiple(self) -> int:
        """How many ways the batch is split: a batch is padded to a multiple of it."""
        return batch_ways(self.sizes)

    def spec(self, shape: tuple[int, ...]) -> tuple[Any, ...]:
        """The partition spec of a cache tensor of ``shape`` (see the module docstring)."""
        spec: list[Any] = [None] * len(shape)
        for dim, logical in zip(self.dims, ("batch", "kv_heads")):
            axes = mesh_axes(logical, self.sizes, self.tp_axis)
            if axes and shape[dim] % math.prod(self.sizes[a] for a in axes) == 0:
                spec[dim] = spec_entry(axes)
        return tuple(spec)

    def place(self, t: torch.Tensor) -> None:
        """Annotate the (not yet computed) cache tensor ``t`` with its layout."""
        import torch_xla.distributed.spmd as xs
        spec = self.placed.setdefault(tuple(t.shape), self.spec(tuple(t.shape)))
        xs.mark_sharding(t, self.mesh, spec)

    def pin(self, t: torch.Tensor) -> None:
        """Lay the placed cache tensor ``t`` out again after an update (in place), so a captured step
        returns the cache as it took it: the compiler would otherwise lay its outputs out as the k/v
        projections leave them. Traceable by dynamo: the spec was computed by ``place``."""
        t.copy_(self.sharder.annotate(t, self.placed[tuple(t.shape)]))


def placement_of(model: nn.Module, dims: tuple[int, int]) -> Placement:
    """The placement of a parallelized ``model``'s cache with batch and heads at ``dims`` (the outermost
    call on it or in it);
    ``GenerationError`` when nothing in it was parallelized."""
    found = next(iter(states_under(model)), None)
    if found is None:
        raise GenerationError(f"{type(model).__name__} is not parallelized: call xla_tp.parallelize_xla(model, "
                              f"'auto', mesh=mesh) (or your plan) first, then generate")
    state = found[2]
    from ..backends.annotate import XlaSharder
    return Placement(state.mesh, sizes_of(state.mesh), state.layout.tp_axis, dims, XlaSharder(state.mesh))


def cache_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(bytes on the fullest device, bytes in all)`` of cache tensors, read from their shardings."""
    per_device = total = 0
    for t in tensors:
        per_device += local_numel(tuple(t.shape), sharding_string(t)) * t.element_size()
        total += t.numel() * t.element_size()
    return per_device, total
