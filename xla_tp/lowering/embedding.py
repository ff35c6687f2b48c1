"""A vocabulary-parallel embedding whose weight gradient stays on each device's rows.

An ``nn.Embedding`` split on its rows over the model axis looks up as Megatron does under GSPMD
(each device its rows, one all-reduce). Its backward does not: GSPMD scatters the output gradient
into a full-size table on every device and all-reduces that table over the whole mesh (the
vocabulary times the hidden size, where Megatron reduces one device's rows over the data axis, and
over nothing without one). ``VocabEmbedding`` writes the weight gradient as a scatter batched over
the model axis: ``grad[t, id - t * rows] += dy`` for the ids in device ``t``'s rows, indexed by an
iota over ``t``, into a gradient laid out ``[t, rows, hidden]`` split on ``t`` like the weight's rows,
which the partitioner then keeps on device ``t``. Example::

    install_embedding(model.embed_tokens, tp=4, mesh=mesh, spec=("model", None))
    h = model.embed_tokens(ids)     # same values; its weight gradient is reduced over the data axis only
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch_xla.distributed.spmd as xs
import torch.nn.functional as F
from torch import nn

from .. import dynamo
from ..guard import SHARDING_ATTR
from .swap import restore, swap

ATTR = "_xla_tp_vocab"  # on a swapped nn.Embedding: its VocabSplit


@dataclass(frozen=True)
class VocabSplit:
    """The weight's rows split over ``tp`` devices: ``spec`` (rows on the model axis) on ``mesh``."""

    tp: int
    mesh: xs.Mesh
    spec: tuple


class VocabEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` with the weight gradient scattered per device."""

    @staticmethod
    def forward(ctx: Any, split: VocabSplit, padding_idx: Optional[int], ids: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        ctx.split, ctx.padding_idx, ctx.table = split, padding_idx, tuple(weight.shape)
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        if not ctx.needs_input_grad[3]:
            return None, None, None, None
        from ..constraints import annotated_copy
        (ids,) = ctx.saved_tensors
        split, (vocab, width) = ctx.split, ctx.table
        rows = vocab // split.tp
        device = torch.arange(split.tp, device=ids.device).view(split.tp, *[1] * ids.dim())  # an iota over t
        local = ids.unsqueeze(0) - device * rows                                            # [tp, *ids]
        keep = (local >= 0) & (local < rows)
        if ctx.padding_idx is not None:
            keep = keep & (ids != ctx.padding_idx % vocab)
        local = torch.where(keep, local, 0)
        src = dy.unsqueeze(0) * keep.unsqueeze(-1).to(dy.dtype)
        grad = dy.new_zeros(split.tp, rows, width).index_put((device.expand_as(local), local), src, accumulate=True)
        grad = annotated_copy(grad, split.mesh, (split.spec[0], None, *split.spec[1:]))
        return None, None, None, grad.reshape(vocab, width)


def _vocab_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    # the JAX backend differentiates the forward itself; a weight swapped in for the call (the audit's
    # unsharded program, functional_call) is not the sharded table
    if ids.device.type != "xla" or getattr(self.weight, SHARDING_ATTR, None) is None:
        return F.embedding(ids, self.weight, self.padding_idx)
    return VocabEmbedding.apply(getattr(self, ATTR), self.padding_idx, ids, self.weight)


def lowerable(module: nn.Module, tp: int) -> bool:
    """A plain ``nn.Embedding`` (no max_norm, frequency scaling or sparse gradient) whose rows ``tp``
    divides."""
    return (isinstance(module, nn.Embedding) and module.num_embeddings % tp == 0 and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def install_embedding(module: nn.Embedding, tp: int, mesh: xs.Mesh, spec: tuple) -> None:
    """Swap ``module``'s forward for the vocabulary-parallel one (its weight laid out as ``spec``)."""
    dynamo.name(mesh)  # for torch.compile
    swap(module, ATTR, VocabSplit(tp, mesh, tuple(spec)), _vocab_forward)


def uninstall_embeddings(model: nn.Module) -> None:
    """Give every swapped embedding of ``model`` its own forward back."""
    restore(model, ATTR)
