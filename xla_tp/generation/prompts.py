"""A batch of prompts as the compiled steps take it: left-padded to a bucket, on the host.

Each row's tokens (those its ``attention_mask`` marks, in order, wherever the padding was) end at
the same slot, the bucket's last; the slots before them are padding, which no token attends to
(``valid`` is False there) and whose rotary positions are clamped to 0. A batch the mesh's batch
axes do not divide gets extra rows (copies of the first), dropped from the result. Example:

>>> batch = left_padded(torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]]),
...                     pad=0, length=4, cache=8, rows_multiple=1)
>>> batch.ids.tolist(), batch.positions.tolist()
([[0, 5, 6, 7], [0, 0, 8, 9]], [[0, 0, 1, 2], [0, 0, 0, 1]])
>>> batch.valid.int().tolist()[1]
[0, 0, 1, 1, 1, 1, 1, 1]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import GenerationError


@dataclass(frozen=True)
class Batch:
    """``ids``/``positions`` ``[B, length]``, ``valid`` ``[B, cache]`` (False on padding slots); ``rows``: the
    caller's rows (the first ``rows`` of ``B``)."""

    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    rows: int


def token_counts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Tokens per row, after checking the inputs' shapes (``GenerationError`` naming what to pass)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise GenerationError(f"input_ids must be integer token ids [batch, length], got {shape}; a single prompt "
                              f"is ids[None]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise GenerationError(f"input_ids {tuple(input_ids.shape)} is empty: pass at least one token per row")
    if attention_mask is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1])
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise GenerationError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                              f"{tuple(input_ids.shape)}: pass one 1/0 per token (1: a token, 0: padding)")
    counts = attention_mask.cpu().bool().sum(-1)
    if (counts == 0).any():
        raise GenerationError(f"attention_mask rows {(counts == 0).nonzero().flatten().tolist()} mark no token: "
                              f"every row needs at least one")
    return counts


def left_padded(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], pad: int, length: int,
                cache: int, rows_multiple: int) -> Batch:
    """The prompts right-aligned in ``length`` slots (see the module docstring)."""
    ids = input_ids.cpu()
    keep = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.cpu().bool()
    rows = ids.shape[0]
    total = -(-rows // rows_multiple) * rows_multiple
    out = torch.full((total, length), pad, dtype=torch.long)
    starts = torch.empty(total, dtype=torch.long)
    for row in range(total):
        source = row if row < rows else 0
        tokens = ids[source][keep[source]]
        out[row, length - len(tokens):] = tokens
        starts[row] = length - len(tokens)
    slots = torch.arange(cache)
    positions = (torch.arange(length)[None, :] - starts[:, None]).clamp(min=0)
    return Batch(out, positions, slots[None, :] >= starts[:, None], rows)
