"""Softmax, log-softmax and cross-entropy along split features: the vocabulary-parallel loss.

An output head split over its vocabulary (``roles``) may be followed, inside the traced forward, by
the loss (a training wrapper, Hugging Face's ``labels=``). Megatron computes that loss without
gathering the logits: each device reduces its part of every token's max and sum, and only those
per-token values are all-reduced. GSPMD partitions ``softmax``, ``log_softmax``, ``logsumexp`` and
``cross_entropy`` over a split class dimension the same way, so here these ops are followed rather
than stopped at: a softmax keeps the features where they are, a cross-entropy, NLL or logsumexp
over them ends the features' path (``Step.ends``: what remains are per-token values). A region that
ends this way reaches the loss, not the logits: still an output head. Example:

>>> import torch
>>> from torch import nn
>>> from xla_tp.dataflow.trace import trace
>>> class Loss(nn.Module):
...     def forward(self, logits, labels):
...         return nn.functional.cross_entropy(logits, labels)
>>> ce = trace(Loss(), (torch.zeros(6, 10), torch.zeros(6, dtype=torch.long))).nodes[0]
>>> step(ce, 0, Features.whole(1, 10)).ends
'cross_entropy over the split classes: per-token max and sum all-reduced'
"""
from __future__ import annotations

from typing import Union

from .graph import Node
from .ops import Step, _along_dim, _norm_dim, _reduce, register, step
from .shapes import Features, Stop

NORMALISE = ("softmax", "log_softmax", "_softmax", "_log_softmax")
LOSSES = ("cross_entropy", "nll_loss")


def _normalise(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    dim = node.arg(1, "dim")
    rank = len(node.tensors[0].shape)
    if pos == 0 and dim is not None and _norm_dim(dim, rank) == feats.lead.dim:
        return Step([(i, feats) for i in range(len(node.outputs))])  # stays split on the classes
    return _along_dim(node, pos, feats)


def _loss(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    if pos != 0:
        return "used as the target of a loss"
    rank = len(node.tensors[0].shape)
    if feats.lead.dim != (1 if rank > 1 else 0):
        return f"{node.op} over a dimension that is not the split one"
    return Step(ends=f"{node.op} over the split classes: per-token max and sum all-reduced")


def _logsumexp(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    dim = node.arg(1, "dim")
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    rank = len(node.tensors[0].shape)
    if pos == 0 and dim is not None and [_norm_dim(d, rank) for d in dims] == [feats.lead.dim]:
        return Step(ends="logsumexp over the split classes: per-token values all-reduced")
    return _reduce(node, pos, feats)


HANDLERS = {**{op: _normalise for op in NORMALISE}, **{op: _loss for op in LOSSES}, "logsumexp": _logsumexp}
register(HANDLERS)

__all__ = ["HANDLERS", "Features", "step"]
