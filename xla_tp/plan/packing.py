"""``Packing``: how a packed projection (q/k/v or gate/up in one weight) is re-laid device-major.

A packed weight split evenly over ``tp`` devices gives device 0 the first rows of q only. Re-laid,
its rows are permuted so device ``d``'s contiguous shard holds its slice of every block
(``[q_d | k_d | v_d]``). A planner decides the blocks (from how the model slices the output); the
lowering applies the permutation (``lowering.packed``). Example:

>>> Packing(dim=0, blocks=((0, 4), (4, 4)), tp=2).order().tolist()
[0, 1, 4, 5, 2, 3, 6, 7]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Blocks ``(start, size)`` along weight dim ``dim``, laid out device-major for ``tp`` devices."""

    dim: int
    blocks: tuple[tuple[int, int], ...]
    tp: int

    @property
    def size(self) -> int:
        return sum(n for _, n in self.blocks)

    def order(self) -> torch.Tensor:
        """Original index of each re-laid position.

        >>> Packing(0, ((0, 4), (4, 4)), 2).order().tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
        """
        idx = [start + d * (n // self.tp) + j for d in range(self.tp) for start, n in self.blocks
               for j in range(n // self.tp)]
        return torch.tensor(idx, dtype=torch.long)

    def inverse(self) -> torch.Tensor:
        order = self.order()
        return torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))

    def for_bias(self) -> "Packing":
        return Packing(0, self.blocks, self.tp)
