"""A concatenation of split features along their split (last) dimension, laid device-major.

Flux's single-stream block concatenates the attention output (heads split) and the MLP's (features split)
on the last dim, then ``proj_out`` contracts it. In their original order the pieces' parts would have to
move between devices; laid device-major (each piece viewed ``[..., tp, n / tp]``, concatenated on the last
dim, flattened) device ``d`` holds its part of every piece side by side, where it already is, and the row
projection reading it has its input columns re-laid the same way (``plan.packing``, ``dim=1``). The planner
names such concatenations by their pieces' sizes (``ModelState.concats``, only a row projection reads them:
``dataflow.indexing``); inside the modules that make them (sites of the lowering mode) ``torch.cat`` of XLA
tensors of those sizes is laid so. Example:

>>> a, b = torch.arange(4.), torch.arange(10., 16.)
>>> laid(a, b, tp=2).tolist()      # device 0: a0 a1 b0 b1 b2 | device 1: a2 a3 b3 b4 b5
[0.0, 1.0, 10.0, 11.0, 12.0, 2.0, 3.0, 13.0, 14.0, 15.0]
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from . import scope


def per_device(t: torch.Tensor, tp: int, dim: int = -1) -> torch.Tensor:
    """``t`` with its dimension ``dim`` viewed as ``[tp, size / tp]``, device ``d``'s block at index ``d``. A view
    with the shape spelled out: ``Tensor.unflatten`` is a Python wrapper, a host cost on every traced step.

    >>> per_device(torch.zeros(2, 12), 4).shape, per_device(torch.zeros(8, 3), 4, 0).shape
    (torch.Size([2, 4, 3]), torch.Size([4, 2, 3]))
    """
    dim %= t.dim()
    shape = t.shape
    return t.view(*shape[:dim], tp, shape[dim] // tp, *shape[dim + 1:])


def laid(*pieces: torch.Tensor, tp: int, dim: int = -1) -> torch.Tensor:
    """``pieces`` concatenated on ``dim`` (the last by default), device-major over ``tp`` devices."""
    dim %= pieces[0].dim()
    return torch.cat([per_device(p, tp, dim) for p in pieces], dim + 1).flatten(dim, dim + 1)


def cat(tensors: Sequence[Any], dim: int = 0, **kwargs: Any) -> Any:
    """``torch.cat`` of a concatenation the planner laid device-major; ``NotImplemented`` for any other."""
    state = scope.current()
    if kwargs or not scope.lowering() or state is None or not state.concats or not isinstance(tensors, (list, tuple)) or not tensors:
        return NotImplemented
    if not all(isinstance(t, torch.Tensor) and t.device.type in ("xla", "jax") for t in tensors):
        return NotImplemented
    rank = tensors[0].dim()
    tp = state.concats.get(tuple(t.shape[-1] for t in tensors))
    if tp is None or not isinstance(dim, int) or rank == 0 or dim % rank != rank - 1:
        return NotImplemented
    return laid(*tensors, tp=tp)


HANDLERS = {torch.cat: cat, torch.concat: cat, torch.concatenate: cat}
