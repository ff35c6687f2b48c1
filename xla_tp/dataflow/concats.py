"""A concatenation of split features read channel by channel, then split back into its pieces.

Qwen3-Next's gated delta net takes q, k and v out of one projection (each split by key-head group),
concatenates them on the feature dim, runs a depthwise convolution over the concatenation's channels and
splits it back into q, k and v. Laid device-major (``lowering.concat``: device ``d`` holds ``[q_d | k_d |
v_d]``), every op between the concatenation and the split treats each channel alone (a transpose, the
convolution with its kernel re-laid the same way, an activation, a cast, a slice of the positions), so
nothing moves, and the split takes each piece where it is. ``channelwise`` says whether an op keeps the
layout; ``pieces`` which of the concatenation's pieces each output of a split is. Example (the three
pieces of ``cat([q, k, v], -1)`` taken back by ``split([32, 32, 64], -1)``):

>>> import torch
>>> from xla_tp.dataflow.trace import trace
>>> class CatSplit(torch.nn.Module):
...     def forward(self, q, k, v):
...         return torch.cat((q, k, v), -1).split([32, 32, 64], -1)
>>> graph = trace(CatSplit(), (torch.zeros(2, 5, 32), torch.zeros(2, 5, 32), torch.zeros(2, 5, 64)))
>>> cat, split = graph.nodes
>>> pieces(split, 2, cat)
[(0, 0), (1, 1), (2, 2)]
"""
from __future__ import annotations

from typing import Optional

from .graph import Node
from .ops import PERMUTES, POINTWISE, _norm_dim, _rank
from .partners import is_depthwise

_CASTS = frozenset({"to", "float", "half", "bfloat16", "contiguous", "clone", "detach"})


def offsets(cat: Node) -> list[tuple[int, int]]:
    """Each piece of ``cat``'s output: (offset, size) along the concatenated dim."""
    dim = _norm_dim(cat.arg(1, "dim", 0), _rank(cat.outputs[0]))
    out, start = [], 0
    for v in cat.arg(0, "tensors"):
        out.append((start, v.shape[dim]))
        start += v.shape[dim]
    return out


def channelwise(node: Node, pos: int, dim: int) -> bool:
    """Whether ``node`` treats each channel (dim ``dim``) of ``node.tensors[pos]`` alone, nothing else of its
    data read: a permutation, a cast, an index (the step checked that it leaves the channels whole), a
    depthwise convolution (its kernel is laid like the channels), an element-wise op whose other operands are
    the same for every channel (an activation, a scale per position)."""
    if node.op in PERMUTES or node.op in _CASTS or node.op == "getitem" and pos == 0:
        return True
    if node.op in POINTWISE:
        me = node.tensors[pos]
        at = lambda v: dim - (_rank(me) - _rank(v))  # noqa: E731  (the channels' dim in v, broadcast)
        return all(v is me or at(v) < 0 or v.shape[at(v)] == 1 for v in node.tensors)
    return is_depthwise(node) and pos == 0


def pieces(node: Node, dim: int, cat: Node) -> Optional[list[tuple[int, int]]]:
    """(output, piece of ``cat``) for each output of ``node``, a split or slice along ``dim`` (where the
    concatenated features are) that takes back exactly the pieces of ``cat``; None for any other op."""
    me = node.tensors[0] if node.tensors else None
    if me is None or me.shape[dim] != cat.outputs[0].shape[_norm_dim(cat.arg(1, "dim", 0), _rank(cat.outputs[0]))]:
        return None
    ranges = _ranges(node, dim, me.shape[dim])
    if ranges is None:
        return None
    where = {r: j for j, r in enumerate(offsets(cat))}
    found = [(i, where.get(r)) for i, r in enumerate(ranges)]
    return None if any(j is None for _, j in found) else found


def _ranges(node: Node, dim: int, size: int) -> Optional[list[tuple[int, int]]]:
    """(offset, size) of each output of a split or a slice of ``dim``; None for other ops or dims."""
    if node.op in ("split", "split_with_sizes"):
        if _norm_dim(node.arg(2, "dim", 0), _rank(node.tensors[0])) != dim:
            return None
        arg = node.arg(1, "split_size_or_sections", node.arg(1, "split_size"))
        sizes = list(arg) if isinstance(arg, (list, tuple)) else [arg] * (size // arg) + ([size % arg] if size % arg else [])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return list(zip(starts, sizes))
    if node.op == "getitem":
        index = node.arg(1, "idx")
        items = index if isinstance(index, tuple) else (index,)
        if any(i is None or i is Ellipsis for i in items) or len(items) <= dim:
            return None
        if any(i != slice(None) for d, i in enumerate(items) if d != dim) or not isinstance(items[dim], slice):
            return None
        start, stop, stride = items[dim].indices(size)
        return [(start, stop - start)] if stride == 1 else None
    return None


__all__ = ["channelwise", "offsets", "pieces"]
