"""JAX and torchax set-up, and moving tensors between torch and jax.

- ``import_torchax()`` (``backends.torchax``): torchax without its import-time side effect on the process
  (it turns off torch's ``nn.MultiheadAttention`` fast path); ``torchax_tracing()`` turns it off only while
  torchax traces, where the fast path's kernels do not exist.
- ``ensure_cpu_devices(n)`` (``backends.torchax``): jax's CPU client gets ``n`` devices, or
  ``CPU_NUM_DEVICES`` (the variable that sets torch_xla's CPU device count), if jax has not started yet.
- ``shardy()``: every program this backend compiles uses Shardy (jax's default partitioner).
  torch_xla switches the whole process to GSPMD the first time it annotates a tensor, so without
  this the same model would compile differently depending on what ran before.
- ``to_jax(tensor, sharding)`` / ``to_torch(array)``: host copies, each device given only its shard; across
  processes (``jax.distributed.initialize``), ``to_torch`` gathers the shards other processes hold (every
  process must call it), or gives this process's own rows (``batch_axes``); ``from_process_rows``
  assembles each process's rows into one global array.

Example::

    ensure_cpu_devices(8)
    w = to_jax(torch.randn(64, 16), NamedSharding(mesh, PartitionSpec("model", None)))
    to_torch(w).shape      # torch.Size([64, 16])
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from ..torchax import ensure_cpu_devices, processes  # noqa: F401  (re-exported: the backend's set-up)

# torch dtypes numpy lacks, moved as same-width integers: torch dtype -> (torch carrier, numpy carrier, jax dtype)
_NUMPY_LACKS = {torch.bfloat16: (torch.int16, np.int16, jax.numpy.bfloat16),
                torch.float8_e4m3fn: (torch.int8, np.int8, jax.numpy.float8_e4m3fn),
                torch.float8_e5m2: (torch.int8, np.int8, jax.numpy.float8_e5m2)}




@contextlib.contextmanager
def torchax_tracing() -> Iterator[None]:
    """The MultiheadAttention fast path off (torchax cannot trace it), restored afterwards."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def shardy() -> contextlib.AbstractContextManager:
    """Context: compile with Shardy whatever the process-wide setting (part of jit's cache key)."""
    from jax._src.config import use_shardy_partitioner  # no public context manager in jax 0.7
    return use_shardy_partitioner(True)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view (or copy) of ``t`` on the host, in the dtype jax will hold it in.

    64-bit types become 32-bit unless jax runs with x64; integers that would not fit are an error.
    """
    t = t.detach().cpu().contiguous()
    if t.dtype in _NUMPY_LACKS:
        carrier, _, jax_dtype = _NUMPY_LACKS[t.dtype]
        return t.view(carrier).numpy().view(jax_dtype)
    host = t.numpy()
    target = jax.dtypes.canonicalize_dtype(host.dtype)
    if target == host.dtype:
        return host
    if np.issubdtype(host.dtype, np.integer) and host.size:
        info = np.iinfo(target)
        if host.min() < info.min or host.max() > info.max:
            raise ValueError(f"a {t.dtype} tensor holds values outside {target}: enable 64-bit jax "
                             f"(jax.config.update('jax_enable_x64', True)) before parallelize_jax")
    return host.astype(target)


def to_jax(t: torch.Tensor, sharding: jax.sharding.Sharding) -> jax.Array:
    """``t`` as a jax array laid out as ``sharding``; each device receives only its shard."""
    host = host_array(t)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def from_process_rows(t: torch.Tensor, sharding: jax.sharding.NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """One global array of ``shape`` laid out as ``sharding`` from each process's rows ``t`` (the rows its
    devices hold): every process calls it."""
    return jax.make_array_from_process_local_data(sharding, host_array(t), shape)


def _host_value(a: jax.Array, batch_axes: Optional[tuple[str, ...]]) -> np.ndarray:
    if a.is_fully_addressable or a.is_fully_replicated:
        return np.asarray(a)
    if batch_axes is None:
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))  # a collective: every process calls it
    # the rows of this process's devices: dim 0 keeps its split over the batch axes, every other dim whole
    mesh, first = a.sharding.mesh, a.sharding.spec[0] if len(a.sharding.spec) else None
    kept = tuple(x for x in (first if isinstance(first, tuple) else (first,)) if x in batch_axes)
    rows = PartitionSpec(kept or None)
    whole_rows = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, rows))(a)
    return np.asarray(multihost_utils.global_array_to_host_local_array(whole_rows, mesh, rows))


def to_torch(a: jax.Array, batch_axes: Optional[tuple[str, ...]] = None) -> torch.Tensor:
    """A CPU torch tensor holding the value of ``a`` (gathered from its shards, in every process when they
    span several); with ``batch_axes``, only the rows this process's devices hold of dim 0's split over those
    axes (every other dim whole)."""
    host = _host_value(a, batch_axes)
    for dtype, (_, carrier, jax_dtype) in _NUMPY_LACKS.items():
        if host.dtype == jax_dtype:
            return torch.from_numpy(host.view(carrier).copy()).view(dtype)
    return torch.from_numpy(host.copy())
