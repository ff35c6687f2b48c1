"""Positions picked by value (``torch.where(mask)``), at a static size: what a selection returns.

The eager form of a mixture-of-experts layer holds one module per expert (a ``ModuleList``) and loops
over them: each finds its tokens with ``torch.where(mask)`` (or ``mask.nonzero(as_tuple=True)``),
gathers them (``x[token]``), runs, and adds its output back (``out.index_add_(0, token, y)``). How
many tokens an expert gets is data: on XLA each forward would read the counts on the host and
compile a program for them. In a selection site (``selection``), ``select`` gives ``capacity``
positions instead: those chosen, in order, then padding, as ``SelectedIndex`` tensors that know
which entries are padding. Their readers take a padded entry as the position one past the end of
the dimension it indexes, where a zero slice is appended: a gather reads zeros there (and its
gradient lands there, dropped), an ``index_add`` or an assignment writes there (dropped). Values and
gradients are the model's own for every token kept.

The mask's longest dimension holds the tokens; where the batch shards divide it, positions are
chosen per shard (one group each, ``capacity`` per group) and the token coordinate carries
``Rows``: its readers gather and add within each group, so no token crosses the data axes.
``capacity``: ``ceil(capacity_factor x numel / experts)`` of a group's mask (the even share of its
assignments; ``experts`` is how many selections the site makes per call), or with ``dropless`` all
of it; chosen positions past it are dropped and counted (``moe_report``). Another reader of a
``SelectedIndex`` (``.tolist()``, arithmetic with other shapes, ...) gets the chosen positions at their
data-dependent number, with a warning (the planner leaves a site out when it sees one). Example::

    token, choice = select(ids == 3, site)     # inside a site: what torch.where(ids == 3) returns
    out.index_add(0, token, x[token] * w[token, choice, None])   # padded entries add nothing
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..axes import spec_entry
from ..dataflow.indexing import indexed_dims
from .experts import MoeOptions


@dataclass
class SelectionSite:
    """An MoE module that selects its experts' tokens by value: ``experts`` selections per call."""

    module: str
    experts: int
    layout: str  # of its experts' weights on the model axis
    options: MoeOptions = field(default_factory=MoeOptions)
    last: dict[str, Any] = field(default_factory=dict)  # the last call's routed and dropped positions
    sharder: Any = None  # an ``XlaSharder`` (None: no constraints)
    batch: tuple[str, ...] = ()  # mesh axes of the batch: one selection group per shard
    groups: int = 1

    def capacity(self, numel: int) -> int:
        """Positions for a mask of ``numel`` entries (of one group)."""
        if self.options.dropless:
            return numel
        return max(1, min(numel, math.ceil(self.options.capacity_factor * numel / self.experts)))

    def constrain(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[G, ...]``) split over the batch axes on ``G``."""
        if self.sharder is None:
            return x
        return self.sharder.constrain(x, (spec_entry(self.batch), *[None] * (x.dim() - 1)))


@dataclass
class Rows:
    """Where a token coordinate's positions fall per selection group: ``local [G, Cg]`` (padding:
    ``extent // G``), for a dimension of ``extent`` tokens."""

    site: SelectionSite
    local: torch.Tensor
    extent: int

    @property
    def groups(self) -> int:
        return self.local.shape[0]

    def gather(self, x: torch.Tensor, d: int) -> torch.Tensor:
        """``x``'s rows along ``d`` at these positions (zeros where padded), read within each group."""
        g, per = self.groups, self.extent // self.groups
        rows = F.pad(x.movedim(d, 0).reshape(g, per, -1), (0, 0, 0, 1))
        out = torch.gather(self.site.constrain(rows), 1, self.local.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
        return out.reshape(-1, *x.movedim(d, 0).shape[1:]).movedim(0, d)

    def add(self, x: torch.Tensor, d: int, source: torch.Tensor) -> torch.Tensor:
        """``x`` with ``source``'s rows (along ``d``) added at these positions, within each group."""
        return self._write(x, d, source, accumulate=True)

    def put(self, x: torch.Tensor, d: int, value: Any) -> torch.Tensor:
        """``x`` with ``value``'s rows (along ``d``; broadcast as ``x[positions] = value`` does) written
        at these positions, within each group."""
        shape = list(x.shape)
        shape[d] = self.local.numel()
        return self._write(x, d, torch.as_tensor(value, dtype=x.dtype, device=x.device).expand(shape), accumulate=False)

    def _write(self, x: torch.Tensor, d: int, source: torch.Tensor, accumulate: bool) -> torch.Tensor:
        g, per = self.groups, self.extent // self.groups
        moved = x.movedim(d, 0)
        rows = self.site.constrain(F.pad(moved.reshape(g, per, -1), (0, 0, 0, 1)))
        src = source.movedim(d, 0).reshape(g, self.local.shape[1], -1).to(rows.dtype)
        where = self.local.unsqueeze(-1).expand(-1, -1, rows.shape[-1])
        if not accumulate:  # written rows cleared, then added to (torch_xla 2.9's scatter cannot take more
            # source rows than the target has: it slices the source to the target)
            written = torch.zeros_like(rows[..., :1]).scatter_add(1, self.local.unsqueeze(-1), torch.ones_like(src[..., :1]))
            rows = rows * (written == 0).to(rows.dtype)
        return rows.scatter_add(1, where, src)[:, :per].reshape(moved.shape).movedim(0, d)


class SelectedIndex(torch.Tensor):
    """Chosen positions along one dimension of a mask, then padding; ``valid`` marks the chosen."""

    valid: torch.Tensor
    rows: Optional[Rows]  # a token coordinate selected per group: read and written within the groups

    @staticmethod
    def wrap(t: torch.Tensor, valid: torch.Tensor, rows: Optional[Rows] = None) -> "SelectedIndex":
        out = t.as_subclass(SelectedIndex)
        out.valid, out.rows = valid, rows
        return out

    def rows_of(self, x: torch.Tensor, d: int) -> Optional[Rows]:
        """The per-group positions, where ``x``'s dimension ``d`` holds the tokens they were chosen among."""
        return self.rows if self.rows is not None and self.dim() == 1 and x.shape[d] == self.rows.extent else None

    def plain(self, past_end: int) -> torch.Tensor:
        """The positions, padding as ``past_end``."""
        with torch._C.DisableTorchFunctionSubclass():
            return torch.where(self.valid, self, past_end)

    def exact(self) -> torch.Tensor:
        """The chosen positions only (a data-dependent shape)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self[self.valid]

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reader = _READERS.get(name)
        if reader is not None and args and not isinstance(args[0], SelectedIndex):
            return reader(*args, **kwargs)
        if args and isinstance(args[0], SelectedIndex) and (name in _SAME_POSITIONS or name == "__get__"):
            out = _same_positions(func, args, kwargs)
            if out is not NotImplemented:
                return out
        _warn_exact(name)
        args, kwargs = _map_selected(lambda s: s.exact(), (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def select(cond: torch.Tensor, site: SelectionSite) -> tuple[SelectedIndex, ...]:
    """``torch.where(cond)`` at ``site.capacity`` positions per group (see the module docstring): the
    tokens (``cond``'s longest dimension) in one group per batch shard where it divides."""
    shape = tuple(cond.shape)
    tokens = max(range(len(shape)), key=lambda d: shape[d])
    groups = site.groups if shape[tokens] % site.groups == 0 else 1
    moved = cond.movedim(tokens, 0)
    flat = site.constrain(moved.reshape(groups, -1)) != 0
    n = flat.shape[1]
    capacity = site.capacity(n)
    rank = torch.cumsum(flat.to(torch.int32), 1) - 1
    keep = flat & (rank < capacity)
    slot = torch.where(keep, rank, capacity).long()  # the rest go to a slot past the end, cut off below
    positions = torch.full((groups, capacity + 1), n, dtype=torch.long, device=cond.device)
    positions = positions.scatter(1, slot, torch.arange(n, device=cond.device).expand(groups, n))[:, :capacity]
    valid = positions < n
    site.last["routed"] = site.last.get("routed", 0) + flat.sum()
    site.last["dropped"] = site.last.get("dropped", 0) + (flat.sum() - keep.sum())
    per_group = (shape[tokens] // groups, *moved.shape[1:])
    local = torch.unravel_index(positions.clamp(max=n - 1), per_group)
    start = torch.arange(groups, device=cond.device).unsqueeze(1) * per_group[0]
    coords = [local[0] + start, *local[1:]]
    coords.insert(tokens, coords.pop(0))  # back in cond's order of dimensions
    rows = Rows(site, torch.where(valid, local[0], per_group[0]), shape[tokens])
    return tuple(SelectedIndex.wrap(c.reshape(-1), valid.reshape(-1), rows if d == tokens else None)
                 for d, c in enumerate(coords))


def _map_selected(fn: Callable[[SelectedIndex], Any], tree: Any) -> Any:
    if isinstance(tree, SelectedIndex):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_selected(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: _map_selected(fn, v) for k, v in tree.items()}
    return tree


def _padded(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``x`` with one zero slice appended along each of ``dims``."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        pad[2 * (x.dim() - 1 - d) + 1] = 1
    return F.pad(x, pad)


def _safe_index(x: torch.Tensor, index: Any) -> tuple[torch.Tensor, Any, list[int]]:
    """``x`` padded along the dims ``SelectedIndex`` items of ``index`` read, the index with plain
    positions, and those dims."""
    items = index if isinstance(index, tuple) else (index,)
    dims = indexed_dims(items, x.dim())
    padded = [d for i, d in zip(items, dims) if isinstance(i, SelectedIndex)]
    plain = tuple(i.plain(x.shape[d]) if isinstance(i, SelectedIndex) else i for i, d in zip(items, dims))
    return _padded(x, padded), plain, padded


def _getitem(x: torch.Tensor, index: Any) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        grouped = _grouped_getitem(x, index if isinstance(index, tuple) else (index,))
        if grouped is not None:
            return grouped
        padded, plain, _ = _safe_index(x, index)
        return padded[plain]


def _grouped_getitem(x: torch.Tensor, items: tuple) -> Optional[torch.Tensor]:
    """``x[items]`` read within the selection groups, where the first tensor of ``items`` is a token
    coordinate chosen per group and the other tensors (adjacent to it) are its mask's other
    coordinates: the rows gathered per group, then each other coordinate picked row by row. None
    where that does not apply."""
    at = [k for k, i in enumerate(items) if isinstance(i, torch.Tensor)]
    if not at or at != list(range(at[0], at[0] + len(at))) or not all(isinstance(items[k], SelectedIndex) for k in at):
        return None
    d = indexed_dims(items, x.dim())[at[0]]
    rows = items[at[0]].rows_of(x, d)
    if rows is None:
        return None
    x = rows.gather(x, d)
    for k in at[1:]:  # each in turn at d + 1, the one before it picked and gone
        padded = _padded(x, [d + 1])
        pick = items[k].plain(x.shape[d + 1]).view([-1 if i == d else 1 for i in range(x.dim())])
        x = torch.gather(padded, d + 1, pick.expand(*padded.shape[:d + 1], 1, *padded.shape[d + 2:])).squeeze(d + 1)
    return x[(*items[:at[0]], slice(None), *items[at[-1] + 1:])]


def _setitem(x: torch.Tensor, index: Any, value: Any) -> None:
    items = index if isinstance(index, tuple) else (index,)
    with torch._C.DisableTorchFunctionSubclass():
        if len(items) == 1 and isinstance(items[0], SelectedIndex) and items[0].rows_of(x, 0) is not None:
            x.copy_(items[0].rows.put(x, 0, value))  # x[token] = value (x[token] += ...): within the groups
            return
        padded, plain, dims = _safe_index(x, index)
        padded[plain] = value
        x.copy_(_cut(padded, x.shape, dims))


def _cut(x: torch.Tensor, shape: torch.Size, dims: list[int]) -> torch.Tensor:
    for d in dims:
        x = x.narrow(d, 0, shape[d])
    return x


def _index_add(x: torch.Tensor, dim: int, index: SelectedIndex, source: torch.Tensor, *,
               alpha: Any = 1, inplace: bool = False) -> torch.Tensor:
    d = dim % x.dim()
    rows = index.rows_of(x, d)
    with torch._C.DisableTorchFunctionSubclass():
        if rows is not None:
            out = rows.add(x, d, source if alpha == 1 else source * alpha)
        else:
            out = _padded(x, [d]).index_add(d, index.plain(x.shape[d]), source, alpha=alpha).narrow(d, 0, x.shape[d])
        return x.copy_(out) if inplace else out


def _index_select(x: torch.Tensor, dim: int, index: SelectedIndex) -> torch.Tensor:
    d = dim % x.dim()
    rows = index.rows_of(x, d)
    with torch._C.DisableTorchFunctionSubclass():
        return rows.gather(x, d) if rows is not None else _padded(x, [d]).index_select(d, index.plain(x.shape[d]))


_READERS: dict[str, Callable[..., Any]] = {  # by name: Tensor.__getitem__ may be the lowering's own
    "__getitem__": _getitem,
    "__setitem__": _setitem,
    "index_add": _index_add,
    "index_add_": functools.partial(_index_add, inplace=True),
    "index_select": _index_select,
}

# ops that keep each position where it is, in row-major order: the result is padded where the index was
KEEPS = frozenset({"to", "long", "int", "clone", "contiguous", "detach", "view", "reshape", "flatten", "squeeze",
                    "unsqueeze"})
_SAME_POSITIONS = KEEPS | {"__len__", "size", "dim", "numel"}


def _same_positions(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``func`` of a ``SelectedIndex``: a non-tensor as it is, a same-size integer tensor still padded
    where it was (NotImplemented otherwise: a getter that moves positions, ``.T``, or a float result)."""
    index = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if not isinstance(out, torch.Tensor):
        return out
    if out.numel() != index.numel() or out.is_floating_point() or (func.__name__ == "__get__" and out.dim() > 1):
        return NotImplemented
    return SelectedIndex.wrap(out, index.valid.reshape(out.shape), index.rows if out.shape == index.shape else None)


@functools.lru_cache(maxsize=None)
def _warn_exact(op: str) -> None:
    warnings.warn(f"xla_tp: '{op}' reads the positions torch.where chose for an expert: it gets them at their "
                  f"data-dependent number (the model's own result; the program is compiled again for each "
                  f"routing). Index, index_add or index_select with them to keep one program", stacklevel=3)
