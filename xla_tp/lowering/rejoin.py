"""A tensor's pieces joined back as the tensor: ``torch.cat`` along dimension 0 of every piece ``x.unbind(0)``
(``list(x)``) or ``x.split(sizes)`` cut, in order, is ``x`` itself (reshaped for ``unbind``).

Multimodal models cut their image features per image and concatenate them again before putting them in place
(Llava's ``list(features)``, Qwen2-VL's ``torch.split(features, sizes)``), in their own forward, where no module
owns the calls. GSPMD concatenates along a dimension split over devices by moving the pieces between devices
(each piece of a batch split over data sits on one shard, and the concatenation is laid out again), where the
tensor they came from is already laid out as the concatenation is. Three ``compat`` effects: the pieces a
parallelized model cuts from an XLA tensor along dimension 0 are remembered (weakly, ``cut``), and a ``cat`` of
all of them, in order, is their tensor (``joined``). Example::

    pieces = list(features)          # [4, 16, 64] -> four [16, 64], remembered
    torch.cat(pieces, 0)             # features.reshape(64, 64): the same values, nothing moved
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import scope

_pieces = WeakIdKeyDictionary()  # piece -> (the tensor it was cut from, its index, how many pieces)


def _on_device(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type in ("xla", "jax")


def cut(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.unbind`` or ``Tensor.split`` (a ``compat`` effect): inside a parallelized model, the pieces of an
    XLA tensor cut along dimension 0 are remembered; the original's result either way."""
    @functools.wraps(original)
    def remembered(x: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(x, *args, **kwargs)
        if torch.compiler.is_compiling() or not (scope.inside() and _on_device(x)):
            return out
        dim = kwargs.get("dim", args[-1] if len(args) == (1 if original.__name__ == "unbind" else 2) else 0)
        if isinstance(dim, int) and dim % max(x.dim(), 1) == 0 and isinstance(out, (tuple, list)) and len(out) > 1:
            for i, piece in enumerate(out):
                _pieces[piece] = (x, i, len(out))
        return out
    return remembered


def whole(tensors: Sequence[Any], dim: Any = 0) -> Optional[torch.Tensor]:
    """The tensor ``tensors`` were cut from when they are all its pieces along dimension 0, in order, joined
    along ``dim`` 0 (a new tensor, reshaped to the concatenation's shape); else None.

    >>> x = torch.arange(6.).reshape(3, 2)
    >>> pieces = list(x)
    >>> _pieces.update({p: (x, i, 3) for i, p in enumerate(pieces)})
    >>> whole(pieces, 0).shape, whole(pieces[::-1], 0), whole(pieces[:2], 0)
    (torch.Size([6]), None, None)
    """
    if not isinstance(tensors, (tuple, list)) or not tensors or not isinstance(dim, int):
        return None
    first = _pieces.get(tensors[0]) if isinstance(tensors[0], torch.Tensor) else None
    if first is None or tensors[0].dim() == 0 or dim % tensors[0].dim() != 0 or len(tensors) != first[2]:
        return None
    base = first[0]
    for i, t in enumerate(tensors):
        seen = _pieces.get(t) if isinstance(t, torch.Tensor) else None
        if seen is None or seen[0] is not base or seen[1] != i:
            return None
    shape = (-1, *tensors[0].shape[1:])  # unbind's pieces lost dimension 0; split's kept it
    return base.reshape(shape).clone()


def joined(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.cat`` (a ``compat`` effect): inside a parallelized model, all the pieces of one XLA tensor, in
    order, along dimension 0, are that tensor (``whole``); anything else the original's."""
    @functools.wraps(original)
    def concatenated(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or not _pieces or not scope.inside() or set(kwargs) - {"dim"} or len(args) > 1:
            return original(tensors, *args, **kwargs)
        out = whole(tensors, kwargs.get("dim", args[0] if args else 0))
        return original(tensors, *args, **kwargs) if out is None else out
    return concatenated
