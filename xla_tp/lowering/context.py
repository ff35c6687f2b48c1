"""Context parallelism inside a parallelized forward (or a ``context_parallel`` block, ``ambient``): the
sequence split over the mesh's context axis.

The model's inputs enter with their sequence split over the context axis (``constraints``), and the
compiler keeps position-wise work (norms, activations) on each device's part of the sequence. Three
places need a word: attention, where each device's queries must meet every key and value
(``context_split``: keys and values gathered over the axis, their gradients reduce-scattered back);
projections, which XLA lowers through a reshape that merges batch and sequence (``linear``: an einsum
keeps them); and an embedding lookup, whose ids XLA flattens the same way and whose output the compiler
would lay out from the table (``split_sequence``). Elsewhere (no context axis, a sequence the axis does not
divide, one decoded token) each returns its inputs. Example (inside a parallelized forward on ``make_mesh(context=4, model=2)``)::

    q, k, v, mask = context_split(q, k, v, mask)   # q, mask rows: s/4 per device; k, v: all s on every device
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from ..axes import sequence_axes, spec_entry
from ..batch import batch_split, ways
from . import scope

class _Slot(threading.local):
    """A per-thread value, present from the start (dynamo guards on an attribute's presence)."""

    def __init__(self) -> None:
        self.value: Any = None


_gathers = _Slot()  # the audit's recorder of key/value gathers
_split = _Slot()    # True inside an attention function whose inputs were split at its entry (``split_attention``)
_ambient = _Slot()  # a context_parallel block's (sharder, batch axes, tensor-parallel axis)


def _context(x: torch.Tensor, seq_dim: int) -> Optional[tuple[Any, tuple[str, ...], tuple[str, ...], str]]:
    """(sharder, batch axes, sequence axes, tensor-parallel axis) when ``x``'s dimension ``seq_dim`` is split
    over a context axis: in the parallelized forward running now, or else in a ``context_parallel`` block
    (``ambient``); None otherwise."""
    state = scope.current()
    if state is not None and getattr(state, "sharder", None) is not None:
        sharder, batch_axes, tp = state.sharder, state.layout.batch_axes, state.layout.tp_axis
    else:
        found = _ambient.value
        if found is None:
            return None
        sharder, batch_axes, tp = found
    if x.dim() <= seq_dim or not sharder.applies(x):
        return None
    seq = sequence_axes(sharder.sizes, x.shape[seq_dim])
    if not seq:
        return None
    return sharder, batch_split(x.shape[0], batch_axes, sharder.sizes), seq, tp


@contextlib.contextmanager
def ambient(sharder: Any, batch_axes: tuple[str, ...], tp_axis: str) -> Iterator[None]:
    """Context parallelism for code outside a parallelized model during the block (``context_parallel``):
    ``sharder``'s mesh, the batch split over ``batch_axes``, heads over ``tp_axis`` where they divide it."""
    previous = _ambient.value
    _ambient.value = (sharder, batch_axes, tp_axis)
    try:
        yield
    finally:
        _ambient.value = previous


def splits_sequence(x: torch.Tensor, ids: bool = False) -> bool:
    """Whether ``x`` (``[batch, sequence, features...]`` activations, or with ``ids`` ``[batch, sequence]``
    token ids) has its sequence split over a context axis here: then a projection of it keeps its leading
    dimensions (``linear``), a lookup its ids' (``embedding``)."""
    return x.dim() >= (2 if ids else 3) and _context(x, 1) is not None


def splits_queries(query: torch.Tensor) -> bool:
    """Whether attention on ``query`` (``[batch, heads, sequence, dim]``) splits its sequence over a context
    axis here (``context_split``)."""
    return query.dim() == 4 and _context(query, 2) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` as an einsum: XLA lowers ``F.linear`` of a ``[batch, sequence, in]`` input through a
    reshape to ``[batch * sequence, in]``, which a sequence split over the context axis does not survive
    (unless the batch per device is 1): the compiler gathers the sequence. The einsum keeps both dimensions."""
    y = torch.einsum("...i,oi->...o", x, weight)
    return y if bias is None else y + bias


def split_sequence(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[batch, sequence, ...]``) laid out with its batch over the batch axes and its sequence over
    the context axis, the rest whole (its gradient too)."""
    found = _context(x, 1)
    if found is None:
        return x
    sharder, batch, seq, _ = found
    return sharder.constrain(x, (spec_entry(batch), spec_entry(seq), *[None] * (x.dim() - 2)))


def _heads(t: torch.Tensor, tp: str, sizes: dict) -> Optional[str]:
    """The tensor-parallel axis for ``t``'s heads (dimension 1) where it divides them."""
    return tp if sizes.get(tp, 1) > 1 and t.shape[1] % sizes[tp] == 0 else None


def query_layout(query: torch.Tensor, key: torch.Tensor) -> Optional[tuple[Any, tuple[str, ...], tuple[str, ...],
                                                                        Optional[str], Optional[str]]]:
    """(sharder, batch axes, sequence axes, the query heads' axis, the key heads' axis) of attention on ``query``
    ``[batch, heads, sequence, dim]`` split over a context axis here, as ``context_split`` lays it out (a heads'
    axis is None where it does not divide them); None where it leaves them."""
    found = _context(query, 2) if query.dim() == 4 else None
    if found is None:
        return None
    sharder, batch, seq, tp = found
    return sharder, batch, seq, _heads(query, tp, sharder.sizes), _heads(key, tp, sharder.sizes)


def context_split(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """On a mesh with a context axis (context parallelism), each device's block of queries (the sequence
    split over the axis) against every key and value: keys and values gathered over the axis (their
    gradients reduce-scattered back), heads split over the tensor-parallel axis where they divide it.
    Each device's score block is ``[queries / context, keys]``; a ``[batch, heads or 1, queries, keys]``
    mask's rows are split as the queries (else GSPMD lays it out against them with all-to-alls). Returns
    ``(query, key, value, mask)``, unchanged elsewhere (no context axis, a query length it does not
    divide, e.g. one decoded token)."""
    found = _context(query, 2) if query.dim() == 4 else None
    if found is None:
        return query, key, value, mask
    sharder, batch, seq, tp = found
    sizes = sharder.sizes

    heads = functools.partial(_heads, tp=tp, sizes=sizes)
    split_before = bool(sequence_axes(sizes, key.shape[2]))  # keys as long as the queries: split before
    whole = [sharder.constrain(t, (spec_entry(batch), heads(t), None, None)) for t in (key, value)]
    record = _gathers.value
    if record is not None and split_before and not _split.value:
        split = ways(batch, sizes) * ways((tp,) if heads(key) else (), sizes)
        for t in (key, value):
            record(t.numel() // split, ways(seq, sizes), t.dtype, t.requires_grad)
    query = sharder.constrain(query, (spec_entry(batch), heads(query), spec_entry(seq), None))
    if mask is not None and mask.dim() == 4 and mask.shape[2] == query.shape[2] and sharder.applies(mask):
        rows = spec_entry(batch) if mask.shape[0] == query.shape[0] else None
        mask = sharder.constrain(mask, (rows, heads(mask) if mask.shape[1] > 1 else None, spec_entry(seq), None))
    return query, whole[0], whole[1], mask


@contextlib.contextmanager
def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: Optional[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
    """``context_split`` at the entry of a model's own attention function (transformers' eager attention:
    ``repeat_kv`` and two matmuls, which no ``context_split`` inside sees), before it touches its inputs.
    Yields ``(query, key, value, mask)``; a ``context_split`` inside the block does not count the gathers
    again."""
    split = context_split(query, key, value, mask)
    previous = _split.value
    _split.value = split[1] is not key
    try:
        yield split
    finally:
        _split.value = previous


@contextlib.contextmanager
def recording_gathers(record: Callable[[int, int, torch.dtype, bool], None]) -> Iterator[None]:
    """Call ``record(elements per device, context ways, dtype, requires_grad)`` for each key and value
    ``context_split`` gathers over the context axis in this thread during the block (the audit's minimum)."""
    previous = _gathers.value
    _gathers.value = record
    try:
        yield
    finally:
        _gathers.value = previous
