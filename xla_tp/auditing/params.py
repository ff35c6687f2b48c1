"""Per-device parameter bytes, read from the shardings the tensors actually carry.

Works for any annotated module (xla_tp, hand-written ``mark_sharding``, ``xla_distribute_module``)
because it parses the sharding string XLA holds for each tensor, not a plan. Example::

    tiles_of("{devices=[4,1]0,1,2,3}")                        # ((4, 1), (0, 1, 2, 3), False)
    param_bytes(model)                                        # (largest bytes per device, total bytes)
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch
from torch import nn

_TILED_RE = re.compile(r"devices=\[([\d,]+)\]([\d,]+)(\s+last_tile_dim_replicate)?")
_IOTA_RE = re.compile(r"devices=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?(\s+last_tile_dim_replicate)?")

Tiles = tuple[tuple[int, ...], tuple[int, ...], bool]


def tiles_of(spec: str) -> Optional[Tiles]:
    """``(tile dims, device order, last dim is replication)`` of a sharding string; None if replicated.

    >>> tiles_of("{devices=[1,1,4]0,1,2,3 last_tile_dim_replicate}")
    ((1, 1, 4), (0, 1, 2, 3), True)
    """
    iota = _IOTA_RE.search(spec)
    if iota:
        import numpy as np
        dims = tuple(int(d) for d in iota.group(1).split(","))
        src = [int(d) for d in iota.group(2).split(",")]
        perm = [int(p) for p in iota.group(3).split(",")] if iota.group(3) else list(range(len(src)))
        ids = np.arange(math.prod(src)).reshape(src).transpose(perm).reshape(-1)
        return dims, tuple(int(i) for i in ids), bool(iota.group(4))
    tiled = _TILED_RE.search(spec)
    if not tiled:
        return None
    dims = tuple(int(d) for d in tiled.group(1).split(","))
    devices = tuple(int(d) for d in tiled.group(2).split(",") if d)
    return dims, devices, bool(tiled.group(3))


def sharding_string(t: torch.Tensor) -> str:
    """XLA's sharding string of ``t`` ('' when it has none or is not an XLA tensor)."""
    if t.device.type != "xla":
        return ""
    import torch_xla
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def local_numel(shape: tuple[int, ...], spec: str) -> int:
    """Elements of the largest shard: ``local_numel((64, 64), "{devices=[4,1]0,1,2,3}") == 1024``."""
    tiles = tiles_of(spec)
    if tiles is None:
        return math.prod(shape)
    return math.prod(-(-n // t) for n, t in zip(shape, tiles[0]))


def param_bytes(module: nn.Module) -> tuple[int, int]:
    """(largest per-device parameter bytes, unsharded total bytes); tied parameters count once."""
    local = total = 0
    for p in module.parameters():
        local += local_numel(tuple(p.shape), sharding_string(p)) * p.element_size()
        total += p.numel() * p.element_size()
    return local, total
