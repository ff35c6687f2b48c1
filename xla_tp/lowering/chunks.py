"""Attention run one chunk at a time (``dataflow.chunks``), in a parallelized forward: chunks of equal length
as one batch of chunks. Qwen2-VL's vision tower attends within each image: it splits its queries, keys and
values ``[1, heads, patches, dim]`` into the images' chunks and loops over them. Its patches are split over
the data axis with the batch; a chunk of that dimension cannot stay split (GSPMD moves every chunk between
devices), a batch of chunks can: ``split`` into ``n`` equal chunks gives one chunk ``[n, heads, length, dim]``,
which the model's loop gives to its attention once and ``cat`` takes back, in the same order. Chunks of unequal
lengths (images of different sizes) that each block of the batch split holds whole are the blocks as one batch,
attended with a block-diagonal mask (``attention.chunks_mask``: a query reads the keys of its own chunk; more
scores computed, none moved); other chunks are split as they are. Likewise rows reordered by an index the host holds (``x[index]``: Qwen2.5-VL's
tower puts each image's patches in windows, its index made on the CPU) that moves no row out of its block of the
batch split: a gather within each block, which stays split (``x[index]`` itself gathers every row everywhere).
Example::

    install_chunks(model, graph)   # hooks around each module per_chunk_attention(graph) names
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..dataflow.chunks import per_chunk_attention, reordered_rows
from ..dataflow.graph import Graph
from ..weak import ByModule
from . import attention, scope
from .entry import GETITEM, batch_ways

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


def block_diagonal(sizes: Any, blocks: int) -> Optional[torch.Tensor]:
    """Which keys each query of a block attends to when chunks of ``sizes`` (two or more, not all equal) are
    taken ``blocks`` blocks at a time: a ``[blocks, 1, rows, rows]`` mask, True within a chunk, when every
    block of the batch split holds whole chunks (None otherwise).

    >>> block_diagonal([1, 1, 2], 2)[:, 0].int().tolist()
    [[[1, 0], [0, 1]], [[1, 1], [1, 1]]]
    >>> block_diagonal([1, 2, 3, 2], 2) is None
    True
    """
    if (blocks < 2 or not isinstance(sizes, (list, tuple)) or len(set(sizes)) < 2
            or not all(isinstance(n, int) and n > 0 for n in sizes) or sum(sizes) % blocks):
        return None
    rows = sum(sizes) // blocks
    chunk = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    ends = torch.tensor(sizes).cumsum(0)
    if not set(range(rows, rows * blocks + 1, rows)) <= set(ends.tolist()):
        return None
    chunk = chunk.view(blocks, rows)
    return (chunk[:, :, None] == chunk[:, None, :])[:, None]


def blocked(x: torch.Tensor, index: Any, blocks: int) -> Optional[torch.Tensor]:
    """``x[index]`` as a gather within each of ``blocks`` blocks of rows, when ``index`` is a 1-D integer tensor
    on the CPU (optionally followed by whole slices) that maps every block of rows into itself (None otherwise).

    >>> x = torch.arange(8.).view(4, 2)
    >>> torch.equal(blocked(x, torch.tensor([1, 0, 3, 2]), 2), x[torch.tensor([1, 0, 3, 2])])
    True
    >>> blocked(x, torch.tensor([2, 0, 3, 1]), 2) is None
    True
    """
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
    if (blocks < 2 or not isinstance(first, torch.Tensor) or first.device.type != "cpu" or first.dim() != 1
            or first.dtype in (torch.bool, *_FLOATS) or any(r != slice(None) for r in rest)
            or first.numel() != x.shape[0] or x.shape[0] % blocks):
        return None
    rows = x.shape[0] // blocks
    block = torch.arange(x.shape[0]) // rows
    if not torch.equal(first // rows, block):
        return None
    local = (first - block * rows).view(blocks, rows, *(1,) * (x.dim() - 1)).to(x.device)
    within = x.reshape(blocks, rows, *x.shape[1:])
    return torch.gather(within, 1, local.expand(within.shape)).reshape(x.shape)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Batched(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = scope.lowering() and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "xla"
        out = None
        if on_device and func in _SPLITS:
            out = batched(*args, **kwargs) or _masked_blocks(*args, **kwargs)
        elif on_device and func is GETITEM and len(args) == 2:
            out = blocked(args[0], args[1], batch_ways(args[0].shape[0]) if args[0].dim() else 1)
        return func(*args, **kwargs) if out is None else out


def _masked_blocks(x: torch.Tensor, sizes: Any, dim: int = 0) -> Optional[tuple[torch.Tensor]]:
    """``x.split(sizes, dim)`` of unequal chunks each block of the batch split holds whole: the blocks as
    one batch of chunks (``batched``), which the attention after takes with their block-diagonal mask."""
    mask = block_diagonal(sizes, batch_ways(x.shape[dim]))
    if mask is None:
        return None
    out = batched(x, [sum(sizes) // mask.shape[0]] * mask.shape[0], dim)
    if out is not None:
        attention.chunks_mask(mask)
    return out


_installed: ByModule[tuple[Any, ...]] = ByModule()


def install_chunks(root: nn.Module, graph: Graph) -> None:
    """The chunks of each module of ``root`` whose traced forward (``graph``) runs attention per chunk
    batched, and the rows it reorders by an index reordered within blocks, while it runs."""
    for fqn in per_chunk_attention(graph) | reordered_rows(graph):
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
        if attention.chunks_mask(None) is not None:
            raise RuntimeError(f"xla_tp: {type(module).__name__} batched its chunks of unequal lengths, but no "
                               f"attention took their block-diagonal mask")
    return module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)


def uninstall_chunks(root: nn.Module) -> None:
    for module in root.modules():
        for handle in _installed.pop(module) or ():
            handle.remove()
