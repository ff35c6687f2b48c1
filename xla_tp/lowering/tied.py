"""A vocabulary-parallel table that the LM head reads too (tied embeddings), with one gradient reduction.

GPT-2, BERT and many small models use one weight for the input embedding and the LM head. With a
data axis, each use's weight gradient is a partial sum over the batch replicas. GSPMD reduces each
where it is made, and the two are added after: two all-reduces of one device's rows, where one
reduction of their sum is enough. A ``Tie`` makes both uses read one ``stack``: the weight repeated
over the ``r`` batch replicas, ``[r, vocab, hidden]``, split over the batch axes on its first
dimension. The head contracts each replica's tokens with its own copy, and the embedding's gradient
is scattered per replica (``embedding.VocabEmbedding``). Neither gradient contracts over the replicas,
so neither is reduced. Autograd adds the two before the stack's backward sums over ``r``: one
reduction. The stack is made once per outermost forward. Example::

    install_tie(model.wte, [model.lm_head], axes=("data",), replicas=2)
    loss = F.cross_entropy(model.lm_head(model.wte(ids)).flatten(0, 1), labels.flatten())
    loss.backward()   # wte.weight.grad: one all-reduce over the data axis
"""
from __future__ import annotations

import types
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import scope
from .embedding import ATTR, TIE


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
        from ..constraints import annotated_copy  # constraints imports this package
        split = getattr(weight, ATTR)
        stack = annotated_copy(weight.unsqueeze(0).expand(self.replicas, *weight.shape), split.mesh,
                               (self.axes, *split.spec))
        if scope.depth() > 0:  # not in a backward's recomputation: nothing would clear it
            self._weight, self._stack = weight, stack
            scope.on_exit(self.clear)
        return stack

    def clear(self) -> None:
        """Forget this forward's stack."""
        self._weight, self._stack = None, None


def _tied_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    tie: Optional[Tie] = getattr(self.weight, TIE, None)
    stack = tie.stack(self.weight, x) if tie is not None and x.device.type == "xla" else None
    if stack is None:
        return F.linear(x, self.weight, self.bias)
    y = torch.einsum("r...h,rvh->r...v", x.unflatten(0, (tie.replicas, -1)), stack).flatten(0, 1)
    return y if self.bias is None else y + self.bias


def install_tie(table: nn.Embedding, heads: Sequence[nn.Linear], axes: Any, replicas: int) -> Tie:
    """Make ``table`` (vocabulary-split, ``install_embedding``) and ``heads`` (``nn.Linear``s reading its
    weight) read one stack over ``replicas`` batch replicas on the mesh ``axes``."""
    tie = Tie(axes, replicas)
    setattr(table.weight, TIE, tie)
    for head in heads:
        head.forward = types.MethodType(_tied_forward, head)
    return tie


def tied_heads(model: nn.Module, table: nn.Embedding) -> list[nn.Linear]:
    """The ``nn.Linear``s of ``model`` (their class's own forward) whose weight is ``table``'s."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
            and m.weight is table.weight]


def uninstall_ties(model: nn.Module) -> None:
    """Give every tied head of ``model`` its own forward back (the weights' marks go with the tables')."""
    for m in model.modules():
        if isinstance(m, nn.Linear) and getattr(vars(m).get("forward"), "__func__", None) is _tied_forward:
            del m.forward
