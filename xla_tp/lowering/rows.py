"""Heads merged with the batch into rows for an op on each row alone, kept N-D: a gated norm per head.

Qwen3-Next's gated delta net normalises each head alone: it views ``[B, S, H, D]`` as ``[B*S*H, D]``, runs
its gated RMSNorm over the rows and views the result back. With the batch split over one axis and the
heads over another, no split of the merged rows is a block of both, so the compiler gathers the heads.
Inside the modules the planner names (``Region.merges``), the merge is computed as the model asks and the
result carries its N-D source (``_SOURCE``); element-wise ops and reductions over the last dim on such
tensors are computed on the sources, and a view back to the source's rows returns the N-D result. An op
not listed here reads the merged tensor itself (correct, only slower). Example:

>>> x, gate = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)     # [B, S, H, D]
>>> rows, gates = reshape(x, -1, 8), reshape(gate, -1, 8)
>>> y = mul(mul(rows, rsqrt(add(mean(mul(rows, rows), -1, keepdim=True), 1e-6))), F.silu(gates))
>>> source(y).shape, torch.equal(reshape(y, 2, 3, 4, 8), source(y))
(torch.Size([2, 3, 4, 8]), True)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .tags import Tag

_SOURCE = Tag("rows_source")  # on a [rows, D] tensor: the [..., D] tensor whose leading dims it merges


def source(t: Any) -> Optional[torch.Tensor]:
    """The N-D tensor a merged ``[rows, D]`` tensor came from, else None."""
    return _SOURCE.of(t)


def _lift(n: torch.Tensor) -> torch.Tensor:
    """An N-D result, with its merged twin (which the compiler drops unless something reads it)."""
    return _SOURCE.put(n.reshape(-1, n.shape[-1]), n)


def _shape(shape: tuple) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape


def reshape(x: torch.Tensor, *shape: Any) -> Any:
    """``x.reshape(-1, D)`` of a tensor of four dims or more (batch, positions, heads: tagged), or a merged
    tensor viewed back."""
    shape = _shape(shape)
    n = source(x)
    if n is None:
        if x.dim() < 4 or len(shape) != 2 or shape[-1] != x.shape[-1] or shape[0] not in (-1, x.numel() // x.shape[-1]):
            return NotImplemented
        return _SOURCE.put(x.reshape(shape), x)
    if math.prod(s for s in shape if s != -1) and shape[-1] == n.shape[-1] and len(shape) > 2:
        return n.reshape(shape)
    return NotImplemented


def _as_n(t: Any, rows: int, lead: tuple) -> Any:
    """An operand on the sources' dims: its source, a ``[rows, ...]`` tensor viewed N-D; others broadcast as
    they are (a ``[D]`` weight, scalars); None if it fits neither."""
    if not isinstance(t, torch.Tensor):
        return t
    n = source(t)
    if n is not None:
        return n
    if t.dim() == 2 and t.shape[0] == rows:
        return t.reshape(*lead, t.shape[-1])
    return t if t.dim() <= 1 else None


def _elementwise(func: Callable) -> Callable:
    """``func`` applied on the sources (arithmetic, casts, activations)."""
    def handler(*args: Any, **kwargs: Any) -> Any:
        n = next((source(a) for a in args if source(a) is not None), None)
        if n is None or kwargs and any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return NotImplemented
        rows, lead = math.prod(n.shape[:-1]), tuple(n.shape[:-1])
        operands = [_as_n(a, rows, lead) for a in args]
        if any(o is None for o in operands):
            return NotImplemented
        out = func(*operands, **kwargs)
        return _lift(out) if isinstance(out, torch.Tensor) and out.shape[:-1] == n.shape[:-1] else NotImplemented
    return handler


def _along_last(func: Callable) -> Callable:
    """A reduction over the last dim (``mean(-1, keepdim=True)``) on the source."""
    def handler(x: torch.Tensor, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
        n = source(x)
        dim = kwargs.pop("dim", dim)
        if n is None or not isinstance(dim, int) or dim % 2 != 1:
            return NotImplemented
        out = func(n, -1, *args, **kwargs)
        return _lift(out) if out.dim() == n.dim() else NotImplemented
    return handler


ARITHMETIC = ("add", "sub", "mul", "truediv", "radd", "rsub", "rmul", "rtruediv", "pow")
_EACH = (torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as, torch.Tensor.contiguous, torch.add, torch.mul,
         torch.div, torch.sub, torch.pow, torch.rsqrt, torch.sqrt, torch.exp, torch.sigmoid, torch.tanh, F.silu, F.gelu,
         F.sigmoid, torch.Tensor.add, torch.Tensor.mul, torch.Tensor.div, torch.Tensor.sub, torch.Tensor.pow,
         torch.Tensor.rsqrt, torch.Tensor.sqrt, torch.Tensor.exp, torch.Tensor.sigmoid,
         *(getattr(torch.Tensor, f"__{op}__") for op in ARITHMETIC))
add, mul, rsqrt = _elementwise(torch.add), _elementwise(torch.mul), _elementwise(torch.rsqrt)  # the example's
mean = _along_last(torch.mean)
HANDLERS: dict[Callable, Callable] = {
    torch.Tensor.reshape: reshape, torch.Tensor.view: reshape, torch.reshape: reshape,
    **{f: _along_last(f) for f in (torch.mean, torch.sum, torch.Tensor.mean, torch.Tensor.sum)},
    **{f: _elementwise(f) for f in _EACH},
}
