"""Write host values into a sharded XLA tensor, each device's block sent straight to its device.

The blocks the local devices hold are computed from the tensor's sharding; each distinct block
(replicas share one) is asked of the source once, padded where the sharding pads, and handed to
the devices (``_load_local_shards``). Nothing is read back and the whole tensor never exists on a
device: a tensor costs at most its own size on the host, however it is sharded. Used by meta
initialisation (``backends.init``: a module's own init runs on host twins of its tensors) and by
checkpoint loading. ``release_host_memory`` returns freed buffers to the operating system between
tensors: glibc otherwise keeps them, and a model-sized stream of tensors leaves a model-sized heap
behind. Example::

    write_from_host(param, lambda blocks: [full[b] for b in blocks])   # any host source
"""
from __future__ import annotations

import ctypes
import ctypes.util
import re
from typing import Callable, Optional, Sequence

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

Block = tuple[slice, ...]
_REPLICATED = torch_xla._XLAC.OpSharding([], [], [], xs.ShardingType.REPLICATED)
_TILES = re.compile(r"devices=\[([\d,]+)\]")
_TILE_CACHE: dict[str, list[tuple[int, ...]]] = {}
ReadBlocks = Callable[[Sequence[Block]], list[torch.Tensor]]


def device_blocks(t: torch.Tensor) -> tuple[list[Block], tuple[int, ...]]:
    """The block of the global tensor ``t`` each local device holds, in local device order, and the
    padded shape of every device's buffer (a sharding that does not divide a dimension pads the
    last blocks). ``t`` is a tiled XLA tensor; it need not hold data yet."""
    spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    tiles = tuple(int(n) for n in _TILES.search(spec).group(1).split(","))[:t.dim()]
    size = tuple(-(-n // k) for n, k in zip(t.shape, tiles))
    blocks = [tuple(slice(min(i * z, n), min((i + 1) * z, n)) for i, z, n in zip(index, size, t.shape))
              for index in _tile_indices(t, spec, tiles)]
    return blocks, size


def _tile_indices(t: torch.Tensor, spec: str, tiles: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Which tile each local device holds, asked of torch_xla on a tensor with one element per tile
    and ``t``'s sharding (its own answer needs device data, which ``t`` may not have yet)."""
    if spec not in _TILE_CACHE:
        proxy = torch.zeros(tiles, dtype=torch.int8, device=t.device)
        torch_xla._XLAC._xla_mark_sharding(proxy, torch_xla._XLAC._get_xla_op_sharding(t))
        torch_xla._XLAC._xla_sync_multi([proxy], devices=[], wait=True)
        _TILE_CACHE[spec] = [tuple(s.start for s in index)
                             for _, index in torch_xla._XLAC._get_local_shard_replica_and_indices([proxy])[0]]
    return _TILE_CACHE[spec]


def distinct(blocks: Sequence[Block]) -> list[Block]:
    """``blocks`` without repeats (the replicas of a partly replicated sharding), in first-seen order."""
    return [tuple(slice(a, z) for a, z in key) for key in dict.fromkeys(block_key(b) for b in blocks)]


def is_tiled(t: torch.Tensor) -> bool:
    """True if ``t`` is split across devices (not unsharded, not fully replicated)."""
    return torch_xla._XLAC._get_xla_sharding_type(t) in (xs.ShardingType.TILED, xs.ShardingType.PARTIAL)


def write_from_host(target: torch.Tensor, read: ReadBlocks) -> None:
    """Overwrite ``target`` (an XLA tensor, with values or still without) with values from the host,
    in place (a parameter stays the same object). ``read(blocks)`` returns one host tensor per block (slices of
    the global tensor), of any dtype."""
    if not is_tiled(target):  # replicated or unsharded: the same value for every device
        (value,) = read([tuple(slice(0, n) for n in target.shape)])
        value = value.to(target.dtype).contiguous()
        devices = torch_xla._XLAC._xla_get_runtime_devices()
        target.data = torch_xla._XLAC._global_tensor_from_cpu_shards([value] * len(devices), _REPLICATED,
                                                                     list(target.shape))
        return
    blocks, shape = device_blocks(target)
    keys = distinct(blocks)
    values = {block_key(b): _padded(v.to(target.dtype), b, shape) for b, v in zip(keys, read(keys))}
    devices = torch_xla._XLAC._xla_get_runtime_devices()
    torch_xla._XLAC._load_local_shards(target, [values[block_key(b)] for b in blocks], devices)


def read_to_host(t: torch.Tensor) -> torch.Tensor:
    """The whole of XLA tensor ``t`` (with device data) on the host, assembled from each device's
    shard. ``t.cpu()`` on a split tensor first runs a program that replicates it on every device
    (a whole tensor per device: 8 GB of device memory for a 1 GB embedding on 8 devices); here the
    shards come over as they are, and the host holds at most the shards and the result."""
    if not is_tiled(t):
        return t.detach().cpu()
    out = torch.empty(t.shape, dtype=t.dtype)
    torch_xla.sync()  # a pending computation of t runs now
    torch_xla._XLAC._xla_wait_device_ops(devices=[])  # reading a buffer an async op still fills fails
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    indices = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    done: set = set()
    for (data, _), (_, index) in zip(shards, indices):
        key = block_key(index)
        if key not in done:
            done.add(key)
            out[tuple(index)] = data[tuple(slice(0, s.stop - s.start) for s in index)]
    return out


def block_key(block: Block) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in block)


def _padded(value: torch.Tensor, block: Block, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(value.shape) == shape:
        return value.contiguous()
    out = host_buffer(block, shape, value.dtype)
    out[tuple(slice(0, n) for n in value.shape)] = value
    return out


_libc: Optional[ctypes.CDLL] = None


def release_host_memory() -> None:
    """Wait for the transfers still reading host buffers (they run after ``_load_local_shards``
    returns, and keep their source until done), then return freed heap memory to the operating
    system (glibc's ``malloc_trim``; a no-op elsewhere)."""
    global _libc
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)



def host_buffer(block: Block, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer of a device's padded ``shape`` for ``block``: zeros where padding remains."""
    exact = tuple(s.stop - s.start for s in block) == shape
    return torch.empty(shape, dtype=dtype) if exact else torch.zeros(shape, dtype=dtype)
