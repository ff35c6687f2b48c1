"""Blocks of a packed projection that every device holds whole: multi-query attention's key/value head.

GPT-BigCode/StarCoder pack q (all heads) with one key and one value head in ``c_attn``. "auto" splits
the query heads and gives every device its own copy of the key/value block (``packed.Packing.whole``:
the weight grows by the copies). The model slices that block out as ``[B, 1, S, D]``; what it gets
(``copied_block``) is the copies' mean (which only an all-reduce could form, so a use xla_tp does not
know costs one), carrying the copies as key/value heads ``[B, tp, S, D]`` (``_KV``): device ``d``'s
query heads read copy ``d``. Attention (``attention.sdpa``, ``as_kv_heads``), Hugging Face's
``repeat_kv`` (an index adding a dim, ``expand``, a ``reshape`` merging the repeats) and a KV cache's
``cat`` (``HANDLERS``) use them, so nothing moves. The copies stay equal: the projection reads its weight through ``summed``, so
each copy's gradient is their sum (``sum_copies``), what the one original weight would have got. Example:

>>> part = torch.randn(2, 1, 5, 1, 8).expand(2, 1, 5, 4, 8)          # [B, 1 head, S, 4 copies, D]
>>> k = copied_block(part)
>>> k.shape, as_kv_heads(k).shape
(torch.Size([2, 1, 5, 8]), torch.Size([2, 4, 5, 8]))
>>> repeated = reshape(expand(getitem(k, (slice(None), slice(None), None)), 2, 1, 8, 5, 8), 2, 8, 5, 8)
>>> torch.equal(repeated, k[:, :, None].expand(2, 1, 8, 5, 8).reshape(2, 8, 5, 8))     # equal copies
True
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .blocks import per_device
from .tags import Tag

_KV = Tag("kv_copies")  # on a copied block as the model sees it: (copies as heads, the head dim)
_PART = Tag("copies")  # on a copied block with no head dim: its copies ``[..., tp, n]``
_MARK = 97  # a size no other dim has, to find where an index moves the head dim


def merged(part: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The block the copies ``part`` (``[..., tp, n]``, device ``d`` holding group ``d // (tp // groups)``) are of:
    ``[..., groups * n]``, each group the mean of its copies (equal copies: the group itself).

    >>> merged(torch.tensor([[1., 2.], [1., 2.], [3., 4.], [3., 4.]]), 2).tolist()
    [1.0, 2.0, 3.0, 4.0]
    """
    return part.unflatten(-2, (groups, part.shape[-2] // groups)).mean(-2).flatten(-2)


def copied_block(part: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The block the model asked for (``[B, 1, S, D]``), from its copies ``part`` (``[B, 1, S, tp, D]``); a block
    with no head dim yet (Mamba2's ``B`` of one group, ``[B, S, N]``, or of ``groups``: ``[B, S, groups * N]``) keeps
    its copies for the view that adds it."""
    block = merged(part, groups)
    if part.dim() == 5 and part.shape[1] == 1 and groups == 1:
        _tag(block, part.squeeze(1).movedim(-2, 1), 1)
    else:
        _PART.put(block, (part, groups))
    return block


def copied_head(part: torch.Tensor) -> torch.Tensor:
    """The one key/value head the model asked for (``[..., 1, D]``, Falcon's ``qkv.view(b, s, heads + 2, d)[..., [-2], :]``)
    from its copies ``part`` (``[..., tp, D]``), which it carries as key/value heads on the same dim."""
    return _tag(part.mean(-2, keepdim=True), part, part.dim() - 2)


def _tag(t: torch.Tensor, heads: torch.Tensor, dim: int) -> torch.Tensor:
    return _KV.put(t, (heads, dim))


def _kv(t: Any) -> Optional[tuple[torch.Tensor, int]]:
    return _KV.of(t)


def as_kv_heads(t: torch.Tensor) -> torch.Tensor:
    """A ``[B, 1, S, D]`` copied key/value as ``[B, tp, S, D]``; ``t`` itself when it has no copies."""
    kv = _kv(t)
    return kv[0] if kv is not None and kv[1] == t.dim() - 3 else t


def getitem(x: torch.Tensor, index: Any) -> Any:
    """``x[:, :, None]`` and the like (new dims, whole slices) on the copies too; other indexing as ``follow``
    does it (rotary embeddings' halves of the head dim)."""
    kv = _kv(x)
    items = index if isinstance(index, tuple) else (index,)
    if kv is None:
        return NotImplemented
    if not all(i is None or i is Ellipsis or i == slice(None) for i in items):
        return _followed(torch._C.TensorBase.__getitem__, (x, index), {})
    heads, dim = kv
    probe = torch.empty([_MARK if d == dim else 1 for d in range(x.dim())], device="meta")[index]
    return _tag(x[index], heads[index], list(probe.shape).index(_MARK))


def expand(x: torch.Tensor, *sizes: Any) -> Any:
    """``expand`` of the repeats next to the head dim: each copy repeated for its share of the query heads."""
    kv = _kv(x)
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes
    if kv is None or kv[1] + 1 >= len(sizes) or x.shape[kv[1] + 1] != 1:
        return NotImplemented
    heads, dim = kv
    tp, repeats = heads.shape[dim], sizes[dim + 1]
    if repeats % tp:
        return NotImplemented
    wanted = [*sizes[:dim], tp, repeats // tp, *sizes[dim + 2:]]
    return _tag(x.expand(*sizes), heads.expand(*wanted), dim)


def reshape(x: torch.Tensor, *shape: Any) -> Any:
    """The head dim merged with its repeats: the query heads' keys, each device's from its own copy; a copied
    block's last dim viewed as its groups (``B.view(b, s, groups, n)``): the copies in place of the groups."""
    kv = _kv(x)
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    copied = _PART.of(x)
    if kv is None and copied is not None:
        (part, groups), out = copied, x.reshape(shape)
        if tuple(out.shape) == (*x.shape[:-1], groups, x.shape[-1] // groups):
            return _tag(out, part, x.dim() - 1)
        return out
    if kv is None:
        return NotImplemented
    heads, dim = kv
    out = x.reshape(shape)
    if out.dim() == x.dim() - 1 and out.shape[dim] == x.shape[dim] * x.shape[dim + 1]:
        return heads.reshape(out.shape)
    return _tag(out, heads, dim) if out.shape == x.shape else out


def cat(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    """A KV cache growing by copied keys/values (its first, empty tensor aside): the copies grow too."""
    items = [t for t in tensors if t.numel()]
    kvs = [_kv(t) for t in items]
    if not items or any(kv is None or kv[1] != kvs[0][1] for kv in kvs):
        return NotImplemented
    return _tag(torch.cat(items, dim, **kwargs), torch.cat([heads for heads, _ in kvs], dim), kvs[0][1])


def _followed(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` on the model's tensors, and on the copies in their place: the result carries the copies when
    they come out of it on one dim, in place of the model's size 1 there (element-wise ops, transposes, slices
    of other dims); otherwise they are dropped (the model's tensor is the copies' mean: correct, moves data)."""
    out = func(*args, **kwargs)
    kvs = [_kv(a) for a in args]
    swapped = tuple(a if kv is None else kv[0] for a, kv in zip(args, kvs))
    tp = next(kv[0].shape[kv[1]] for kv in kvs if kv is not None)
    try:
        heads = func(*swapped, **kwargs)
    except RuntimeError:
        return out
    if not isinstance(out, torch.Tensor) or not isinstance(heads, torch.Tensor) or heads.dim() != out.dim():
        return out
    dims = [d for d in range(out.dim()) if out.shape[d] != heads.shape[d]]
    if len(dims) != 1 or tp % out.shape[dims[0]] or heads.shape[dims[0]] != tp:
        return out
    return _tag(out, heads, dims[0])


def follow(func: Callable) -> Callable:
    """A handler of ``func`` for tensors carrying copies (``_followed``); NotImplemented for others."""
    def handler(*args: Any, **kwargs: Any) -> Any:
        if not any(_kv(a) is not None for a in args):
            return NotImplemented
        return _followed(func, args, kwargs)
    return handler


def repeat_interleave(x: torch.Tensor, repeats: Any = None, dim: Any = None, **kwargs: Any) -> Any:
    """Each group repeated for its heads (Mamba2's ``B.repeat_interleave(heads // groups, dim=2)``) from the
    copies of the groups (device ``d`` holding the group its heads read): each device's heads from its own copy,
    nothing moved."""
    kv = _kv(x)
    repeats, dim = kwargs.get("repeats", repeats), kwargs.get("dim", dim)
    if kv is None or not isinstance(repeats, int) or dim is None or dim % x.dim() != kv[1]:
        return NotImplemented
    heads, at = kv
    tp, groups = heads.shape[at], x.shape[at]
    if tp % groups or repeats * groups % tp:
        return NotImplemented
    return heads.repeat_interleave(repeats * groups // tp, dim=at)


class _SummedCopies(torch.autograd.Function):
    """The weight as it is; its gradient with each copied block's copies summed (``sum_copies``)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, packing: Any) -> torch.Tensor:
        ctx.packing = packing
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return sum_copies(grad, ctx.packing), None


def summed(weight: Any, packing: Any) -> Any:
    """``weight`` for a projection, its copies' gradients summed when ``packing`` copies blocks."""
    if not isinstance(weight, torch.Tensor) or packing is None or not packing.whole:
        return weight
    return _SummedCopies.apply(weight, packing)


def sum_copies(grad: torch.Tensor, packing: Any) -> torch.Tensor:
    """A re-laid weight's gradient with each copied block's copies replaced by their sum."""
    tp, dim = packing.tp, packing.dim
    g = per_device(grad.movedim(dim, -1), tp)
    parts, offset = [], 0
    for i, size in enumerate(packing.sizes):
        share = size // tp
        part = g[..., offset:offset + share]
        if i in packing.whole:  # each group's copies (device d's: group d // (tp // groups)) summed
            part = part.unflatten(-2, (packing.groups_of(i), -1))
            part = part.sum(-2, keepdim=True).expand_as(part).flatten(-3, -2)
        parts.append(part)
        offset += share
    return torch.cat(parts, -1).flatten(-2).movedim(-1, dim)


_FOLLOWED = (torch.Tensor.transpose, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__add__,
             torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__neg__, torch.Tensor.mul, torch.Tensor.add,
             torch.Tensor.neg, torch.mul, torch.add, torch.neg, torch.Tensor.contiguous, torch.Tensor.to,
             torch.Tensor.float, torch.Tensor.type_as)
HANDLERS = {torch._C.TensorBase.__getitem__: getitem, torch.Tensor.expand: expand, torch.Tensor.reshape: reshape,
            torch.Tensor.view: reshape, torch.cat: cat, torch.Tensor.repeat_interleave: repeat_interleave,
            torch.repeat_interleave: repeat_interleave, **{func: follow(func) for func in _FOLLOWED}}
