"""Random fills of sharded XLA tensors that each device computes for its own shard only.

torch_xla's ``normal_``/``uniform_`` are not partitioned: its compiled program draws the random
bits of the whole tensor on every device (``u32`` per element) and then keeps the device's shard,
so initialising a 1 GB embedding on 8 devices needs 2 GB of random bits on each. Here every
element's value is a hash (SplitMix64's finaliser) of a per-call seed and the element's index in
the tensor, written with element-wise ops on ``iota``s. GSPMD partitions those like any
element-wise op: each device computes the indices of its own block and nothing else (the idea of
JAX's ``jax_threefry_partitionable``). The values depend on the seed and the global shape only,
not on the mesh; the seed is drawn from torch's CPU generator (or the one passed), so
``torch.manual_seed`` makes an initialisation repeatable. Example::

    normal_(weight, mean=0.0, std=0.02)   # weight: an XLA tensor annotated with its sharding
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment and its finaliser's multipliers
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,
            generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``t.normal_(mean, std)``, by Box-Muller on two uniforms from each element's hash."""
    bits, scale = _bits(t, generator)
    u1 = (_high(bits, scale.bits).to(scale.dtype) + 0.5) * scale.unit  # in (0, 1): log is finite
    u2 = _low(bits, scale.bits).to(scale.dtype) * scale.unit
    return _write(t, torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2) * std + mean)


def uniform_(t: torch.Tensor, low: float = 0.0, high: float = 1.0, *,
             generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``t.uniform_(low, high)``: values in ``[low, high)``."""
    bits, scale = _bits(t, generator)
    return _write(t, _high(bits, scale.bits).to(scale.dtype) * scale.unit * (high - low) + low)


def exponential_(t: torch.Tensor, lambd: float = 1.0, *, generator: Optional[torch.Generator] = None
                 ) -> torch.Tensor:
    """``t.exponential_(lambd)``."""
    bits, scale = _bits(t, generator)
    return _write(t, -torch.log1p(-_high(bits, scale.bits).to(scale.dtype) * scale.unit) / lambd)


FILLS: dict[object, Callable[..., torch.Tensor]] = {
    torch.ops.aten.normal_.default: normal_,
    torch.ops.aten.uniform_.default: uniform_,
    torch.ops.aten.exponential_.default: exponential_,
}


class _Scale:
    """How many random bits a uniform takes for ``dtype``, and the float type it is computed in."""

    def __init__(self, dtype: torch.dtype):
        wide = dtype == torch.float64
        self.dtype = torch.float64 if wide else torch.float32
        self.bits = 32 if wide else 24  # 24 bits fill a float32 mantissa; two halves of 32 for float64
        self.unit = 2.0 ** -self.bits


def _bits(t: torch.Tensor, generator: Optional[torch.Generator]) -> tuple[torch.Tensor, _Scale]:
    """64 random bits per element of ``t`` (int64, ``t``'s shape): the hash of seed + index."""
    seed = torch.empty((), dtype=torch.int64).random_(generator=generator)  # 63 bits of torch's CPU RNG
    z = torch.tensor(int(seed), dtype=torch.int64, device=t.device) + _index(t) * _signed(_GOLDEN)
    z = (z ^ _shift(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift(z, 27)) * _signed(_MIX2)
    return z ^ _shift(z, 31), _Scale(t.dtype)


def _index(t: torch.Tensor) -> torch.Tensor:
    """Each element's row-major index in ``t`` (int64), a sum of broadcast ``arange``s (``iota``)."""
    index = torch.zeros((), dtype=torch.int64, device=t.device)
    stride = 1
    for d in reversed(range(t.dim())):
        shape = [-1 if i == d else 1 for i in range(t.dim())]
        index = index + torch.arange(t.shape[d], dtype=torch.int64, device=t.device).view(shape) * stride
        stride *= t.shape[d]
    return index


def _high(bits: torch.Tensor, n: int) -> torch.Tensor:
    return _shift(bits, 64 - n)


def _low(bits: torch.Tensor, n: int) -> torch.Tensor:
    return bits & ((1 << n) - 1)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _signed(c: int) -> int:
    """The int64 with the bits of the 64-bit unsigned constant ``c`` (multiplication wraps alike)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _write(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.copy_(value.to(t.dtype))
