"""Where a projection's output features live in a tensor, and how reshapes move them.

The output features of a projection (``N`` of them) start as the last dimension of its output.
Views split and merge them (``[B, S, H*D] -> [B, S, H, D]``), slices take blocks of them
(``qkv[..., :E]``). A ``Features`` records, major to minor, the ``Factor``s (tensor dimension,
size, stride in feature units) that hold them, and the window of the feature space they cover.
The leading factor is what a column-parallel split shards: device ``i`` holds its ``i``-th slice
of the leading factor and everything minor to it. Example:

>>> heads = Features.whole(dim=2, size=512).reshaped((2, 8, 512), (2, 8, 8, 64))   # [B, S, H, D]
>>> heads.lead.dim, heads.lead.size, heads.hard
(2, 8, True)
>>> Features.whole(dim=1, size=8).reshaped((2, 8, 5), (16, 5)).lead     # [B, H, S] -> [B*H, S]: 2 blocks of 8
Factor(dim=0, size=8, stride=Fraction(1, 1), outer=2)
>>> Features.whole(dim=2, size=8).reshaped((2, 5, 8), (2, 40))            # heads merged with the sequence
'reshape (2, 5, 8) -> (2, 40) merges the sharded dimension with another one (the compiler cannot keep it sharded)'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Optional, Sequence, Union

Stop = str  # why the features cannot stay sharded


@dataclass(frozen=True)
class Factor:
    """One tensor dimension holding part of the features: ``index * stride`` feature units apart.

    ``outer``: a dimension that merges another one in front of the features (heads merged with the
    batch before a ``bmm``, ``[B, H, S, D] -> [B*H, S, D]``) holds ``outer`` blocks of ``size``."""

    dim: int
    size: int
    stride: Fraction
    outer: int = 1


@dataclass(frozen=True)
class Features:
    """The projection's features in one tensor: factors major -> minor, window ``[base, base + span)``."""

    factors: tuple[Factor, ...]
    base: Fraction = Fraction(0)
    hard: bool = False  # the leading factor is a strict part of the window (heads, a packed block)

    @staticmethod
    def whole(dim: int, size: int) -> "Features":
        return Features((Factor(dim, size, Fraction(1)),))

    @property
    def lead(self) -> Factor:
        return self.factors[0]

    @property
    def span(self) -> Fraction:
        return self.lead.size * self.lead.stride

    def dims(self) -> set[int]:
        return {f.dim for f in self.factors}

    def factor_at(self, dim: int) -> Optional[Factor]:
        return next((f for f in self.factors if f.dim == dim), None)

    def moved(self, mapping: dict[int, Optional[int]]) -> Union["Features", Stop]:
        """Dims renumbered by ``mapping`` (old -> new, None: dropped, which only a size-1 factor may be)."""
        out = []
        for f in self.factors:
            new = mapping.get(f.dim, f.dim)
            if new is None:
                if f is self.lead:
                    return "drops the sharded dimension"
                continue
            out.append(replace(f, dim=new))
        return replace(self, factors=tuple(out))

    def sliced(self, dim: int, start: int, stop: int, keep_dim: bool = True) -> Union["Features", Stop]:
        """Only indices ``[start, stop)`` of tensor dim ``dim`` kept (``keep_dim=False``: one index, dim dropped).

        Slicing the leading factor selects a block of the window (a packed projection); slicing a
        minor factor (half of a head for rotary) keeps the sharding as it is.
        """
        f = self.factor_at(dim)
        if f is None or (start == 0 and stop == f.size * f.outer and keep_dim):
            return self._drop_dim(dim) if not keep_dim else self
        if f.outer > 1:
            return "slices a dimension where the batch is merged with the sharded features"
        if f is not self.lead:
            factors = [replace(g, size=stop - start) if g is f else g for g in self.factors]
            if not keep_dim:
                factors = [g for g in factors if g is not f]
            return _renumber(replace(self, factors=tuple(factors)), dim, keep_dim)
        base = self.base + start * f.stride
        rest = list(self.factors[1:])
        if keep_dim and stop - start > 1:
            rest.insert(0, replace(f, size=stop - start))
        if not rest:
            return "slices the sharded dimension down to a single feature"
        return _renumber(Features(tuple(rest), base, True), dim, keep_dim)

    def _drop_dim(self, dim: int) -> "Features":
        return _renumber(self, dim, False)

    def reshaped(self, before: Sequence[int], after: Sequence[int]) -> Union["Features", Stop]:
        """Features after a row-major view/reshape from shape ``before`` to ``after``."""
        what = f"reshape {tuple(before)} -> {tuple(after)}"
        if math.prod(before) != math.prod(after):
            return f"{what} changes the number of elements"
        atoms = _atoms(before, self)
        out: list[Factor] = []
        for dim, size in enumerate(after):
            parts = _take(atoms, size)
            if parts is None:
                return f"{what} cannot be followed dimension by dimension"
            stride = _merge(parts)
            if stride == "mixed":
                if not any(s is not None and s >= self.lead.stride for _, s in parts):
                    continue  # a minor feature merged with a non-feature dim: the leading factor is intact
                if dim != 0:  # only the batch, in front, may merge with the features (bmm's [B*H, S, D])
                    return f"{what} merges the sharded dimension with another one (the compiler cannot keep it sharded)"
                first = next(i for i, (_, s) in enumerate(parts) if s is not None)  # the batch merged in front
                outer = math.prod(n for n, _ in parts[:first])
                out.append(Factor(dim, size // outer, _merge(parts[first:]), outer))
                continue
            if stride is not None:
                out.append(Factor(dim, size, stride))
        out.sort(key=lambda f: -f.stride * f.size)  # major first (a repeated head: stride < 1, span whole)
        if not out or out[0].stride * out[0].size != self.span:
            return f"{what} merges the sharded dimension with another one (the compiler cannot keep it sharded)"
        return replace(self, factors=tuple(out), hard=self.hard or out[0].stride != 1)


def _renumber(feats: Features, dim: int, keep_dim: bool) -> Features:
    if keep_dim:
        return feats
    return replace(feats, factors=tuple(replace(f, dim=f.dim - (f.dim > dim)) for f in feats.factors
                                        if f.dim != dim))


def _atoms(shape: Sequence[int], feats: Features) -> list[tuple[int, Optional[Fraction]]]:
    """Each non-trivial dim of ``shape`` as (size, stride in features, None if not a feature dim)."""
    atoms = []
    for dim, size in enumerate(shape):
        if size == 1:
            continue
        f = feats.factor_at(dim)
        if f is not None and f.outer > 1:
            atoms += [(f.outer, None), (size // f.outer, f.stride)]
        else:
            atoms.append((size, f.stride if f is not None else None))
    return atoms


def _take(atoms: list[tuple[int, Optional[Fraction]]], size: int) -> Optional[list[tuple[int, Optional[Fraction]]]]:
    """Consume atoms (major first) making up an output dim of ``size``; an atom larger than what is
    left is split, the output dim taking its major part. None if sizes do not divide."""
    parts: list[tuple[int, Optional[Fraction]]] = []
    need = size
    while need > 1:
        if not atoms:
            return None
        a_size, stride = atoms[0]
        if a_size <= need:
            if need % a_size:
                return None
            parts.append(atoms.pop(0))
            need //= a_size
        else:
            if a_size % need:
                return None
            rest = a_size // need
            parts.append((need, None if stride is None else stride * rest))
            atoms[0] = (rest, stride)
            need = 1
    return parts


def _merge(parts: list[tuple[int, Optional[Fraction]]]) -> Union[Fraction, None, str]:
    """Stride of an output dim made of ``parts`` (major -> minor): None if no part is a feature,
    "mixed" if a non-feature dim is merged in front of a feature (the features' blocks are then no
    longer contiguous). Parts minor to the first feature (a non-feature head dim, the half of a head
    rotary sliced) may be anything: each device's block of the major feature stays one contiguous
    block of the merged dim, which is all a split over devices needs."""
    first = next((i for i, (_, s) in enumerate(parts) if s is not None), None)
    if first is None:
        return None
    if first > 0:
        return "mixed"
    return parts[0][1] / math.prod(size for size, _ in parts[1:])
