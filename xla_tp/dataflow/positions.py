"""Every position of a 1-D mask, as host indices: the static form of ``hit.nonzero()`` in an MoE layer
that loops over the experts some token chose.

transformers' DBRX, SwitchTransformers, NLLB-MoE and LongCat-Flash loop
``for e in (mask.sum(...) > 0).nonzero():`` and pick expert ``e``'s tokens inside with
``torch.where(mask[e])``. How many experts were chosen is data. ``every_position(n)`` is
``[[0], [1], ..., [n - 1]]`` on the CPU instead: the loop runs over every expert (one nobody chose picks
no token and adds nothing), and iterating it or reading an index (``e[0]``, ``int(e)``,
``f"expert_{e[0]}"``) costs nothing on the device: each index is a constant of the program. A position
indexing a dimension shorter than the mask (DBRX one-hots E + 1 classes for E experts) reads the last
entry, as XLA clamps a gather; that position is never chosen, so it adds nothing either.

>>> hit = every_position(3)
>>> [int(e) for e in hit], f"expert_{hit[1][0]}"
([0, 1, 2], 'expert_1')
>>> torch.arange(10.0).view(2, 5)[hit[2][0]]      # position 2 of a dimension of 2: the last entry
tensor([5., 6., 7., 8., 9.])
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch._C import DisableTorchFunctionSubclass
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map

from .indexing import indexed_dims


class Positions(torch.Tensor):
    """Host indices from ``every_position``: what is computed from them alone stays ``Positions``;
    indexing another tensor with them indexes it with Python integers, clamped to its dimension; an op
    with the model's tensors (``ids == e``) takes them as integers, or on those tensors' device."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        others = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  and not isinstance(t, Positions)]
        if others:  # with the model's tensors
            if func is torch.Tensor.__getitem__ and not isinstance(args[0], Positions):
                args = (args[0], _as_python(args[1], tuple(args[0].shape)))
            else:
                args, kwargs = tree_map(lambda a: _on(a, others[0].device) if isinstance(a, Positions) else a,
                                        (args, kwargs))
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        with unset_fake_temporarily(), DisableTorchFunctionSubclass():  # real host values, also in a trace
            out = func(*args, **kwargs)
        if isinstance(out, Iterator):
            return iter([_wrap(t) for t in out])
        return tree_map(_wrap, out)

    def __format__(self, spec: str) -> str:  # f"expert_{e[0]}" names a module (torch formats plain tensors only)
        return format(int(self), spec) if self.dim() == 0 else super().__format__(spec)


def every_position(n: int) -> Positions:
    """``[[0], ..., [n - 1]]``: ``nonzero()`` of a 1-D mask of ``n`` entries, each one taken."""
    with unset_fake_temporarily():
        return torch.arange(n).unsqueeze(1).as_subclass(Positions)


def _on(positions: Positions, device: torch.device) -> Any:
    """``positions`` as a Python integer (one of them) or a plain tensor on ``device``."""
    with unset_fake_temporarily(), DisableTorchFunctionSubclass():
        return int(positions) if positions.dim() == 0 else positions.to(device)


def _wrap(t: Any) -> Any:
    return t.as_subclass(Positions) if type(t) is torch.Tensor else t


def _as_python(index: Any, shape: tuple[int, ...]) -> Any:
    """``index`` with each ``Positions`` entry as Python integers (nested lists for a tensor of them),
    clamped to the dimension it indexes."""
    items = index if isinstance(index, tuple) else (index,)
    out = [_clamped(i, shape[d] if 0 <= d < len(shape) else None) if isinstance(i, Positions) else i
           for i, d in zip(items, indexed_dims(items, len(shape)))]
    return tuple(out) if isinstance(index, tuple) else out[0]


def _clamped(positions: Positions, size: Optional[int]) -> Any:
    with unset_fake_temporarily(), DisableTorchFunctionSubclass():
        return (positions if size is None else positions.clamp(max=size - 1)).tolist()
