"""A vocabulary-parallel table that the LM head reads too (tied embeddings), with one gradient reduction.

GPT-2, BERT and many small models use one weight for the input embedding and the LM head. With a
data axis, each use's weight gradient is a partial sum over the batch replicas. GSPMD reduces each
where it is made, and the two are added after: two all-reduces of one device's rows, where one
reduction of their sum is enough. A ``Tie`` makes both uses read one ``stack``: the weight repeated
over the ``r`` batch replicas, ``[r, vocab, hidden]``, split over the batch axes on its first
dimension. The head contracts each replica's tokens with its own copy, and the embedding's gradient
is scattered per replica (``embedding.VocabEmbedding``). Neither gradient contracts over the replicas,
so neither is reduced. Autograd adds the two before the stack's backward sums over ``r``: one
reduction. The stack is made once per outermost forward. The head's ``F.linear`` on the table's
weight reads it (``entry``'s ``F.linear`` handler). Example::

    install_tie(model.wte, axes=("data",), replicas=2)
    loss = F.cross_entropy(model.lm_head(model.wte(ids)).flatten(0, 1), labels.flatten())
    loss.backward()   # wte.weight.grad: one all-reduce over the data axis
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..state import ensure_param_state, param_state
from . import scope
from .blocks import per_device


class Tie:
    """A vocabulary-split weight read by an embedding and LM heads; its stack over ``replicas`` batch
    replicas (``axes``), made at most once per outermost forward."""

    def __init__(self, axes: Any, replicas: int):
        self.axes, self.replicas = axes, replicas
        self._weight: Optional[torch.Tensor] = None
        self._stack: Optional[torch.Tensor] = None

    def stack(self, weight: torch.Tensor, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``weight`` repeated over the replicas, for an input ``x`` whose batch (dim 0) splits over them.
        None (read the weight itself) when it does not, when no gradient is taken, and under
        ``torch.compile`` (the embedding's gradient is a manual region there, which dynamo does not trace)."""
        if (x.dim() < 2 or x.shape[0] % self.replicas or not (torch.is_grad_enabled() and weight.requires_grad)
                or torch.compiler.is_compiling()):
            return None
        if self._weight is weight and self._stack is not None:
            return self._stack
        split = param_state(weight).vocab
        stack = split.sharder.annotate(weight.unsqueeze(0).expand(self.replicas, *weight.shape), (self.axes, *split.spec))
        if scope.depth() > 0:  # not in a backward's recomputation: nothing would clear it
            self._weight, self._stack = weight, stack
            scope.on_exit(self.clear)
        return stack

    def clear(self) -> None:
        """Forget this forward's stack."""
        self._weight, self._stack = None, None


def head(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The LM head ``F.linear(x, weight, bias)`` of a tied table, read from its stack; None to compute
    it plainly (no tie, or ``Tie.stack`` declines)."""
    tie: Optional[Tie] = getattr(param_state(weight), "tie", None)
    stack = tie.stack(weight, x) if tie is not None and x.device.type == "xla" else None
    if stack is None:
        return None
    y = torch.einsum("r...h,rvh->r...v", per_device(x, tie.replicas, 0), stack).flatten(0, 1)
    return y if bias is None else y + bias


def install_tie(table: nn.Embedding, axes: Any, replicas: int) -> Tie:
    """Make ``table`` (vocabulary-split, ``install_embedding``) and the heads reading its weight read one
    stack over ``replicas`` batch replicas on the mesh ``axes``."""
    tie = Tie(axes, replicas)
    ensure_param_state(table.weight).tie = tie
    return tie


def tied_heads(model: nn.Module, table: nn.Embedding) -> list[nn.Linear]:
    """The ``nn.Linear``s of ``model`` whose weight is ``table``'s."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight is table.weight]
