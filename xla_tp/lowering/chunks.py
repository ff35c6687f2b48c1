"""Attention run one chunk at a time (``dataflow.chunks``), in a parallelized forward: chunks of equal length
as one batch of chunks. Qwen2-VL's vision tower attends within each image: it splits its queries, keys and
values ``[1, heads, patches, dim]`` into the images' chunks and loops over them. Its patches are split over
the data axis with the batch; a chunk of that dimension cannot stay split (GSPMD moves every chunk between
devices), a batch of chunks can: ``split`` into ``n`` equal chunks gives one chunk ``[n, heads, length, dim]``,
which the model's loop gives to its attention once and ``cat`` takes back, in the same order. Chunks of other
lengths are split as they are. Example::

    install_chunks(model, graph)   # hooks around each module per_chunk_attention(graph) names
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..dataflow.chunks import per_chunk_attention
from ..dataflow.graph import Graph
from ..weak import ByModule
from . import scope

_SPLITS = (torch.split, torch.Tensor.split, torch.Tensor.split_with_sizes)


def batched(x: Any, sizes: Any, dim: int = 0) -> Optional[tuple[torch.Tensor]]:
    """``x.split(sizes, dim)`` as one batch of its chunks, when ``x`` has a batch of one and ``sizes`` are two
    or more equal lengths (None otherwise).

    >>> x = torch.arange(12.).view(1, 1, 6, 2)
    >>> batched(x, [3, 3], dim=2)[0].shape, batched(x, [2, 4], dim=2)
    (torch.Size([2, 1, 3, 2]), None)
    """
    if not isinstance(x, torch.Tensor) or not isinstance(sizes, (list, tuple)) or len(sizes) < 2:
        return None
    dim = dim % x.dim() if x.dim() else 0
    if dim == 0 or x.shape[0] != 1 or len(set(sizes)) != 1 or sum(sizes) != x.shape[dim]:
        return None
    return (x.unflatten(dim, (len(sizes), sizes[0])).movedim(dim, 0).squeeze(1),)


class _Batched(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SPLITS and scope.lowering() and args and args[0].device.type in ("xla", "jax"):
            out = batched(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


_installed: ByModule[tuple[Any, ...]] = ByModule()


def install_chunks(root: nn.Module, graph: Graph) -> None:
    """The chunks of each module of ``root`` whose traced forward (``graph``) runs attention per chunk
    batched while it runs."""
    for fqn in per_chunk_attention(graph):
        module = root.get_submodule(fqn)
        _installed[module] = _hooks(module)


def _hooks(module: nn.Module) -> tuple[Any, Any]:
    """Hooks entering ``_Batched`` around ``module``'s forward (left even when it raises); their handles."""
    modes: list[_Batched] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        modes.append(_Batched())
        modes[-1].__enter__()

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        if modes:
            modes.pop().__exit__(None, None, None)
    return module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)


def uninstall_chunks(root: nn.Module) -> None:
    for module in root.modules():
        for handle in _installed.pop(module) or ():
            handle.remove()
