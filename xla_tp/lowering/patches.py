"""The attention entry points, rewritten inside a parallelized forward (and only there).

``F.scaled_dot_product_attention``, ``torch.matmul`` / ``Tensor.matmul`` / ``@``,
``F.multi_head_attention_forward``, ``F.layer_norm`` and ``F.embedding`` (a vocabulary-split table's
per-device weight gradient, ``embedding``) are wrapped once, process-wide, when the
first model is parallelized. The wrapper costs a Python call and one thread-local read; outside a
parallelized forward (``scope.lowering()`` false), or on non-XLA tensors, it calls the original
untouched. Inside, on XLA tensors (torch_xla's, or torchax's when the JAX backend traces), it calls
the head-visible version from ``attention``. ``Tensor.__getitem__`` is wrapped too: torch_xla 2.9
raises ``Value out of range`` for a slice bound past a dimension (``x[..., -4095:, :]`` on 16 rows,
which transformers' sliding-window caches do), where the CPU clamps; the wrapper retries clamped.

Wrapping the few functions that need it, rather than intercepting every op, keeps the host's trace
cost of a step near that of the same model without xla_tp. Example::

    install()                                  # idempotent
    F.scaled_dot_product_attention(q, k, v)    # inside a parallelized forward: two einsums
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from . import attention, embedding, scope

_INSTALLED: dict[tuple[Any, str], Callable] = {}


def _is_xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type in ("xla", "jax")


def _sdpa(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return attention.sdpa(query, *args, **kwargs) if _is_xla(query) else NotImplemented


def _matmul(a: Any, b: Any = None, **kwargs: Any) -> Any:
    b = kwargs.get("other", b)
    if "out" in kwargs or not (_is_xla(a) and _is_xla(b) and a.dim() >= 4 and b.dim() >= 4):
        return NotImplemented
    return attention.matmul_4d(a, b)


def _mha(*args: Any, **kwargs: Any) -> Any:
    bound = dict(zip(attention.MHA_ARGS, args), **kwargs)
    if not _is_xla(bound["query"]) or not attention.mha_supported(bound):
        return NotImplemented
    return attention.mha(**bound)


def layer_norm(x: torch.Tensor, normalized_shape: Any, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` written out (same values)."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    y = y * weight if weight is not None else y
    return y + bias if bias is not None else y


def _layer_norm(x: Any, *args: Any, **kwargs: Any) -> Any:
    return layer_norm(x, *args, **kwargs) if _is_xla(x) else NotImplemented


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


def _wrap(owner: Any, name: str, lowered: Callable[..., Any]) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if scope.lowering():
            out = lowered(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return original(*args, **kwargs)

    _INSTALLED[(owner, name)] = original
    setattr(owner, name, wrapper)


def _getitem_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def getitem(self: torch.Tensor, index: Any) -> Any:
        try:
            return original(self, index)
        except RuntimeError as error:
            if not (scope.lowering() and _is_xla(self) and "out of range" in str(error)):
                raise
            fixed = clamp_slices(index, tuple(self.shape))
            if fixed is None:
                raise
            return original(self, fixed)
    return getitem


def install() -> None:
    """Wrap the entry points (see the module docstring); once per process."""
    if _INSTALLED:
        return
    for owner, name, lowered in ((F, "scaled_dot_product_attention", _sdpa), (torch, "matmul", _matmul),
                                 (torch.Tensor, "matmul", _matmul), (torch.Tensor, "__matmul__", _matmul),
                                 (F, "multi_head_attention_forward", _mha), (F, "layer_norm", _layer_norm),
                                 (F, "embedding", embedding.lookup)):
        _wrap(owner, name, lowered)
    _INSTALLED[(torch.Tensor, "__getitem__")] = torch.Tensor.__getitem__
    torch.Tensor.__getitem__ = _getitem_wrapper(torch.Tensor.__getitem__)

