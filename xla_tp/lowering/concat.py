"""A concatenation of split features along their split (last) dimension, laid device-major.

Flux's single-stream block concatenates the attention output (heads split) and the MLP's (features split)
on the last dim, then ``proj_out`` contracts it. In their original order the pieces' parts would have to
move between devices; laid device-major (each piece viewed ``[..., tp, n / tp]``, concatenated on the last
dim, flattened) device ``d`` holds its part of every piece side by side, where it already is, and the row
projection reading it has its input columns re-laid the same way (``plan.packing``, ``dim=1``). One read
channel by channel and split back into its pieces (Qwen3-Next's ``cat([q, k, v])`` before its convolution:
``dataflow.concats``) is tagged as a re-laid output (``packed.tag``), which the convolution (``channels``) and the
split (``packed.pieces``) read in place. The planner names such concatenations by their pieces' sizes (``ModelState.concats``, only a row projection reads them:
``dataflow.indexing``); inside the modules that make them (sites of the lowering mode) ``torch.cat`` of XLA
tensors of those sizes is laid so. Example:

>>> a, b = torch.arange(4.), torch.arange(10., 16.)
>>> laid(a, b, tp=2).tolist()      # device 0: a0 a1 b0 b1 b2 | device 1: a2 a3 b3 b4 b5
[0.0, 1.0, 10.0, 11.0, 12.0, 2.0, 3.0, 13.0, 14.0, 15.0]
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..plan.packing import Packing
from . import packed, scope
from .blocks import laid


def cat(tensors: Sequence[Any], dim: int = 0, **kwargs: Any) -> Any:
    """``torch.cat`` of a concatenation the planner laid device-major; ``NotImplemented`` for any other."""
    state = scope.current()
    if kwargs or not scope.lowering() or state is None or not state.concats or not isinstance(tensors, (list, tuple)) or not tensors:
        return NotImplemented
    if not all(isinstance(t, torch.Tensor) and t.device.type in ("xla", "jax") for t in tensors):
        return NotImplemented
    rank = tensors[0].dim()
    sizes = tuple(t.shape[-1] for t in tensors)
    tp = state.concats.get(sizes)
    if tp is None or not isinstance(dim, int) or rank == 0 or dim % rank != rank - 1:
        return NotImplemented
    out = laid(*tensors, tp=tp)
    if sizes not in state.tagged_concats:
        return out
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return packed.tag(out, Packing(0, tuple(zip(starts, sizes)), tp))


HANDLERS = {torch.cat: cat, torch.concat: cat, torch.concatenate: cat}
