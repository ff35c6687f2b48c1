"""Routed tokens sorted into fixed-size expert slots: every shape static, whatever the router chose.

A router picks ``k`` experts per token. XLA compiles one program per shape, so the data-dependent
groups of transformers' and torchtitan's implementations (``nonzero``, ``histc``, per-expert offsets)
are replaced by ``capacity`` slots per expert: assignment ``a`` (token ``a // k``, its ``a % k``-th
choice) takes the next free slot of its expert, in token order; an assignment that finds its
expert's slots full is dropped (counted in ``Slots.dropped``). Slots are filled by scatters over
integer positions (a one-hot cumulative sum ranks the assignments of each expert: linear in tokens,
no sort, no dot), so dispatching a token is a gather and combining is a scatter-add, as the TPU MoE
implementations do, never a one-hot einsum, which is quadratic in tokens.

Tokens are routed within groups (``[G, Tg, ...]``): one group per batch shard, so routing never
crosses the data axes. ``dropless`` capacity is ``Tg`` (an expert can take every token of its group
once): nothing is dropped and the result equals the model's own implementation. Example:

>>> ids = torch.tensor([[[0, 1], [0, 2], [0, 1]]])        # 1 group, 3 tokens, top-2 of 3 experts
>>> s = route(ids, torch.ones(1, 3, 2), experts=3, capacity=2)
>>> s.token.tolist(), int(s.dropped)                       # expert 0 takes tokens 0, 1; token 2 is dropped
([[0, 1, 0, 2, 1, 3]], 1)
>>> capacity(tokens=64, top_k=2, experts=8, factor=1.25), capacity(64, 2, 8, 1.25, dropless=True)
(20, 64)

``histogram`` is ``torch.histc`` written with comparisons (XLA has no histogram for integers; routers
and auxiliary losses count expert choices with it): ``histogram(torch.tensor([0, 1, 1, 3]), 4, 0, 4)``
is ``tensor([1, 2, 0, 1])``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slots:
    """Where each slot reads from: ``token [G, E*C]`` (``Tg``, a zero row, when empty) and its routing
    ``weight [G, E*C]`` (0 when empty); ``dropped``: assignments that found no slot (a 0-d tensor);
    ``slot [G, Tg*k]``: each assignment's slot (``E*C`` when dropped)."""

    token: torch.Tensor
    weight: torch.Tensor
    dropped: torch.Tensor
    capacity: int
    slot: torch.Tensor


def capacity(tokens: int, top_k: int, experts: int, factor: float, dropless: bool = False) -> int:
    """Slots per expert for ``tokens`` tokens of a group: ``ceil(tokens * top_k / experts * factor)``,
    at most ``tokens``; ``tokens`` when ``dropless``."""
    if dropless:
        return tokens
    return max(1, min(tokens, math.ceil(tokens * top_k / experts * factor)))


def route(ids: torch.Tensor, weights: torch.Tensor, experts: int, capacity: int) -> Slots:
    """Slots for router choices ``ids [G, Tg, k]`` with routing ``weights [G, Tg, k]``."""
    groups, tokens, k = ids.shape
    n = tokens * k
    flat = ids.reshape(groups, n)
    hits = (flat.unsqueeze(-1) == torch.arange(experts, device=ids.device)).to(torch.int32)  # [G, A, E]
    rank = (hits.cumsum(1) * hits).sum(-1) - 1  # each assignment's place among its expert's, in token order
    keep = rank < capacity
    trash = experts * capacity  # one extra column takes every dropped assignment, then is cut off
    slot = torch.where(keep, flat * capacity + rank, trash)
    token = (torch.arange(n, device=ids.device) // k).expand(groups, n)
    slot_token = torch.full((groups, trash + 1), tokens, dtype=token.dtype, device=ids.device).scatter(1, slot, token)
    slot_weight = weights.new_zeros(groups, trash + 1).scatter(1, slot, weights.reshape(groups, n))
    return Slots(slot_token[:, :trash], slot_weight[:, :trash], (~keep).sum(), capacity, slot)


def histogram(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc(x, bins, min, max)`` as static-shape comparisons (see the module docstring)."""
    values = x.reshape(-1).to(torch.float32)
    lo, hi = (values.min(), values.max()) if min == max else (torch.tensor(float(min)), torch.tensor(float(max)))
    lo, hi = lo.to(x.device), hi.to(x.device)
    width = torch.where(hi > lo, (hi - lo) / bins, torch.ones_like(hi))
    index = ((values - lo) / width).floor().clamp(max=bins - 1)
    inside = (values >= lo) & (values <= hi)
    hits = (index.unsqueeze(-1) == torch.arange(bins, device=x.device)) & inside.unsqueeze(-1)
    return hits.sum(0).to(x.dtype)
