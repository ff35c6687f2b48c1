"""``Packing``: how a packed projection (q/k/v or gate/up in one weight) is re-laid device-major.

A packed weight split evenly over ``tp`` devices gives device 0 the first rows of q only. Re-laid,
its rows are permuted so device ``d``'s contiguous shard holds its slice of every block
(``[q_d | k_d | v_d]``); a block may also be padded with zero heads, or copied whole to every device. A planner decides the blocks (from how the model slices the output); the
lowering applies the permutation (``lowering.packed``). Example:

>>> Packing(dim=0, blocks=((0, 4), (4, 4)), tp=2).order().tolist()
[0, 1, 4, 5, 2, 3, 6, 7]
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Packing:
    """Blocks ``(start, size)`` along weight dim ``dim``, laid out device-major for ``tp`` devices.

    ``padded``: each block's size once zero features (whole zero heads) are appended to it, so that
    ``tp`` divides it; empty when nothing is padded. A padded parameter grows along ``dim``.
    ``whole``: blocks every device holds a copy of, not a part (the one key/value head of multi-query
    attention packed with the query heads); the parameter grows by the copies.
    ``groups``: per block, the groups a copied block holds (1 when empty): device ``d`` holds a copy of group
    ``d // (tp // groups)``, the one its heads read (Mamba2's B and C of 2 groups over 4 devices).
    """

    dim: int
    blocks: tuple[tuple[int, int], ...]
    tp: int
    padded: tuple[int, ...] = ()
    whole: frozenset[int] = frozenset()
    groups: tuple[int, ...] = ()

    def groups_of(self, index: int) -> int:
        """The groups block ``index`` holds, each copied to the devices reading it (1: every device copies it)."""
        return self.groups[index] if self.groups else 1

    @property
    def size(self) -> int:
        """Features along ``dim`` in the original layout."""
        return sum(n for _, n in self.blocks)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each block's size as laid out over all devices (padded, or copied: ``tp`` copies)."""
        sizes = self.padded or tuple(n for _, n in self.blocks)
        return tuple(n * self.tp // self.groups_of(i) if i in self.whole else n for i, n in enumerate(sizes))

    @property
    def laid_size(self) -> int:
        """Features along ``dim`` as laid out."""
        return sum(self.sizes)

    def order(self) -> torch.Tensor:
        """Original index of each re-laid position (-1: a zero feature of the padding).

        >>> Packing(0, ((0, 4), (4, 4)), 2).order().tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
        >>> Packing(0, ((0, 3),), 2, padded=(4,)).order().tolist()
        [0, 1, 2, -1]
        >>> Packing(0, ((0, 4), (4, 1)), 2, whole=frozenset({1})).order().tolist()   # q split, k copied
        [0, 1, 4, 2, 3, 4]
        >>> Packing(0, ((0, 4), (4, 2)), 4, whole=frozenset({1}), groups=(1, 2)).order().tolist()   # 2 groups
        [0, 4, 1, 4, 2, 5, 3, 5]
        """
        idx = []
        for d in range(self.tp):
            for i, ((start, n), m) in enumerate(zip(self.blocks, self.sizes)):
                share = m // self.tp
                first = d // (self.tp // self.groups_of(i)) * share if i in self.whole else d * share
                idx += [start + first + j if first + j < n else -1 for j in range(share)]
        return torch.tensor(idx, dtype=torch.long)

    def inverse(self) -> torch.Tensor:
        """Re-laid position of each original index (of a copied block: device 0's copy)."""
        first: dict[int, int] = {}
        for pos, original in enumerate(self.order().tolist()):
            if original >= 0:
                first.setdefault(original, pos)
        return torch.tensor([first[i] for i in range(self.size)], dtype=torch.long)

    def relays_output(self, out_dim: int) -> bool:
        """Whether a projection whose weight holds its output features on ``out_dim`` gives an output in
        this layout (not when the re-laid dim is the one it contracts, a row projection's zero inputs, nor
        when one block is only padded at its end, which leaves the features in their order)."""
        return self.dim == out_dim and not (len(self.blocks) == 1 and self.padded)

    def for_bias(self) -> "Packing":
        return replace(self, dim=0)
