"""The lowering mode: during a parallelized forward, ops that would hide a sharding are rewritten.

A ``TorchFunctionMode`` is active while a parallelized module runs (``install`` adds a forward
pre-hook and an always-called forward hook; nested modules share one activation). On XLA tensors
(torch_xla's, and torchax's when the JAX backend traces the same module):

- ``F.scaled_dot_product_attention``, ``matmul``/``@`` of rank >= 4 and torch's
  ``multi_head_attention_forward`` become einsums that keep heads visible (``attention``);
- ``F.layer_norm`` is spelled out (torch_xla's kernel all-gathers a batch split over a data axis);
- slices whose bounds lie past a dimension are clamped as on the CPU (torch_xla 2.9 raises
  ``Value out of range`` for ``x[..., -4095:, :]`` on a dimension of 16, which transformers'
  sliding-window caches do);
- a projection whose weight was re-laid device-major (``packed``) has its output tagged, so the
  model's own ``split``/``chunk``/slicing of it reads each block in place; any other use of the
  tagged output gets the original order back.

Everything else runs untouched. Example::

    install(model)            # model(x) now runs under the mode
"""
from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name

from . import attention, packed

_HOOKS = "_xla_tp_lowering_hooks"
_state = threading.local()


def _is_xla(t: Any) -> bool:
    """An XLA tensor: torch_xla's, or torchax's (device "jax") when the JAX backend traces."""
    return isinstance(t, torch.Tensor) and t.device.type in ("xla", "jax")


def layer_norm(x: torch.Tensor, normalized_shape: Any, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` written out (same values)."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    y = y * weight if weight is not None else y
    return y + bias if bias is not None else y


class Lowering(TorchFunctionMode):
    """See the module docstring. One instance per thread, entered once however deep the nesting."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, tuple[torch.Tensor, packed.Packing]] = {}
        self.warned: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tags and any(id(a) in self.tags for a in args if isinstance(a, torch.Tensor)):
            return self._on_tagged(func, args, kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(self, func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def tag(self, out: torch.Tensor, packing: packed.Packing) -> torch.Tensor:
        self.tags[id(out)] = (out, packing)
        return out

    def _on_tagged(self, func, args: tuple, kwargs: dict) -> Any:
        tensor, packing = self.tags[id(next(a for a in args if isinstance(a, torch.Tensor) and id(a) in self.tags))]
        if _metadata(func):
            return func(*args, **kwargs)
        ranges = _slice_ranges(func, args, kwargs, tensor)
        if ranges is not None:
            got = packed.pieces(tensor, packing, ranges)
            if got is not None:
                return got[0] if func in (torch.Tensor.__getitem__, torch.Tensor.narrow) else tuple(got)
        if func in _KEEPS_LAST:
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
        fixed = tuple(packed.unpermute(a, self.tags[id(a)][1]) if isinstance(a, torch.Tensor) and id(a) in self.tags
                      else a for a in args)
        return func(*fixed, **kwargs)


_METADATA = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "element_size", "is_contiguous",
                       "__len__", "is_floating_point", "is_complex", "get_device", "data_ptr", "shape", "dtype",
                       "device", "ndim", "requires_grad", "is_leaf", "layout", "names", "grad_fn"})


@functools.lru_cache(maxsize=None)
def _metadata(func: Callable) -> bool:
    """Calls that read a tensor's metadata, not its values (``x.shape``, ``x.size(-1)``, ``x.dim()``)."""
    name = (resolve_name(func) or getattr(func, "__name__", "")).removesuffix(".__get__").rsplit(".", 1)[-1]
    return name in _METADATA


def _slice_ranges(func, args: tuple, kwargs: dict, t: torch.Tensor) -> Optional[list[tuple[int, int]]]:
    """The feature ranges a slicing op takes from ``t``'s last dim, or None if it is not such an op."""
    n, last = t.shape[-1], t.dim() - 1

    def on_last(dim: Any) -> bool:
        return isinstance(dim, int) and dim % t.dim() == last

    if func in (torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes):
        size, dim = (args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))), \
            (args[2] if len(args) > 2 else kwargs.get("dim", 0))
        if not on_last(dim):
            return None
        sizes = [size] * (-(-n // size)) if isinstance(size, int) else list(size)
        return _runs(sizes, n)
    if func in (torch.Tensor.chunk, torch.chunk):
        chunks, dim = args[1] if len(args) > 1 else kwargs["chunks"], args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if not on_last(dim):
            return None
        step = -(-n // chunks)
        return _runs([step] * (-(-n // step)), n)
    if func is torch.Tensor.narrow:
        dim, start, length = args[1:4]
        return [(start % n, start % n + length)] if on_last(dim) else None
    if func is torch.Tensor.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if Ellipsis in index:
            i = index.index(Ellipsis)
            index = index[:i] + (slice(None),) * (t.dim() - len(index) + 1) + index[i + 1:]
        if len(index) != t.dim() or any(not isinstance(i, slice) or i != slice(None) for i in index[:-1]):
            return None
        last_index = index[-1]
        if not isinstance(last_index, slice) or last_index.step not in (None, 1):
            return None
        start, stop, _ = last_index.indices(n)
        return [(start, stop)]
    return None


def _runs(sizes: list[int], n: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, min(start + s, n)))
        start += s
    return out


def _sdpa(mode: Lowering, func, args: tuple, kwargs: dict) -> Any:
    if not _is_xla(args[0] if args else kwargs.get("query")):
        return NotImplemented
    return attention.sdpa(*args, **kwargs)


def _matmul(mode: Lowering, func, args: tuple, kwargs: dict) -> Any:
    a, b = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else (args[0], args[1] if len(args) > 1 else kwargs["other"])
    if not (_is_xla(a) and _is_xla(b) and a.dim() >= 4 and b.dim() >= 4):
        return NotImplemented
    return attention.matmul_4d(a, b)


def _mha(mode: Lowering, func, args: tuple, kwargs: dict) -> Any:
    bound = dict(zip(attention.MHA_ARGS, args), **kwargs)
    if not _is_xla(bound["query"]) or not attention.mha_supported(bound):
        return NotImplemented
    return attention.mha(**bound)


def _layer_norm(mode: Lowering, func, args: tuple, kwargs: dict) -> Any:
    if not _is_xla(args[0] if args else kwargs.get("input")):
        return NotImplemented
    return layer_norm(*args, **kwargs)


def _getitem(mode: Lowering, func, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    if not _is_xla(t):
        return NotImplemented
    fixed = clamp_slices(args[1], tuple(t.shape))
    return NotImplemented if fixed is None else func(t, fixed)


def clamp_slices(index: Any, shape: tuple[int, ...]) -> Any:
    """``index`` with out-of-range slice bounds clamped to the dims they index; None if none is.

    >>> clamp_slices((Ellipsis, slice(-4095, None), slice(None)), (2, 16, 8))
    (Ellipsis, slice(-16, None, None), slice(None, None, None))
    """
    items = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(i, slice) for i in items) or any(isinstance(i, torch.Tensor) for i in items):
        return None
    real = sum(1 for i in items if i is not None and i is not Ellipsis)
    dims, dim = [], 0
    for i in items:
        dims.append(dim)
        if i is Ellipsis:
            dim += len(shape) - real
        elif i is not None:
            dim += 1
    out, changed = [], False
    for i, d in zip(items, dims):
        if isinstance(i, slice) and d < len(shape):
            n = shape[d]
            start, stop = (None if b is None else max(-n, min(n, b)) for b in (i.start, i.stop))
            changed |= (start, stop) != (i.start, i.stop)
            i = slice(start, stop, i.step)
        out.append(i)
    if not changed:
        return None
    return tuple(out) if isinstance(index, tuple) else out[0]


def _projection(mode: Lowering, func, args: tuple, kwargs: dict) -> Any:
    weight = args[1] if func is F.linear else (args[2] if len(args) > 2 else kwargs.get("mat2"))
    packing = packed.packing_of(weight)
    if packing is None:
        return NotImplemented
    return mode.tag(func(*args, **kwargs), packing)


_HANDLERS: dict[Callable, Callable] = {
    F.scaled_dot_product_attention: _sdpa, torch.matmul: _matmul, torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul, torch.Tensor.__rmatmul__: _matmul,
    F.multi_head_attention_forward: _mha, F.layer_norm: _layer_norm,
    F.linear: _projection, torch.addmm: _projection, torch.Tensor.__getitem__: _getitem,
}
_KEEPS_LAST = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous, torch.Tensor.to,
               torch.Tensor.float, torch.Tensor.clone, torch.Tensor.type_as, torch.Tensor.clamp, torch.clamp,
               torch.Tensor.detach}


def _active() -> Lowering:
    mode = getattr(_state, "mode", None)
    if mode is None:
        mode = _state.mode = Lowering()
        _state.depth = 0
    return mode


def _enter(module: nn.Module, args: Any) -> None:
    mode = _active()
    if _state.depth == 0:
        mode.__enter__()
    _state.depth += 1


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    mode = _active()
    _state.depth -= 1
    if _state.depth == 0:
        mode.tags.clear()
        mode.__exit__(None, None, None)


def install(module: nn.Module) -> None:
    """Run ``module``'s forward under the lowering mode (idempotent)."""
    if getattr(module, _HOOKS, None):
        return
    handles = [module.register_forward_pre_hook(_enter, prepend=True),
               module.register_forward_hook(_leave, always_call=True)]
    setattr(module, _HOOKS, handles)


def uninstall(module: nn.Module) -> None:
    for handle in getattr(module, _HOOKS, None) or []:
        handle.remove()
    if hasattr(module, _HOOKS):
        delattr(module, _HOOKS)
