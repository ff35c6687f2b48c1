"""The lowering mode: the one way xla_tp sees torch functions inside a parallelized forward.

A ``TorchFunctionMode`` entered only around the modules (or transformers attention functions) that own a
rewrite (``owners``): there it calls
``entry``'s handlers (attention with visible heads, column groups, vocabulary tables, ...). Around the
modules that slice a packed projection's output, merge heads with the batch before a ``bmm`` (``bmm``:
kept 4-D) or embed patches (``patchify``: an einsum), the ``sites``, it also reads a copied block's
copies (``copies``) and the packed outputs. A projection whose weight was re-laid device-major (``packed``) has its output
tagged (by ``entry``'s ``linear``/``addmm``); the model's own ``split``/``chunk``/slicing of it then
gets each block read in place
(``packed.pieces``), views that keep the last dim keep the tag, a view into heads is read by its heads
(``packed.heads_view``: Falcon's ``qkv.view(b, s, heads + 2, d)[..., [-2], :]``), and any other use of the tagged
output gets the original order back (with one warning naming the op: it moves data). Example::

    with active():            # what scope's hooks do around a site's forward
        q, k, v = attn.c_attn(x).split(64, dim=2)      # blocks of the re-laid c_attn, in place
"""
from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from . import bmm, channels, concat, copies, packed, patchify, rows, transposed
from .entry import GETITEM, HANDLERS as ENTRY



def _is_getitem(func: Callable) -> bool:
    return func is GETITEM


class Lowering(TorchFunctionMode):
    """See the module docstring. One instance per thread, entered once however deep the nesting."""

    def __init__(self) -> None:
        super().__init__()
        self.tagged = False  # some output in this forward carries a packing (packed.tag_of)
        self.warned: set[str] = set()
        self.table = OWNED  # the handlers acting now: the owners', with the sites' inside a site (``sites``)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tagged and any(packed.tag_of(a) is not None for a in args):
            return self._on_tagged(func, args, kwargs)
        handler = self.table.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                if isinstance(out, torch.Tensor) and packed.tag_of(out) is not None:
                    self.tagged = True  # a packed projection's output, tagged by entry for the slicing
                return out
        return func(*args, **kwargs)

    def sites(self, inside: bool) -> None:
        """The sites' handlers act too (``inside`` a module that slices a packed projection), or no longer."""
        self.table = IN_SITE if inside else OWNED

    def tag(self, out: torch.Tensor, packing: packed.Packing) -> torch.Tensor:
        self.tagged = True
        return packed.tag(out, packing)

    def _on_tagged(self, func, args: tuple, kwargs: dict) -> Any:
        tensor = next(a for a in args if packed.tag_of(a) is not None)
        packing = packed.tag_of(tensor)
        if _metadata(func):
            return func(*args, **kwargs)
        if isinstance(packing, packed.Heads):  # a view into heads: its heads taken by the model's slicing
            heads = _heads_range(func, args, tensor, packing.packing.size // packing.head)
            out = None if heads is None else packed.heads_piece(tensor, packing, *heads)
            return out if out is not None else self._fallback(func, args, kwargs)
        if channels.follows(func, tensor):  # features moved off the last dim, as a convolution's channels
            out = channels.follow(func, args, kwargs, tensor, packing)
            if out is not NotImplemented:
                return out
        if func in _RESHAPES:  # features split into the packing's blocks, then heads: read in place
            shape = _view_shape(args, kwargs, tensor)
            out = packed.blocks_view(tensor, packing, shape)
            if out is None:
                out = packed.heads_view(tensor, packing, shape)
            if out is not None:
                return out
        if packing.padded and func in _RESHAPES:  # the model's own sizes name the original features
            out = func(*_laid_shape(args, packing), **kwargs)
            if out.shape[-1] == packing.laid_size:
                return self.tag(out, packing)
        ranges = _slice_ranges(func, args, kwargs, tensor, packing.size)
        if ranges is not None:
            got = channels.pieces(tensor, packing, ranges)
            if got is not None:
                return got[0] if func is torch.Tensor.narrow or _is_getitem(func) else tuple(got)
        if func in _ELEMENTWISE:
            out = _elementwise(func, args, kwargs, tensor, packing)
            if out is not NotImplemented:
                return self.tag(out, packing)
        if func in _KEEPS_LAST and not (func in _RESHAPES and packing.laid_size != packing.size):
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.shape[-1] == tensor.shape[-1]:
                return self.tag(out, packing)
        return self._fallback(func, args, kwargs)

    def _fallback(self, func, args: tuple, kwargs: dict) -> Any:
        name = getattr(func, "__name__", repr(func))
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(f"xla_tp: '{name}' uses a re-laid packed projection's whole output; it gets the original "
                          f"order back, which moves data between devices", stacklevel=3)
        fixed = tuple(a if packed.tag_of(a) is None else _unpermuted(a) for a in args)
        return func(*fixed, **kwargs)


def _elementwise(func: Callable, args: tuple, kwargs: dict, t: torch.Tensor, packing: packed.Packing) -> Any:
    """An element-wise op of the tagged ``t`` (features last) with tensors of one value per original feature
    (Falcon-H1's ``zxbcdt * mup_vector``) or broadcast over them: those re-laid the same way, the output in
    ``t``'s layout; with another output re-laid as ``t`` is (Zamba2's ``gate_up_proj(h) + adapter(h)``) as it is;
    ``NotImplemented`` for anything else (another layout, other shapes)."""
    if channels.laid_dim(t) != t.dim() - 1 or kwargs or packing.padded:  # zero features: 0 / 0
        return NotImplemented
    laid = []
    for a in args:
        if a is t or not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[-1] == 1:
            laid.append(a)
        elif channels.same_layout(a, t) and a.shape[-1] == t.shape[-1]:
            laid.append(a)
        elif packed.tag_of(a) is None and a.shape[-1] == packing.size:
            laid.append(packed.permute(a, dataclasses.replace(packing, dim=a.dim() - 1)))
        else:
            return NotImplemented
    out = func(*laid)
    return out if isinstance(out, torch.Tensor) and out.shape[-1] == t.shape[-1] else NotImplemented


def _unpermuted(t: torch.Tensor) -> torch.Tensor:
    """A tagged ``t`` in the original order, wherever its features are (``channels.laid_dim``)."""
    dim = channels.laid_dim(t)
    return packed.unpermute(t.movedim(dim, -1), packed.tag_of(t)).movedim(-1, dim)


_METADATA = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "element_size", "is_contiguous",
                       "__len__", "is_floating_point", "is_complex", "get_device", "data_ptr", "shape", "dtype",
                       "device", "ndim", "requires_grad", "is_leaf", "layout", "names", "grad_fn"})


_SEEN: dict[Callable, bool] = {}  # a dict, not functools.lru_cache: dynamo splits the graph at an lru_cache call


def _metadata(func: Callable) -> bool:
    """Calls that read a tensor's metadata, not its values (``x.shape``, ``x.size(-1)``, ``x.dim()``)."""
    known = _SEEN.get(func)
    if known is None:
        name = (resolve_name(func) or getattr(func, "__name__", "")).removesuffix(".__get__").rsplit(".", 1)[-1]
        known = _SEEN[func] = name in _METADATA
    return known


def _view_shape(args: tuple, kwargs: dict, t: torch.Tensor) -> tuple[int, ...]:
    """The shape a ``view``/``reshape`` of ``t`` asks for, a -1 resolved (``()`` if it names none)."""
    shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:] or kwargs.get("shape", ())
    if not all(isinstance(n, int) for n in shape) or list(shape).count(-1) > 1:
        return ()
    known = math.prod(n for n in shape if n != -1)
    return tuple(t.numel() // known if n == -1 and known else n for n in shape)


def _laid_shape(args: tuple, packing: packed.Packing) -> tuple:
    """``view``/``reshape`` arguments with the original feature count (last) as the laid-out one."""
    shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    shape = [*shape[:-1], packing.laid_size if shape and shape[-1] == packing.size else shape[-1]] if shape else []
    return (args[0], tuple(shape))


def _slice_ranges(func, args: tuple, kwargs: dict, t: torch.Tensor, n: int) -> Optional[list[tuple[int, int]]]:
    """The feature ranges a slicing op takes from ``t``'s re-laid features (``n`` original features; the last dim, or
    the channels dim they were moved to: ``channels.laid_dim``), or None if it is not such an op."""
    laid = channels.laid_dim(t)

    def on_laid(dim: Any) -> bool:
        return isinstance(dim, int) and dim % t.dim() == laid

    if func in (torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes):
        size, dim = (args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))), \
            (args[2] if len(args) > 2 else kwargs.get("dim", 0))
        if not on_laid(dim):
            return None
        sizes = [size] * (-(-n // size)) if isinstance(size, int) else list(size)
        return _runs(sizes, n)
    if func in (torch.Tensor.chunk, torch.chunk):
        chunks, dim = args[1] if len(args) > 1 else kwargs["chunks"], args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if not on_laid(dim):
            return None
        step = -(-n // chunks)
        return _runs([step] * (-(-n // step)), n)
    if func is torch.Tensor.narrow:
        dim, start, length = args[1:4]
        return [(start % n, start % n + length)] if on_laid(dim) else None
    if _is_getitem(func):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if Ellipsis in index:
            i = index.index(Ellipsis)
            index = index[:i] + (slice(None),) * (t.dim() - len(index) + 1) + index[i + 1:]
        if len(index) != t.dim() or any(not isinstance(i, slice) or i != slice(None) for d, i in enumerate(index)
                                        if d != laid):
            return None
        taken = index[laid]
        if not isinstance(taken, slice) or taken.step not in (None, 1):
            return None
        return [(_bound(taken.start, 0, n), _bound(taken.stop, n, n))]
    return None


def _heads_range(func, args: tuple, t: torch.Tensor, n: int) -> Optional[tuple[int, int]]:
    """The heads ``[start, stop)`` of ``n`` (original numbering) that ``t[..., a:b, :]`` or ``t[..., [i], :]``
    takes from a heads view ``t``, else None."""
    if not _is_getitem(func):
        return None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if Ellipsis in index:
        i = index.index(Ellipsis)
        index = index[:i] + (slice(None),) * (t.dim() - len(index) + 1) + index[i + 1:]
    if len(index) != t.dim() or any(i != slice(None) for i in (*index[:-2], index[-1])):
        return None
    heads = index[-2]
    if isinstance(heads, list) and len(heads) == 1 and isinstance(heads[0], int) and -n <= heads[0] < n:
        return heads[0] % n, heads[0] % n + 1
    if isinstance(heads, slice) and heads.step in (None, 1):
        return _bound(heads.start, 0, n), _bound(heads.stop, n, n)
    return None


def _bound(i: Optional[int], default: int, n: int) -> int:
    """A slice bound on a dimension of ``n`` as ``slice.indices`` gives it (step 1), which dynamo cannot trace."""
    if i is None:
        return default
    return min(max(i + n if i < 0 else i, 0), n)


def _runs(sizes: list[int], n: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, min(start + s, n)))
        start += s
    return out


def _first(*tables: dict[Callable, Callable]) -> dict[Callable, Callable]:
    """One handler per function of ``tables``: where several handle it, the first that does not return
    ``NotImplemented``."""
    def first(handlers: list[Callable]) -> Callable:
        def handler(*args: Any, **kwargs: Any) -> Any:
            for h in handlers:
                out = h(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            return NotImplemented
        return handler

    funcs: dict[Callable, list[Callable]] = {}
    for table in tables:
        for func, h in table.items():
            funcs.setdefault(func, []).append(h)
    return {func: first(handlers) for func, handlers in funcs.items()}


# an owner's ``x @ w.T`` (Falcon's ``FalconLinear`` in its MLP) is its ``F.linear`` there too (column groups)
OWNED = _first(ENTRY, transposed.HANDLERS)
# copies first: they act on copied keys/values only, which entry's ``x[index]`` would take as any tensor
IN_SITE = _first(copies.HANDLERS, ENTRY, bmm.HANDLERS, rows.HANDLERS, patchify.HANDLERS, transposed.HANDLERS,
                 channels.HANDLERS, concat.HANDLERS)
_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape}
_ELEMENTWISE = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.add, torch.Tensor.add,
                torch.Tensor.__add__, torch.Tensor.__radd__, torch.sub, torch.Tensor.sub, torch.Tensor.__sub__,
                torch.div, torch.Tensor.div, torch.Tensor.__truediv__}
_KEEPS_LAST = {torch.Tensor.unsqueeze, torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous, torch.Tensor.to,
               torch.Tensor.float, torch.Tensor.clone, torch.Tensor.type_as, torch.Tensor.clamp, torch.clamp,
               torch.Tensor.detach}


class _ThreadMode(threading.local):
    """Each thread's mode, made with the thread's state (``torch.compile`` guards on what it reads: an attribute
    created at the first call would recompile the compiled model at the next one)."""

    def __init__(self) -> None:
        self.mode = Lowering()


_state = _ThreadMode()


def active() -> Lowering:
    """This thread's lowering mode (one instance, entered once however deep the nesting)."""
    return _state.mode
