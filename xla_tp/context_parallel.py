"""torch's ``context_parallel`` on XLA: the same signature, so torchtitan-style code swaps one import.

torch's ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=, buffer_seq_dims=,
no_restore_buffers=)`` replaces each buffer by this rank's shard of its sequence for the block and routes
SDPA to ring attention. Under SPMD a tensor is one global value: here each buffer keeps its values and is
laid out with its sequence split over the context axis (its batch over the batch axes), in place; inside
the block, SDPA on XLA tensors computes each device's queries against keys and values gathered over the
axis, and projections of a sequence-split activation keep it split (``lowering/context.py``). A model
parallelized by xla_tp on a mesh with a context axis does this by itself; the block is for code that was
written for torch's API, or that is not parallelized. Nothing of torch is patched: a
``TorchFunctionMode`` is entered for the block only. On exit each buffer gets its previous layout back
(except those in ``no_restore_buffers``); its values never change. The sequence stays in order (no causal
load-balancing permutation: the dense attention computes whole blocks, so the work is even).
Example::

    world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("cp", "tp"))
    parallelize_module(model, world["tp"], plan)
    with context_parallel(world["cp"], buffers=[ids, labels], buffer_seq_dims=[1, 1]):
        loss = loss_fn(model(ids), labels)
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.distributed.spmd as xs
from torch.overrides import TorchFunctionMode

from .axes import CONTEXT, batch_axes, sequence_axes, spec_entry
from .backends.annotate import XlaSharder
from .batch import batch_split
from .errors import PlanError
from .lowering import attention, context
from .mesh import MeshLike, to_xs_mesh


class _ContextAttention(TorchFunctionMode):
    """SDPA and projections of a sequence split over the context axis, for code outside a parallelized model."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "xla":
            return attention.sdpa(*args, **kwargs)
        if func is F.linear and args and context.splits_sequence(args[0]):
            return context.linear(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def context_parallel(mesh: MeshLike, *, buffers: Optional[Sequence[torch.Tensor]] = None,
                     buffer_seq_dims: Optional[Sequence[int]] = None,
                     no_restore_buffers: Optional[set[torch.Tensor]] = None) -> Iterator[None]:
    """Split ``buffers`` along ``buffer_seq_dims`` over the mesh's context axis for the block (see the
    module docstring). ``mesh``: the ``cp`` slice of ``xla_tp.init_device_mesh`` (or the whole mesh, an
    ``xs.Mesh`` with a ``context`` axis). Bad input raises ``PlanError`` before any buffer changes."""
    xmesh = to_xs_mesh(mesh)
    sizes = dict(zip(xmesh.axis_names, (int(s) for s in xmesh.mesh_shape)))
    if sizes.get(CONTEXT, 1) < 2:
        raise PlanError(f"context_parallel: the mesh {sizes} has no context axis of size 2 or more; build it "
                        f"with a 'cp' dimension (init_device_mesh('xla', (cp, tp), mesh_dim_names=('cp', 'tp'))) "
                        f"and pass world['cp']")
    buffers, dims = list(buffers or ()), list(buffer_seq_dims or ())
    if len(buffers) != len(dims):
        raise PlanError(f"context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one "
                        f"sequence dimension per buffer")
    specs = [_spec(i, b, d, sizes) for i, (b, d) in enumerate(zip(buffers, dims))]
    kept = no_restore_buffers or set()
    before = [torch_xla._XLAC._get_xla_op_sharding(b) for b in buffers]
    marked = 0
    try:
        for b, spec in zip(buffers, specs):
            torch_xla._XLAC._xla_clear_sharding(b)
            marked += 1
            xs.mark_sharding(b, xmesh, spec)
        with context.ambient(XlaSharder(xmesh), batch_axes(sizes), "model"), _ContextAttention():
            yield
    finally:
        for b, old in zip(buffers[:marked], before):
            if not any(b is k for k in kept):
                _restore(b, old, xmesh)


def _restore(buffer: torch.Tensor, old: Any, xmesh: Any) -> None:
    """``buffer`` laid out as before the block: its old sharding, or replicated (and unannotated) if it had none."""
    torch_xla._XLAC._xla_clear_sharding(buffer)
    if old is not None:
        torch_xla._XLAC._xla_mark_sharding(buffer, old)
        return
    xs.mark_sharding(buffer, xmesh, (None,) * buffer.dim())  # the data gathered back, then no annotation
    torch_xla._XLAC._xla_clear_sharding(buffer)


def _spec(i: int, buffer: Any, dim: int, sizes: dict[str, int]) -> tuple:
    """Buffer ``i``'s partition spec: its sequence over the context axis, dimension 0 (when not the
    sequence) over the batch axes it divides."""
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "xla":
        raise PlanError(f"context_parallel: buffers[{i}] is {type(buffer).__name__}"
                        f"{' on ' + str(buffer.device) if isinstance(buffer, torch.Tensor) else ''}; pass XLA tensors "
                        f"(move it with .to(torch_xla.device()) first)")
    if not -buffer.dim() <= dim < buffer.dim():
        raise PlanError(f"context_parallel: buffer_seq_dims[{i}] = {dim} but buffers[{i}] has {buffer.dim()} dimensions")
    dim %= buffer.dim()
    if not sequence_axes(sizes, buffer.shape[dim]):
        raise PlanError(f"context_parallel: buffers[{i}] has {buffer.shape[dim]} positions along dimension {dim}, "
                        f"which the context axis ({sizes[CONTEXT]} devices) does not divide; pad the sequence to a "
                        f"multiple of {sizes[CONTEXT]}")
    spec: list[Any] = [None] * buffer.dim()
    spec[dim] = CONTEXT
    if dim != 0:
        spec[0] = spec_entry(batch_split(buffer.shape[0], batch_axes(sizes), sizes))
    return tuple(spec)
