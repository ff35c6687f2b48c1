"""Helpers for the JAX backend tests: which block of a tensor each device holds, on either backend.

Importing this gives jax its 8 CPU devices before any test touches jax directly (``jax.devices()``
starts jax's backend; ``parallelize_jax`` does the same itself when it is the first to start it).
"""
from __future__ import annotations

import copy

import jax
import numpy as np
import torch

import xla_tp
from xla_tp.auditing.params import tiles_of
from xla_tp.backends.jax.runtime import ensure_cpu_devices

from .helpers import sharding

ensure_cpu_devices(8)

Blocks = dict[int, tuple[tuple[int, int], ...]]  # device id -> (start, stop) per tensor dimension


def xla_blocks(t: torch.Tensor, devices: int) -> Blocks:
    """Device id -> the block of ``t`` it holds, from torch_xla's sharding string."""
    tiles = tiles_of(sharding(t))
    if tiles is None:
        return {d: tuple((0, n) for n in t.shape) for d in range(devices)}
    dims, order, replicated_last = tiles
    tensor_dims = dims[:-1] if replicated_last else dims
    coords = np.stack(np.unravel_index(np.arange(len(order)), dims), axis=1)
    out = {}
    for device, coord in zip(order, coords):
        out[int(device)] = tuple((int(c) * (n // k), (int(c) + 1) * (n // k))
                                 for c, n, k in zip(coord, t.shape, tensor_dims))
    return out


def jax_blocks(a: jax.Array) -> Blocks:
    """Device id -> the block of ``a`` it holds."""
    return {d.id: tuple(s.indices(n)[:2] for s, n in zip(index, a.shape))
            for d, index in a.sharding.devices_indices_map(a.shape).items()}


def both_backends(model: torch.nn.Module, plan, axes: dict[str, int]):
    """``(xla_model, jm)``: ``model`` parallelized by torch_xla (a copy) and by JAX, same plan and mesh."""
    xla_model = xla_tp.parallelize_xla(copy.deepcopy(model), plan, mesh=xla_tp.make_mesh(**axes))
    return xla_model, xla_tp.parallelize_jax(model, plan, mesh=axes)
