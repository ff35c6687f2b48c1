"""Attention per context block on a flash kernel: Pallas' splash attention, each device's queries against the
keys and values gathered over the context axis, the causal mask offset by the block's start.

Under a context split (``context.context_split``) a device holds queries ``[c*s/C, (c+1)*s/C)`` of a
sequence of ``s`` tokens and every key. torch_xla's ``flash_attention(q, k, v, partition_spec=, mesh=)``
cannot run that: one partition spec for q, k and v (the queries split, the keys whole is two), and a
causal mask that aligns query 0 with key 0 (device ``c`` needs its queries to start at ``c*s/C``).
The routes at hand (torch_xla 2.9, JAX 0.7), by memory per device (heads ``h`` per device, a query block ``q = s/C``):

- torch_xla's flash kernel in a manual-sharding region with the offset as its ``ab`` bias: an
  ``[h, q, s]`` bias per device, the very score block the kernel exists to avoid; with segment ids the
  offset cannot be said (they mask equality, not order).
- torch_xla's ``splash_attention``: its JAX ``shard_map`` takes one spec for q, k and v too, and builds
  its causal mask from the local query length (no offset).
- JAX's splash kernel (``make_splash_mha``) called through ``call_jax`` in a ``shard_map`` of our own
  (chosen): queries in ``[batch, heads, context, -]``, keys and values in ``[batch, heads, -, -]``, and the
  kernel built for the global causal mask with ``q_seq_shards`` = the context ways, so its mask tables
  (which blocks to compute, each query's position) are split along the queries with them: each device
  computes its query block against every key, skips the blocks above the diagonal, and holds
  ``O(q * block_kv)`` scores at a time, never ``[q, s]``. Grouped keys and values stay grouped (the
  kernel reads query head ``i``'s key head ``i // (h / kv)``), unless their heads do not divide the
  tensor-parallel axis (then they are repeated, as ``flash_call`` does).

The backward is a shard_map too: each device differentiates its kernel call (``jax.vjp``: the forward runs
again, as in torch_xla's splash) and reduce-scatters its partial key/value gradients over the context axis, so
a layer moves the minimum the audit counts (the keys' and values' gathers and those reduce-scatters; the
einsum route all-reduces those gradients instead). Selected (``plan``) with ``use_flash_attention(True)`` on a
TPU when the kernel's constraints hold: no mask or dropout, as many queries as keys, each device's queries and
all keys a multiple of 128 (the kernel's lane width), outside ``torch.compile`` (dynamo cannot trace
``call_jax``), an identity device order (the JAX mesh is an ``AbstractMesh``: logical device ``i`` is
torch_xla's device ``i``). Elsewhere attention takes the einsum route. ``interpret=True`` runs the kernel in
Pallas' interpreter on any device (tests: the same shard_map and kernel, on CPU). Example (inside a
parallelized forward on ``make_mesh(context=4, model=2)``, q/k/v ``[2, 4, 2048, 128]``)::

    blocks = plan(q, k, None, 0.0, True, 128 ** -0.5)    # Blocks(... block_q=512, block_kv=512 ...)
    out = attention(q, k, v, blocks)                     # [2, 4, 2048, 128], queries split over context
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import numpy as np
import torch

from ..axes import spec_entry
from ..batch import ways
from .context import context_split, query_layout

BLOCK_SIZES = (512, 256, 128)  # the kernel's block sizes tried, largest first (multiples of its 128 lanes)


def block_size(length: int) -> Optional[int]:
    """The largest of ``BLOCK_SIZES`` that divides ``length`` (None if none does).

    >>> block_size(2048), block_size(384), block_size(200)
    (512, 128, None)
    """
    return next((b for b in BLOCK_SIZES if length % b == 0), None)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One call's layout and kernel: the mesh (``axes``: names and sizes, in order), the partition-spec entries
    of the batch, the query heads, the key/value heads and the sequence, the mask and scale, the kernel's
    block sizes and whether it runs in Pallas' interpreter. Hashable: ``call_jax`` caches one program per
    ``Blocks`` and shapes."""

    axes: tuple[tuple[str, int], ...]
    batch: Any
    heads: Optional[str]
    kv_heads: Optional[str]
    seq: Any
    causal: bool
    scale: float
    block_q: int
    block_kv: int
    interpret: bool = False
    mirrored: bool = False

    def ways(self, entry: Any) -> int:
        """How many devices a partition-spec entry spans."""
        return ways(() if entry is None else (entry,) if isinstance(entry, str) else entry, dict(self.axes))


def _identity_order(mesh: Any) -> bool:
    """Whether ``mesh``'s devices are in id order (what an ``AbstractMesh`` of its shape means)."""
    ids = np.asarray(mesh.device_ids).reshape(-1)
    return bool((ids == np.arange(ids.size)).all())


def plan(query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
         is_causal: bool, scale: float, interpret: bool = False, balance: bool = True) -> Optional[Blocks]:
    """The kernel's ``Blocks`` for SDPA of ``query`` ``[b, h, s, d]`` against ``key`` ``[b, kv, s, d]`` when
    the queries are split over a context axis here and the kernel can take the call (see the module; on a
    TPU unless ``interpret``), else None. With ``balance``, a causal call whose ``2 * context`` chunks
    are each a multiple of the kernel's 128 lanes runs on mirrored chunks (``mirrored_order``)."""
    if attn_mask is not None or dropout_p or query.dim() != 4 or key.dim() != 4 or query.device.type != "xla":
        return None
    if torch.compiler.is_compiling():  # dynamo cannot trace call_jax (torch_xla's own splash needs a custom op)
        return None
    found = query_layout(query, key)
    if found is None or key.shape[2] != query.shape[2] or query.shape[1] % key.shape[1]:
        return None
    sharder, batch, seq, heads, kv_heads = found
    mesh = getattr(sharder, "mesh", None)
    if mesh is None or not hasattr(mesh, "device_ids") or not _identity_order(mesh):
        return None
    if not interpret:
        import torch_xla.runtime as xr
        if xr.device_type() != "TPU":
            return None
    length, shards = query.shape[2], ways(seq, sharder.sizes)
    mirrored = balance and is_causal and shards > 1 and length % (2 * shards) == 0 \
        and block_size(length // (2 * shards)) is not None
    block_q, block_kv = block_size(length // (2 * shards if mirrored else shards)), block_size(length)
    if block_q is None or block_kv is None:
        return None
    return Blocks(axes=tuple((str(a), int(s)) for a, s in zip(mesh.axis_names, mesh.mesh_shape)),
                  batch=spec_entry(batch), heads=heads, kv_heads=kv_heads if heads else None,
                  seq=spec_entry(seq), causal=bool(is_causal), scale=float(scale), block_q=block_q,
                  block_kv=block_kv, interpret=interpret, mirrored=mirrored)


def mirrored_order(length: int, shards: int) -> np.ndarray:
    """The query positions in the balanced order: the sequence cut into ``2 * shards`` chunks, device ``c``
    holding chunk ``c`` then chunk ``2 * shards - 1 - c``, so under a causal mask every device's queries
    meet as many keys (a late chunk pairs with an early one).

    >>> mirrored_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    chunks = np.arange(length, dtype=np.int32).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[c], chunks[2 * shards - 1 - c]]) for c in range(shards)])


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """SDPA of ``query`` ``[b, h, s, d]`` against ``key``/``value`` ``[b, kv, s, d]`` by the splash kernel on
    each device's query block (``blocks`` from ``plan``). The queries are laid out by ``context_split`` (which
    records the key/value gathers for the audit); the keys and values enter as they are, the kernel's
    shard_map gathers them and reduce-scatters their gradients (``context_split``'s layout of them would
    gather their gradients back), except where their heads must be repeated first."""
    query, whole_key, whole_value, _ = context_split(query, key, value)
    if blocks.heads and not blocks.kv_heads and key.shape[1] != query.shape[1]:  # groups straddle the devices
        group = query.shape[1] // key.shape[1]  # gathered first: the repeat then runs on each device
        key, value = whole_key.repeat_interleave(group, dim=1), whole_value.repeat_interleave(group, dim=1)
        blocks = dataclasses.replace(blocks, kv_heads=blocks.heads)
    _jax_ready()
    return _Splash.apply(query, key, value, blocks)


@functools.cache
def _jax_ready() -> None:
    """Once per process: jax's CPU device count set if this starts jax (the JAX backend's, not one), and
    torchax importable (torch_xla's ``call_jax`` needs it)."""
    from ..backends.torchax import ensure_cpu_devices, import_torchax
    ensure_cpu_devices(1)
    import_torchax()


class _Splash(torch.autograd.Function):
    """The kernel's forward and its gradient (``jax.vjp``, recomputing the forward), each one ``call_jax``."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        from torch_xla.core.xla_builder import call_jax
        ctx.save_for_backward(query, key, value)
        ctx.blocks = blocks
        return call_jax(_sharded, (query.contiguous(), key.contiguous(), value.contiguous(), blocks))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from torch_xla.core.xla_builder import call_jax
        query, key, value = ctx.saved_tensors
        dq, dk, dv = call_jax(_backward, (query.contiguous(), key.contiguous(), value.contiguous(),
                                          grad.contiguous(), ctx.blocks))
        return dq, dk, dv, None


def _kernel(blocks: Blocks, heads: int, length: int) -> tuple[Any, Any, Any]:
    """(the splash kernel, its shard_map spec, the JAX mesh) for ``heads`` query heads over ``length`` tokens:
    causal, the global mask with its tables split over the heads' and the sequence's axes (each device's
    query positions with them; ``mirrored``: positions in ``mirrored_order``, so each device's tables skip
    as many blocks); else every device's block alike, its tables split over the heads only (jax 0.7's
    backward tables of a full mask split along the queries fail: no partial block to pad)."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.sharding import NamedSharding, PartitionSpec

    shards = blocks.ways(blocks.seq)
    if blocks.causal:
        mask = sm.CausalMask((length, length))
        if blocks.mirrored:  # the kernel computes its mask from each row's position in this table
            mask.q_sequence = mirrored_order(length, shards)
    else:
        mask = sm.FullMask((length // shards, length))
    bq, bkv = blocks.block_q, blocks.block_kv
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True)
    kernel = sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                head_shards=blocks.ways(blocks.heads), q_seq_shards=shards if blocks.causal else 1,
                                interpret=blocks.interpret)
    names, counts = zip(*blocks.axes)
    mesh = jax.sharding.AbstractMesh(counts, names)
    tables = PartitionSpec(blocks.heads, blocks.seq if blocks.causal else None)
    return kernel, kernel.manual_sharding_spec(NamedSharding(mesh, tables)), mesh


def _routes(shards: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (source, destination) devices of the even chunks (``2d`` on device ``d``) and of the odd ones
    (``2d + 1``) into ``mirrored_order``: chunk ``h`` goes to device ``min(h, 2 * shards - 1 - h)``. Each is
    a permutation of the devices, so each is one collective-permute.

    >>> _routes(4)
    ([(0, 0), (1, 2), (2, 3), (3, 1)], [(0, 1), (1, 3), (2, 2), (3, 0)])
    """
    def home(chunk: int) -> int:
        return min(chunk, 2 * shards - 1 - chunk)
    return [(d, home(2 * d)) for d in range(shards)], [(d, home(2 * d + 1)) for d in range(shards)]


def _mirror(x: Any, blocks: Blocks, back: bool = False) -> Any:
    """One device's queries (dimension 2) from the contiguous order into ``mirrored_order`` (``back``: the
    reverse): two collective-permutes over the context axis, an even chunk and an odd one per device (an
    even device's first mirrored chunk is the even one, an odd device's the odd one)."""
    import jax
    import jax.numpy as jnp
    even, odd = _routes(blocks.ways(blocks.seq))
    first, second = jnp.split(x, 2, axis=2)
    in_order = jax.lax.axis_index(blocks.seq) % 2 == 0
    if back:
        even, odd = ([(b, a) for a, b in pairs] for pairs in (even, odd))
        first, second = jnp.where(in_order, first, second), jnp.where(in_order, second, first)
    got_even, got_odd = jax.lax.ppermute(first, blocks.seq, even), jax.lax.ppermute(second, blocks.seq, odd)
    if back:
        return jnp.concatenate([got_even, got_odd], axis=2)
    return jnp.concatenate([jnp.where(in_order, got_even, got_odd), jnp.where(in_order, got_odd, got_even)], axis=2)


def _specs(blocks: Blocks) -> tuple[Any, Any, Any]:
    """The partition specs of the queries (and the output), of the keys and values whole (gathered), and of
    the keys and values split as the queries (their gradients)."""
    from jax.sharding import PartitionSpec
    return (PartitionSpec(blocks.batch, blocks.heads, blocks.seq, None),
            PartitionSpec(blocks.batch, blocks.kv_heads, None, None),
            PartitionSpec(blocks.batch, blocks.kv_heads, blocks.seq, None))


def _local(kernel: Any, q: Any, k: Any, v: Any, blocks: Blocks) -> Any:
    """The kernel on one device's queries ``[b, h, q, d]`` against its keys and values ``[b, kv, s, d]``
    (``mirrored``: on its mirrored chunks, the output back in its own order; JAX's derivative of the
    permutes is the reverse permutes)."""
    import jax
    if blocks.mirrored:
        q = _mirror(q, blocks)
    out = jax.vmap(kernel)((q * blocks.scale).astype(q.dtype), k, v)
    return _mirror(out, blocks, back=True) if blocks.mirrored else out


def _sharded(query: Any, key: Any, value: Any, blocks: Blocks) -> Any:
    """The kernel on every device's query block, as one JAX function of the global q/k/v."""
    import jax
    kernel, kernel_spec, mesh = _kernel(blocks, query.shape[1], query.shape[2])
    queries, whole, _ = _specs(blocks)
    return jax.shard_map(functools.partial(_local, blocks=blocks), mesh=mesh,
                         in_specs=(kernel_spec, queries, whole, whole), out_specs=queries,
                         check_vma=False)(kernel, query, key, value)


def _backward(query: Any, key: Any, value: Any, grad: Any, blocks: Blocks) -> Any:
    """The gradients of ``_sharded`` for ``grad``: on each device the kernel's own (its forward run again),
    the keys' and values' partial sums reduce-scattered over the context axis (split as the queries)."""
    import jax
    kernel, kernel_spec, mesh = _kernel(blocks, query.shape[1], query.shape[2])
    queries, whole, split = _specs(blocks)

    def block(kernel: Any, q: Any, k: Any, v: Any, g: Any) -> tuple[Any, Any, Any]:
        _, pullback = jax.vjp(functools.partial(_local, kernel, blocks=blocks), q, k, v)
        dq, dk, dv = pullback(g)
        return (dq, *(jax.lax.psum_scatter(d, blocks.seq, scatter_dimension=2, tiled=True) for d in (dk, dv)))

    return jax.shard_map(block, mesh=mesh, in_specs=(kernel_spec, queries, whole, whole, queries),
                         out_specs=(queries, split, split), check_vma=False)(kernel, query, key, value, grad)
