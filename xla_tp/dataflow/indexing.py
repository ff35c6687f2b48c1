"""Indexing ops on split features: slices, ``x[...]``, ``split``/``chunk``, ``cat``/``stack``, ``pad``, ``gather``.

Registered with ``ops.step`` (``dataflow/__init__``). Slicing the leading factor selects a block of a
packed projection; slicing a minor one keeps the split; indexing with a tensor, along the split
dimension, or writing in place stops. Example (q, k, v taken out of a packed projection's 192 features):

>>> import torch
>>> from xla_tp.dataflow.trace import trace
>>> node = trace(_Split(), (torch.zeros(2, 5, 192),)).nodes[0]
>>> [(i, f.base, f.span) for i, f in step(node, 0, Features.whole(2, 192)).outputs]
[(0, Fraction(0, 1), Fraction(64, 1)), (1, Fraction(64, 1), Fraction(64, 1)), (2, Fraction(128, 1), Fraction(64, 1))]
"""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction  # noqa: F401  (the example's output)
from typing import Any, Optional, Union

import torch

from .graph import Node, Value
from .ops import Step, _drop_unit_factors, _norm_dim, _one, _rank, register, step  # noqa: F401  (step: the example)
from .shapes import Features, Stop

SLICES = frozenset({"split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split", "narrow", "unbind",
                    "select"})


class _Split(torch.nn.Module):
    def forward(self, x):
        return x.split(64, dim=-1)


def indexed_dims(index: tuple, ndim: int) -> list[int]:
    """The (first) dimension of an ``ndim``-D tensor each item of ``index`` indexes (-1: None); a
    boolean mask indexes as many as it has.

    >>> indexed_dims((None, Ellipsis, slice(None), 0), 4)
    [-1, 0, 2, 3]
    """
    widths = [0 if i is None or i is Ellipsis else i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool
              else 1 for i in index]
    dims, dim = [], 0
    for i, width in zip(index, widths):
        dims.append(-1 if i is None else dim)
        dim += ndim - sum(widths) if i is Ellipsis else width
    return dims


def _getitem(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return "indexes with a sharded tensor"
    index = node.arg(1, "idx")
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, Value) for i in index):
        return "indexes a sharded tensor with a tensor"
    shape = node.tensors[0].shape
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded += [slice(None)] * (len(shape) - n_real)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (len(shape) - sum(1 for i in expanded if i is not None))
    cur, dim_in, out_dim = feats, 0, 0
    mapping: dict[int, Optional[int]] = {}
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        size = shape[dim_in]
        if isinstance(i, int):
            j = i % size
            cur = cur.sliced(dim_in, j, j + 1, keep_dim=True)
            mapping[dim_in] = None
        else:
            picked = _picked(i, size)
            if picked is None:
                return "indexes the sharded dimension with a list"
            start, stop_, contiguous = picked
            if not contiguous and cur.factor_at(dim_in) is cur.lead:
                return "takes a strided or listed part of the sharded dimension"
            cur = cur.sliced(dim_in, start, stop_, keep_dim=True)
            mapping[dim_in] = out_dim
            out_dim += 1
        if isinstance(cur, str):
            return cur
        dim_in += 1
    keep = {f.dim for f in cur.factors if mapping.get(f.dim) is not None}
    moved = _drop_unit_factors(cur, keep).moved(mapping)
    return _one(node, moved)


def _picked(index: Any, size: int) -> Optional[tuple[int, int, bool]]:
    """(start, stop, contiguous) of what a slice or list index takes from a dim of ``size``; a strided
    slice or a non-contiguous list is reported with its extent (start, start + count) and False."""
    if isinstance(index, slice):
        start, stop, stride = index.indices(size)
        count = len(range(start, stop, stride))
        return start, start + count, stride == 1 or count <= 1
    if isinstance(index, list) and all(isinstance(j, int) for j in index) and index:
        picks = [j % size for j in index]
        contiguous = picks == list(range(picks[0], picks[0] + len(picks)))
        return picks[0], picks[0] + len(picks), contiguous
    return None


def _slices(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    rank = _rank(node.tensors[0])
    op = node.op
    dim_arg = {"split": (2, "dim"), "split_with_sizes": (2, "dim"), "unsafe_split": (2, "dim"),
               "chunk": (2, "dim"), "tensor_split": (2, "dim"), "narrow": (1, "dim"),
               "unbind": (1, "dim"), "select": (1, "dim")}[op]
    dim = _norm_dim(node.arg(*dim_arg, default=0), rank)
    outs = []
    if op in ("unbind", "select"):
        starts = [node.arg(2, "index")] if op == "select" else list(range(len(node.outputs)))
        for i, s in enumerate(starts):
            s = int(s) % node.tensors[0].shape[dim]
            f = feats.sliced(dim, s, s + 1, keep_dim=False)
            if isinstance(f, str):
                return f
            outs.append((i, f))
        return Step(outs)
    start = int(node.arg(2, "start")) % node.tensors[0].shape[dim] if op == "narrow" else 0
    for i, out in enumerate(node.outputs):
        length = out.shape[dim]
        f = feats.sliced(dim, start, start + length)
        if isinstance(f, str):
            return f
        outs.append((i, f))
        start += length
    return Step(outs)


def _cat(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    items = node.arg(0, "tensors")
    if not isinstance(items, (list, tuple)):
        return "concatenates an unknown sequence"
    out = node.outputs[0]
    rank = _rank(out)
    dim = _norm_dim(node.arg(1, "dim", 0), rank)
    if node.op == "stack":
        return _one(node, feats.moved({d: d + (d >= dim) for d in range(rank - 1)}))
    if dim == feats.lead.dim:
        return _piece(node, pos, feats, dim)
    f = feats.factor_at(dim)
    if f is not None and f.outer > 1:
        return "concatenates along a dimension where the batch is merged with the sharded features"
    if f is not None:  # a minor feature dim (rotary halves): the factor grows, the sharding is untouched
        feats = replace(feats, factors=tuple(replace(g, size=out.shape[dim]) if g is f else g for g in feats.factors))
    return _one(node, feats)


def _piece(node: Node, pos: int, feats: Features, dim: int) -> Union[Step, Stop]:
    """A split tensor concatenated with others along its split last dimension (Flux's ``cat([attention,
    mlp], -1)`` before ``proj_out``): the output holds it at ``(offset, size)``. Laid device-major at run time
    (each device's parts side by side, ``lowering.concat``), so only a row projection may read it, its
    input columns re-laid the same way (``Region.row_blocks``)."""
    items, me = node.arg(0, "tensors"), node.tensors[pos]
    if not all(isinstance(v, Value) for v in items) or dim != _rank(me) - 1 or feats.factor_at(dim) is not feats.lead or feats.lead.outer > 1 \
            or feats.lead.size != me.shape[dim] or sum(1 for v in items if v is me) != 1:
        return "concatenates along the sharded dimension"
    offset = 0
    for v in items:
        if v is me:
            break
        offset += v.shape[dim]
    return Step([(0, feats)], concat=(offset, me.shape[dim]))


def _pad(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return Step()
    pad = node.arg(1, "pad")
    rank = _rank(node.tensors[0])
    padded = [rank - 1 - i // 2 for i, p in enumerate(pad) if p]
    if feats.lead.dim in padded:
        return "pads the sharded dimension"
    return _one(node, feats)


def _gather(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    """``gather``/``take_along_dim`` along another dimension than the split one: the output is shaped
    like the index, the features stay on their dims (the index must match them there)."""
    if pos != 0:
        return "indexes with a sharded tensor"
    rank = _rank(node.tensors[0])
    dim, out = node.arg(1, "dim"), node.outputs[0]
    if dim is None or _norm_dim(dim, rank) in feats.dims():
        return f"'{node.op}' picks along the sharded dimension"
    if any(out.shape[f.dim] != node.tensors[0].shape[f.dim] for f in feats.factors):
        return f"'{node.op}' with an index that does not cover the sharded dimension"
    return _one(node, feats)


def _setitem(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    """``x[index] = y`` (a new version of ``x``) writing one entry of another dim at a time (an int in the
    index: the gated delta rule's ``out[:, :, i] = ...``, one chunk at a time, heads split): the features of
    ``x``, or of ``y`` on the dims of ``x`` it is written to, when the index takes the whole of every dim
    holding them. Other writes stop (Gemma 3n's ``predictions[1:] += first``: its residual stream, read whole)."""
    target, me = node.args[0], node.tensors[pos]
    index = node.arg(1, "idx")
    items = index if isinstance(index, tuple) else (index,)
    if not node.outputs or not isinstance(target, Value) or any(isinstance(i, Value) for i in items) \
            or sum(1 for i in items if i is Ellipsis) > 1 or not any(isinstance(i, int) for i in items):
        return "writes a sharded tensor in place"
    rank = _rank(target)
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    written, whole, dim = [], set(), 0  # written: the target dim of each dim of the slot (-1: a new one)
    for i in items:
        if i is Ellipsis:
            for _ in range(rank - n_real):
                written.append(dim)
                whole.add(dim)
                dim += 1
        elif i is None:
            written.append(-1)
        elif isinstance(i, int):
            dim += 1
        else:
            if i == slice(None):
                whole.add(dim)
            written.append(dim)
            dim += 1
    written += list(range(dim, rank))
    whole |= set(range(dim, rank))
    if me is target:
        mapping = {f.dim: f.dim for f in feats.factors}
    else:
        shift = len(written) - _rank(me)
        mapping = {f.dim: written[f.dim + shift] if f.dim + shift >= 0 else -1 for f in feats.factors}
    if any(d not in whole or target.shape[d] != me.shape[f] for f, d in mapping.items()):
        return "writes a sharded tensor in place, into part of its sharded dimension"
    return Step([(0, feats.moved(mapping))])


register({"getitem": _getitem, "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _cat, "pad": _pad,
          "setitem": _setitem, "gather": _gather, "take_along_dim": _gather, **{op: _slices for op in SLICES}})
