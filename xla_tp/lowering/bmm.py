"""Attention that merges heads with the batch before ``bmm``/``baddbmm`` (BLOOM, XGLM, DeBERTa), kept 4-D.

Such models reshape ``[B, H, S, D]`` to ``[B*H, S, D]`` and multiply with ``bmm``. A dimension that
merges the batch in front of the heads cannot stay split over the heads, so the compiler gathers
q, k and v and runs attention whole. Inside the modules the planner names (``Region.merges``), the
lowering's mode (``mode``) hands these ops to the handlers here: a merge is computed as the model
asks, and the result carries its 4-D source (``_SOURCE``); ``bmm``/``baddbmm``, ``transpose`` of the
last two dims, ``softmax``, ``gather``, dropout, casts and arithmetic on such tensors are computed on the 4-D
sources (``einsum`` with batch and heads both visible), and a view back to ``[B, H, ...]`` returns
the 4-D result. The merged tensors nobody else reads are dropped by the compiler; an op not listed
here reads the merged tensor itself (correct, only slower). Example:

>>> q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8)
>>> q3, k3 = merge(q, (8, 3, 8)), merge(k, (8, 5, 8))
>>> scores = bmm(q3, transpose(k3, -1, -2))
>>> torch.allclose(scores, torch.bmm(q.reshape(8, 3, 8), k.reshape(8, 5, 8).transpose(-1, -2)), atol=1e-6)
True
>>> source(scores).shape
torch.Size([2, 4, 3, 5])
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .tags import Tag

_SOURCE = Tag("heads_source")  # on a [B*H, ...] tensor: the [B, H, ...] tensor it merges


def source(t: Any) -> Optional[torch.Tensor]:
    """The 4-D ``[B, H, ...]`` tensor a merged tensor came from, else None."""
    return _SOURCE.of(t)


def _tagged(merged: torch.Tensor, four: torch.Tensor) -> torch.Tensor:
    return _SOURCE.put(merged, four)


def _lift(four: torch.Tensor) -> torch.Tensor:
    """A 4-D result, with its merged twin (which the compiler drops unless something reads it)."""
    return _tagged(four.flatten(0, 1), four)


def merge(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``x.reshape(shape)``; tagged with ``x`` when it merges ``x``'s first two dims and keeps the rest."""
    out = x.reshape(shape)
    if x.dim() >= 3 and out.dim() == x.dim() - 1 and out.shape[1:] == x.shape[2:]:
        return _tagged(out, x)
    return out


def _as4(t: Any, batch: int, heads: int) -> Any:
    """A tensor operand on the 4-D sources' dims: its source, a ``[B*H, ...]`` tensor viewed 4-D, a
    ``[1, ...]`` one unsqueezed; scalars and lower ranks broadcast as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    four = source(t)
    if four is not None:
        return four
    if t.dim() == 3 and t.shape[0] == batch * heads:
        return t.reshape(batch, heads, *t.shape[1:])
    return t.unsqueeze(0) if t.dim() == 3 else t


def _dims(args: tuple, kwargs: dict) -> Optional[tuple[int, int]]:
    four = next((source(a) for a in (*args, *kwargs.values()) if source(a) is not None), None)
    return None if four is None else (four.shape[0], four.shape[1])


def bmm(a: torch.Tensor, b: torch.Tensor) -> Any:
    dims = _dims((a, b), {})
    if dims is None:
        return NotImplemented
    return _lift(torch.einsum("bhnk,bhkm->bhnm", _as4(a, *dims), _as4(b, *dims)))


def baddbmm(input: Any, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> Any:
    dims = _dims((batch1, batch2), {})
    if dims is None:
        return NotImplemented
    product = torch.einsum("bhnk,bhkm->bhnm", _as4(batch1, *dims), _as4(batch2, *dims))
    out = product if alpha == 1 else product * alpha
    return _lift(out if beta == 0 else out + beta * _as4(input, *dims))


def transpose(x: torch.Tensor, dim0: int, dim1: int) -> Any:
    four = source(x)
    d0, d1 = dim0 % x.dim(), dim1 % x.dim()
    if four is None or 0 in (d0, d1):
        return NotImplemented
    return _tagged(x.transpose(dim0, dim1), four.transpose(d0 + 1, d1 + 1))


def reshape(x: torch.Tensor, *shape: Any) -> Any:
    """A merge of the first two dims (tagged), or a view of a merged tensor back to ``[B, H, ...]``."""
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    four = source(x)
    if four is None:
        return merge(x, shape) if x.dim() == 4 and len(shape) == 3 else NotImplemented
    out = x.reshape(shape)
    if out.dim() == 4 and out.shape[:2] == four.shape[:2]:
        return four.reshape(out.shape)
    if out.dim() == 3 and out.shape[0] == x.shape[0]:
        return _tagged(out, four.reshape(*four.shape[:2], *out.shape[1:]))
    return out


def _along_last(func: Callable) -> Callable:
    """softmax-like ``func(x, dim, ...)`` on the source when ``dim`` is not the merged one."""
    def handler(x: torch.Tensor, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
        four = source(x)
        dim = kwargs.pop("dim", dim)
        if four is None or dim is None or dim % x.dim() == 0:
            return NotImplemented
        return _lift(func(four, dim if dim < 0 else dim + 1, *args, **kwargs))
    return handler


def _elementwise(func: Callable) -> Callable:
    """``func`` applied on the sources (dropout, casts, arithmetic)."""
    def handler(*args: Any, **kwargs: Any) -> Any:
        dims = _dims(args, kwargs)
        if dims is None:
            return NotImplemented
        out = func(*(_as4(a, *dims) for a in args), **{k: _as4(v, *dims) for k, v in kwargs.items()})
        return _lift(out) if isinstance(out, torch.Tensor) and out.dim() == 4 else NotImplemented
    return handler


def gather(x: torch.Tensor, dim: int, index: torch.Tensor, **kwargs: Any) -> Any:
    """``gather`` along another dim than the merged one (DeBERTa's relative positions), on the sources."""
    dims = _dims((x,), {})
    if dims is None or dim % x.dim() == 0:
        return NotImplemented
    return _lift(torch.gather(_as4(x, *dims), dim if dim < 0 else dim + 1, _as4(index, *dims), **kwargs))


def _in_place(func: Callable, out_of_place: Callable) -> Callable:
    """``score += x`` on a merged tensor: done in place as asked, and its source becomes the result on the sources."""
    def handler(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        dims = _dims((x, *args), kwargs)
        if dims is None or source(x) is None:
            return NotImplemented
        four = out_of_place(_as4(x, *dims), *(_as4(a, *dims) for a in args), **kwargs)
        return _tagged(func(x, *args, **kwargs), four)
    return handler


ARITHMETIC = ("add", "sub", "mul", "truediv", "radd", "rsub", "rmul", "rtruediv")
HANDLERS: dict[Callable, Callable] = {
    torch.gather: gather, torch.Tensor.gather: gather,
    torch.bmm: bmm, torch.Tensor.bmm: bmm, torch.baddbmm: baddbmm, torch.Tensor.baddbmm: baddbmm,
    torch.Tensor.transpose: transpose, torch.transpose: transpose,
    torch.Tensor.reshape: reshape, torch.Tensor.view: reshape, torch.reshape: reshape,
    **{f: _along_last(f) for f in (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax)},
    **{f: _elementwise(f) for f in (F.dropout, torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as,
                                    torch.Tensor.masked_fill, torch.Tensor.contiguous, torch.add, torch.mul, torch.div,
                                    torch.Tensor.add, torch.Tensor.mul, torch.Tensor.div, torch.Tensor.sub,
                                    *(getattr(torch.Tensor, f"__{op}__") for op in ARITHMETIC))},
    **{getattr(torch.Tensor, f"{op}_"): _in_place(getattr(torch.Tensor, f"{op}_"), getattr(torch.Tensor, op))
       for op in ("add", "sub", "mul", "div")},
}
