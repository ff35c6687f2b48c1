"""A vocabulary-parallel embedding whose weight gradient stays on each device's rows.

An ``nn.Embedding`` split on its rows over the model axis looks up as Megatron does under GSPMD
(each device its rows, one all-reduce). Its backward does not: GSPMD scatters the output gradient
into a full-size table on every device and all-reduces that table over the whole mesh (the
vocabulary times the hidden size, where Megatron reduces one device's rows over the data axis, and
over nothing without one). ``VocabEmbedding`` writes the weight gradient as a scatter batched over
the model axis: ``grad[t, id - t * rows] += dy`` for the ids in device ``t``'s rows, indexed by an
iota over ``t``, into a gradient laid out ``[t, rows, hidden]`` split on ``t`` like the weight's rows,
which the partitioner then keeps on device ``t``. ``install_embedding`` marks the table's weight
(its ``ParamState.vocab``); ``F.embedding`` (``entry``'s handler) looks a marked table up this way
inside a parallelized forward. Example::

    install_embedding(model.embed_tokens, tp=4, sharder=XlaSharder(mesh), spec=("model", None))
    h = model.embed_tokens(ids)     # same values; its weight gradient is reduced over the data axis only
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..state import ensure_param_state, param_state
from .context import split_sequence, splits_sequence

if TYPE_CHECKING:
    from ..backends.annotate import XlaSharder


@dataclass(frozen=True)
class VocabSplit:
    """The weight's rows split over ``tp`` devices: ``spec`` (rows on the model axis) on the sharder's mesh."""

    tp: int
    sharder: XlaSharder
    spec: tuple


class VocabEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` with the weight gradient scattered per device.

    With ``stack`` (the weight repeated over ``r`` batch replicas on ``replica_axes``, ``tied``): the
    gradient goes to ``stack`` as ``[r, vocab, hidden]``, each replica's rows from its own ids, not
    summed over the replicas (the stack's own backward sums it, with the tied LM head's share)."""

    @staticmethod
    def forward(ctx: Any, split: VocabSplit, padding_idx: Optional[int], ids: torch.Tensor,
                weight: torch.Tensor, stack: Optional[torch.Tensor] = None, replica_axes: Any = None) -> torch.Tensor:
        ctx.split, ctx.padding_idx, ctx.table = split, padding_idx, tuple(weight.shape)
        ctx.replicas, ctx.replica_axes = (1, None) if stack is None else (stack.shape[0], replica_axes)
        ctx.save_for_backward(ids)
        if splits_sequence(ids, ids=True):  # torch_xla's embedding flattens the ids, which
            return torch.ops.aten.index.Tensor(weight, [ids])  # a split sequence does not survive; a gather keeps them
        return torch.embedding(weight, ids, -1 if padding_idx is None else padding_idx)  # F.embedding is wrapped

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        (ids,) = ctx.saved_tensors
        if ctx.replicas > 1:
            grad = replica_rows(ctx.split, ctx.replica_axes, ctx.replicas, ids, dy, ctx.padding_idx, ctx.table)
            return None, None, None, None, grad if ctx.needs_input_grad[4] else None, None
        if not ctx.needs_input_grad[3]:
            return (None,) * 6
        split, (vocab, width) = ctx.split, ctx.table
        rows = vocab // split.tp
        device = torch.arange(split.tp, device=ids.device).view(split.tp, *[1] * ids.dim())  # an iota over t
        local = ids.unsqueeze(0) - device * rows                                            # [tp, *ids]
        keep = _kept(local, rows, ids, ctx.padding_idx, vocab)
        src = dy.unsqueeze(0) * keep.unsqueeze(-1).to(dy.dtype)
        grad = dy.new_zeros(split.tp, rows, width).index_put((device.expand_as(local), torch.where(keep, local, 0)),
                                                             src, accumulate=True)
        grad = split.sharder.annotate(grad, (split.spec[0], None, *split.spec[1:]))
        return None, None, None, grad.reshape(vocab, width), None, None


def _kept(local: torch.Tensor, rows: int, ids: torch.Tensor, padding_idx: Optional[int], vocab: int) -> torch.Tensor:
    """Which ids fall in a device's rows (``local``: their row there) and are not padding."""
    keep = (local >= 0) & (local < rows)
    return keep if padding_idx is None else keep & (ids != padding_idx % vocab)


def replica_rows(split: VocabSplit, axes: Any, replicas: int, ids: torch.Tensor, dy: torch.Tensor,
                 padding_idx: Optional[int], table: tuple[int, int]) -> torch.Tensor:
    """The weight gradient per batch replica, ``[replicas, vocab, hidden]``, unreduced: each device
    scatters its replica's ``dy`` into its own rows. Written as a manual region (each device's shard of
    ids and dy, and its place on the mesh): GSPMD partitions a scatter batched over two dimensions by
    gathering the updates over the first."""
    import torch_xla.distributed.spmd as xs  # a vocabulary table split on torch_xla: its runtime is loaded
    vocab, width = table
    tp, rows, mesh = split.tp, vocab // split.tp, split.sharder.mesh

    def shard(t: torch.Tensor, spec: tuple) -> torch.Tensor:
        return xs.enable_manual_sharding(t, spec, mesh=mesh).global_tensor

    place = torch.arange(tp, device=ids.device).expand(replicas, tp)                 # device (r, t) holds t
    t = shard(place, (axes, split.spec[0])).reshape(())
    ids = shard(ids, (axes, *[None] * (ids.dim() - 1)))
    dy = shard(dy, (axes, *[None] * (dy.dim() - 1)))
    local = ids - t * rows
    keep = _kept(local, rows, ids, padding_idx, vocab)
    grad = dy.new_zeros(rows, width).index_put((torch.where(keep, local, 0),), dy * keep.unsqueeze(-1).to(dy.dtype),
                                               accumulate=True)
    full = xs.disable_manual_sharding(grad.view(1, 1, rows, width), (axes, split.spec[0], None, None),
                                      (replicas, tp, rows, width), mesh=mesh).global_tensor
    return full.reshape(replicas, vocab, width)


def lookup(ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int] = None, max_norm: Any = None,
           norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Any:
    """``F.embedding`` of a vocabulary-split table (inside a parallelized forward); NotImplemented for
    anything else: a table ``install_embedding`` did not mark (a tensor swapped in for the call, the
    audit's unsharded program), ids not on an XLA device (the JAX backend differentiates the forward
    itself), max_norm, frequency scaling or sparse gradients."""
    ps = param_state(weight)
    split = ps.vocab if ps is not None else None
    if split is None or ids.device.type != "xla" or max_norm is not None or scale_grad_by_freq or sparse:
        return NotImplemented
    tie = ps.tie
    stack = tie.stack(weight, ids) if tie is not None else None
    if stack is not None:
        out = VocabEmbedding.apply(split, padding_idx, ids, weight, stack, tie.axes)
    else:
        out = VocabEmbedding.apply(split, padding_idx, ids, weight)
    return split_sequence(out) if ids.dim() >= 2 else out  # laid out from the ids, not from the split table


def lowerable(module: nn.Module, tp: int) -> bool:
    """An ``nn.Embedding`` (or a subclass, such as Gemma's scaled one, that looks up through
    ``F.embedding``) whose rows ``tp`` divides."""
    return isinstance(module, nn.Embedding) and module.num_embeddings % tp == 0


def install_embedding(module: nn.Embedding, tp: int, sharder: XlaSharder, spec: tuple) -> None:
    """Mark ``module``'s weight (laid out as ``spec``) as a vocabulary-split table."""
    ensure_param_state(module.weight).vocab = VocabSplit(tp, sharder, tuple(spec))


def uninstall_embeddings(model: nn.Module) -> None:
    """Unmark every table of ``model`` (and its tie)."""
    for p in model.parameters():
        ps = param_state(p)
        if ps is not None:
            ps.vocab = ps.tie = None
