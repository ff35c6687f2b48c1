"""A re-laid packed output whose features are moved off the last dim, as channels: Mamba2's ``[x | B | C]``
transposed to ``[B, C, L]`` for a depthwise convolution, then transposed back and split; Mamba's (and LFM2's)
``in_proj`` output transposed first and chunked over its channels (``pieces``: each chunk read in place).

The features stay in their device-major layout (``packed``) through what treats each channel alone (the
convolution, whose kernel is re-laid the same way, an activation, a cast, a slice of the positions), so the
model's own split afterwards reads each block in place. ``follow`` runs one such op on a tagged tensor and
tags its output, with the dim the features are on when it is not the last (``laid_dim``); for anything
else it returns ``NotImplemented`` (the mode puts the original order back). A depthwise ``conv1d`` of channels
read in place runs as shifted products (``depthwise``), as a re-laid one does. Example::

    xbc = zxbcdt.split([128, 160, 8], -1)[1]     # tagged: [x_d | B | C] on each device
    y = F.conv1d(xbc.transpose(1, 2), w, b, groups=256).transpose(1, 2)   # tagged again, features last
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..dataflow.indexing import indexed_dims
from . import copies, packed, scope
from .entry import GETITEM
from .tags import Tag

_DIM = Tag("packed_dim")  # on a tagged tensor whose features are not on its last dim: that dim
_MOVES = {torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.swapaxes}
_CONVOLUTIONS = {F.conv1d, F.conv2d, F.conv3d}
_EACH_CHANNEL = {F.silu, torch.Tensor.to, torch.Tensor.float, torch.Tensor.contiguous, torch.sigmoid,
                 torch.Tensor.sigmoid, F.gelu, torch.Tensor.clone, torch.Tensor.detach}


def laid_dim(t: torch.Tensor) -> int:
    """The dim of a tagged ``t`` holding the re-laid features."""
    dim = _DIM.of(t)
    return t.dim() - 1 if dim is None else dim


def tagged(out: torch.Tensor, packing: packed.Packing, dim: int) -> torch.Tensor:
    """``out`` tagged as a re-laid output with its features on ``dim``."""
    packed.tag(out, packing)
    return _DIM.put(out, dim) if dim != out.dim() - 1 else out


def follows(func: Callable, t: torch.Tensor) -> bool:
    """Whether ``follow`` may take ``func`` on the tagged ``t``: a transpose, or anything while the features
    are off the last dim."""
    return func in _MOVES or laid_dim(t) != t.dim() - 1


def follow(func: Callable, args: tuple, kwargs: dict, t: torch.Tensor, packing: packed.Packing) -> Any:
    """``func`` on the tagged ``t`` (its first argument), its output tagged (see the module docstring)."""
    dim, rank = laid_dim(t), t.dim()
    if func is torch.Tensor.copy_ and len(args) > 1 and same_layout(args[1], t) and args[0].shape == t.shape:
        return tagged(args[0].copy_(args[1]), packing, dim)  # a cache's buffer holding these features: their layout
    if args[0] is not t:
        return NotImplemented
    if func in _MOVES:
        a, b = (args[i] if len(args) > i else kwargs[n] for i, n in ((1, "dim0"), (2, "dim1")))
        a, b = a % rank, b % rank
        return tagged(func(*args, **kwargs), packing, b if dim == a else a if dim == b else dim)
    if func in _CONVOLUTIONS:
        return _convolved(func, args, kwargs, t, packing, dim)
    if func is GETITEM:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(d == dim and i != slice(None) for i, d in zip(index, indexed_dims(index, rank))) \
                or any(i is None or isinstance(i, (int, torch.Tensor)) for i in index):
            return NotImplemented
    elif func not in _EACH_CHANNEL:
        return NotImplemented
    out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() != rank or out.shape[dim] != t.shape[dim]:
        return NotImplemented
    return tagged(out, packing, dim)


def pieces(t: torch.Tensor, packing: packed.Packing, ranges: list[tuple[int, int]]) -> Optional[list[torch.Tensor]]:
    """``packed.pieces`` of the tagged ``t`` along the dim its features are on: Mamba's ``in_proj(h).transpose(1, 2)``
    chunked into ``x`` and the gate over its channels, each read in place (a run of blocks tagged on that dim)."""
    dim = laid_dim(t)
    if dim == t.dim() - 1:
        return packed.pieces(t, packing, ranges)
    if packing.whole:  # copied blocks carry their copies on the last dim
        return None
    got = packed.pieces(t.movedim(dim, -1), packing, ranges)
    if got is None:
        return None
    return [p.movedim(-1, dim) if packed.tag_of(p) is None else tagged(p.movedim(-1, dim), packed.tag_of(p), dim)
            for p in got]


def same_layout(a: Any, t: torch.Tensor) -> bool:
    """Whether ``a`` holds re-laid features as the tagged ``t`` does (the same packing, on the same dim)."""
    return a is t or (packed.tag_of(a) == packed.tag_of(t) and laid_dim(a) == laid_dim(t))


def joined(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
    """``torch.cat`` of re-laid features along another dim: a convolution's cached positions and the new one
    (Mamba2's decoding step), every piece tagged with one packing on one dim; the output tagged the same.
    ``NotImplemented`` for any other concatenation."""
    if kwargs or not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(dim, int):
        return NotImplemented
    first = tensors[0]
    packing = packed.tag_of(first)
    if packing is None or not isinstance(first, torch.Tensor):
        return NotImplemented
    laid = laid_dim(first)
    if dim % first.dim() == laid or not all(same_layout(t, first) for t in tensors[1:]):
        return NotImplemented
    return tagged(torch.cat(tensors, dim), packing, laid)


def depthwise(input: Any, weight: Any, bias: Any = None, *args: Any, **kwargs: Any) -> Any:
    """A depthwise ``conv1d`` of channels read in place (Mamba's ``x`` chunked from its re-laid ``in_proj``) as
    ``shifted`` products: GSPMD would gather the batch split over the data axis for the kernel's gradient.
    ``NotImplemented`` for a tagged input (``follow``'s) and any other convolution."""
    if not isinstance(input, torch.Tensor) or packed.tag_of(input) is not None or input.dim() != 3 \
            or not scope.lowering():  # the plain computation (the audit's reference) runs the model's own
        return NotImplemented
    return shifted(input, weight, bias, *args, **kwargs)


HANDLERS = {torch.cat: joined, torch.concat: joined, torch.concatenate: joined, F.conv1d: depthwise}


def _convolved(func: Callable, args: tuple, kwargs: dict, t: torch.Tensor, packing: packed.Packing,
               dim: int) -> Any:
    """A depthwise convolution over the re-laid channels, with a kernel (and bias) re-laid the same way; the
    gradients of its copied channels' copies summed, as the one original channel would get them."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = dict(zip(names, args), **kwargs)
    weight, bias, size = bound["weight"], bound.get("bias"), t.shape[1]
    if dim != 1 or bound.get("groups", 1) != size or weight.shape[0] != size or weight.shape[1] != 1:
        return NotImplemented
    kernel = packing.for_bias()
    bound["weight"], bound["bias"] = copies.summed(weight, kernel), copies.summed(bias, kernel)
    out = shifted(**bound) if func is F.conv1d else NotImplemented
    return tagged(func(**bound) if out is NotImplemented else out, packing, 1)


def shifted(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride: Any = 1,
            padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Any:
    """A depthwise ``conv1d`` as the sum of its kernel's shifted products (GSPMD gathers a batch split over the
    data axis for a convolution's kernel gradient; products and sums reduce it as any weight's);
    ``NotImplemented`` for a stride, a padding by name or a channel multiplier.

    >>> x, w, b = torch.randn(2, 3, 7), torch.randn(3, 1, 4), torch.randn(3)
    >>> torch.allclose(shifted(x, w, b, padding=3, groups=3), F.conv1d(x, w, b, padding=3, groups=3), atol=1e-6)
    True
    """
    one = lambda v: v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v  # noqa: E731
    stride, padding, dilation = one(stride), one(padding), one(dilation)
    if stride != 1 or not isinstance(padding, int) or not isinstance(dilation, int) or weight.shape[1] != 1 \
            or groups != input.shape[1] or weight.shape[0] != groups:
        return NotImplemented
    k = weight.shape[-1]
    padded = F.pad(input, (padding, padding))
    length = padded.shape[-1] - dilation * (k - 1)
    out = sum(padded[..., i * dilation:i * dilation + length] * weight[:, 0, i, None] for i in range(k))
    return out if bias is None else out + bias[:, None]


__all__ = ["HANDLERS", "follow", "follows", "joined", "laid_dim", "pieces", "same_layout", "shifted", "tagged"]
