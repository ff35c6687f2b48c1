"""Attention run one chunk of a sequence at a time: the modules whose forward splits its queries, keys and
values along one dimension, gives the ``i``-th chunk of each to the ``i``-th attention call, and concatenates
the calls' outputs in order (Qwen2-VL's vision tower: one image at a time, its chunks ``cu_seqlens``' lengths,
read on the host). Chunks of equal length are then a batch of chunks (``lowering.chunks``). And the modules that
reorder an activation's rows by an index (``x[index]``: Qwen2.5-VL's tower puts each image's patches in windows),
which keeps them split when the index moves no row out of its block (``lowering.chunks``). Example::

    per_chunk_attention(graph)    # {'model.visual.blocks.0.attn', 'model.visual.blocks.1.attn'}
    reordered_rows(graph)         # {'model.visual'}
"""
from __future__ import annotations

from typing import Optional

import torch

from .graph import Graph, Node, Value

SPLITS = ("split", "split_with_sizes")
ATTENTION = "scaled_dot_product_attention"
_LAYOUT = frozenset({"reshape", "view", "transpose", "permute", "contiguous"})  # moves a chunk's values, no more


def per_chunk_attention(graph: Graph) -> set[str]:
    """The modules of ``graph`` whose attention runs one chunk at a time (see the module docstring)."""
    by_module: dict[str, list[Node]] = {}
    for node in graph.nodes:
        if node.op in SPLITS and len(node.outputs) > 1:
            by_module.setdefault(node.module, []).append(node)
    return {fqn for fqn, splits in by_module.items() if _chunked(splits)}


def _chunked(splits: list[Node]) -> bool:
    """Whether chunk ``i`` of every split meets the ``i``-th of one attention call each, whose outputs one
    ``cat`` takes in order."""
    calls = [_only_consumer(splits[0].outputs[i]) for i in range(len(splits[0].outputs))]
    if any(c is None or c.op != ATTENTION for c in calls) or len(set(map(id, calls))) != len(calls):
        return False
    if any(len(s.outputs) != len(calls) or any(_only_consumer(v) is not c for v, c in zip(s.outputs, calls))
           for s in splits):
        return False
    ends = [_through_layout(c) for c in calls]
    cat = ends[0][0] if ends[0] else None
    return cat is not None and cat.op == "cat" and all(e is not None and e == (cat, i) for i, e in enumerate(ends))


def _only_consumer(value) -> Optional[Node]:
    return value.consumers[0][0] if len(value.consumers) == 1 else None


def _through_layout(node: Node) -> Optional[tuple[Node, int]]:
    """``(node, position)`` the output of ``node`` reaches through ops that only move its values."""
    while len(node.outputs) == 1 and len(node.outputs[0].consumers) == 1:
        node, pos = node.outputs[0].consumers[0]
        if node.op not in _LAYOUT:
            return node, pos
    return None


def reordered_rows(graph: Graph) -> set[str]:
    """The modules of ``graph`` whose own forward reorders an activation's rows by a 1-D integer index
    (``x[index]``, ``x[index, :, :]``)."""
    return {n.module for n in graph.nodes if n.op == "getitem" and len(n.tensors) == 2 and n.tensors[0].kind == "act"
            and _rows_index(n.args[1] if len(n.args) > 1 else None)}


def _rows_index(index) -> bool:
    first = index[0] if isinstance(index, tuple) and index else index
    rest = index[1:] if isinstance(index, tuple) else ()
    return (isinstance(first, Value) and len(first.shape) == 1 and not first.dtype.is_floating_point
            and first.dtype is not torch.bool and all(r == slice(None) for r in rest))
