"""The rewrites of torch's entry points inside a parallelized forward (and only there).

Each function here takes the original and returns its replacement; ``compat`` installs them while
a model is parallelized and puts the originals back after. A replacement acts only inside a
parallelized model's forward or backward (``scope.lowering()``) and on what it concerns (XLA or
torchax tensors, parameters xla_tp marked); anywhere else it calls the original untouched, at the
cost of a Python call:

- ``sdpa``, ``matmul``, ``mha``: attention with the head dimension visible to the compiler
  (``attention``); ``layer_norm`` spelled out (torch_xla's gathers a batch split over data);
- ``embedding``: a vocabulary-split table's per-device weight gradient (``embedding``, ``tied``);
- ``linear``, ``addmm``: column groups with one input gradient (``groups``), tied LM heads
  (``tied``), and re-laid packed projections' outputs tagged for the model's own slicing (``mode``);
- ``histc``: XLA has no histogram of integers (routers and MoE auxiliary losses count expert choices
  with it): comparisons of static shape (``slots.histogram``);
- ``where``, ``nonzero``: an expert's tokens chosen by value (``torch.where(ids == e)``) in an MoE
  module that loops over its experts: a static number of positions (``selection``);
- ``getitem``: torch_xla 2.9 raises ``Value out of range`` for a slice bound past a dimension
  (``x[..., -4095:, :]`` on 16 rows, which transformers' sliding-window caches do), where the CPU
  clamps: the replacement retries clamped;
- ``keep_causal_mask``: transformers decides whether SDPA may drop its mask by reading tensors on
  the host (``padding_mask.all()``, ``q_offset == 0``); on XLA each read executes the pending graph,
  so a forward compiles as several programs: for XLA tensors the answer is "keep the mask", unread.

Rewriting the few functions that need it, rather than intercepting every op, keeps the host's trace
cost of a step near that of the same model without xla_tp. Example::

    F.scaled_dot_product_attention = sdpa(F.scaled_dot_product_attention)   # what compat does
    F.scaled_dot_product_attention(q, k, v)    # inside a parallelized forward: two einsums
"""
from __future__ import annotations

import functools
import operator
import warnings
from typing import Any, Callable, Optional

import torch

from ..dataflow.indexing import indexed_dims
from ..state import param_state
from . import attention, copies, embedding as vocab, packed, scope, selection, slots, tied, transposed
from .mode import active


def _is_xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type in ("xla", "jax")


def spelled_layer_norm(x: torch.Tensor, normalized_shape: Any, weight: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` written out (same values)."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    y = y * weight if weight is not None else y
    return y + bias if bias is not None else y


def clamp_slices(index: Any, shape: tuple[int, ...]) -> Any:
    """``index`` with out-of-range slice bounds clamped to the dims they index; None if none is.

    >>> clamp_slices((Ellipsis, slice(-4095, None), slice(None)), (2, 16, 8))
    (Ellipsis, slice(-16, None, None), slice(None, None, None))
    """
    items = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(i, slice) for i in items) or any(isinstance(i, torch.Tensor) for i in items):
        return None
    out, changed = [], False
    for i, d in zip(items, indexed_dims(items, len(shape))):
        if isinstance(i, slice) and d < len(shape):
            n = shape[d]
            start, stop = (None if b is None else max(-n, min(n, b)) for b in (i.start, i.stop))
            changed |= (start, stop) != (i.start, i.stop)
            i = slice(start, stop, i.step)
        out.append(i)
    if not changed:
        return None
    return tuple(out) if isinstance(index, tuple) else out[0]


def _lowered(original: Callable[..., Any], lowered: Callable[..., Any],
             when: Callable[[], bool] = scope.lowering) -> Callable[..., Any]:
    """``original`` that calls ``lowered`` first inside a parallelized forward (``when``; NotImplemented:
    declined)."""
    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        if when():
            out = lowered(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return original(*args, **kwargs)
    return replacement


def _sdpa(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return attention.sdpa(query, *args, **kwargs) if _is_xla(query) else NotImplemented


def _matmul(a: Any, b: Any = None, **kwargs: Any) -> Any:
    b = kwargs.get("other", b)
    if "out" in kwargs or not (_is_xla(a) and _is_xla(b)):
        return NotImplemented
    if a.dim() >= 4 and b.dim() >= 4:
        return attention.matmul_4d(a, b)
    weight = transposed.parameter_of(b)
    # ``x @ w.T`` (Falcon's ``FalconLinear``) is ``F.linear(x, w)``: the same groups, packings and copies
    return torch.nn.functional.linear(a, weight) if weight is not None else NotImplemented


def _mha(*args: Any, **kwargs: Any) -> Any:
    bound = dict(zip(attention.MHA_ARGS, args), **kwargs)
    if not _is_xla(bound["query"]) or not attention.mha_supported(bound):
        return NotImplemented
    return attention.mha(**bound)


def _layer_norm(x: Any, *args: Any, **kwargs: Any) -> Any:
    return spelled_layer_norm(x, *args, **kwargs) if _is_xla(x) else NotImplemented


def _histc(x: Any, bins: int = 100, min: float = 0, max: float = 0, **kwargs: Any) -> Any:
    return slots.histogram(x, bins, min, max) if _is_xla(x) and not kwargs else NotImplemented


def histc(original: Callable[..., Any]) -> Callable[..., Any]:
    """Inside a parallelized model, its unsharded reference (the audit's) included: it is not a layout."""
    return _lowered(original, _histc, when=scope.inside)


def where(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.where(mask)`` inside a selection site (an MoE module that loops over its experts):
    static positions (``selection``)."""
    return _lowered(original, selection.where)


def nonzero(original: Callable[..., Any]) -> Callable[..., Any]:
    """``nonzero(as_tuple=True)``: as ``where``."""
    return _lowered(original, selection.nonzero)


def sdpa(original: Callable[..., Any]) -> Callable[..., Any]:
    return _lowered(original, _sdpa)


def matmul(original: Callable[..., Any]) -> Callable[..., Any]:
    return _lowered(original, _matmul)


def mha(original: Callable[..., Any]) -> Callable[..., Any]:
    return _lowered(original, _mha)


def layer_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    return _lowered(original, _layer_norm)


def embedding(original: Callable[..., Any]) -> Callable[..., Any]:
    return _lowered(original, vocab.lookup)


def _projected(y: torch.Tensor, weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    """A projection's output; a re-laid packed one's tagged for the packed-output mode, or (outside
    the modules that slice it, where nothing would read the tag) put back in the original order. A
    weight re-laid along the features it contracts (a row projection's zero inputs), or padded in one
    block at its end, gives an output in its plain order: no tag."""
    packing = packed.packing_of(weight)
    if packing is None or not packing.relays_output(out_dim):
        return y
    if scope.in_site():
        return active().tag(y, packing)
    warnings.warn("xla_tp: a re-laid packed projection is read outside the module that slices it; its "
                  "output is put back in the original order, which moves data between devices", stacklevel=3)
    return packed.unpermute(y, packing)


def linear(original: Callable[..., Any]) -> Callable[..., Any]:
    """``F.linear``: column groups, tied heads and packed outputs of parallelized parameters."""
    @functools.wraps(original)
    def lowered_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        ps = param_state(weight)
        if ps is None or not scope.lowering():
            return original(x, weight, bias)
        out = ps.group.output(x, weight, bias) if ps.group is not None else None
        if out is None and ps.tie is not None:
            out = tied.head(x, weight, bias)
        if out is None:  # copied blocks' copies get the sum of their gradients
            out = original(x, copies.summed(weight, ps.packing), copies.summed(bias, packed.packing_of(bias)))
        return _projected(out, weight, 0)
    return lowered_linear


def addmm(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.addmm(bias, x, weight)`` (HF ``Conv1D``): packed outputs of parallelized parameters."""
    @functools.wraps(original)
    def lowered_addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if param_state(mat2) is None or "out" in kwargs or not scope.lowering():
            return original(input, mat1, mat2, *args, **kwargs)
        summed = copies.summed(input, packed.packing_of(input)), copies.summed(mat2, packed.packing_of(mat2))
        return _projected(original(summed[0], mat1, summed[1], *args, **kwargs), mat2, 1)
    return lowered_addmm


def getitem(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.__getitem__``, retried with clamped slice bounds where torch_xla refuses them."""
    @functools.wraps(original)
    def lowered_getitem(self: torch.Tensor, index: Any) -> Any:
        if torch.compiler.is_compiling():  # dynamo records ``x[index]`` itself (and cannot call the builtin)
            return operator.getitem(self, index)
        try:
            return original(self, index)
        except RuntimeError as error:
            if not (scope.inside() and _is_xla(self) and "out of range" in str(error)):
                raise
            fixed = clamp_slices(index, tuple(self.shape))
            if fixed is None:
                raise
            return original(self, fixed)
    return lowered_getitem


def keep_causal_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``_ignore_causal_mask_sdpa``: False for XLA tensors (the mask is kept, as when
    tracing), without reading them; the same result either way, the mask being causal."""
    @functools.wraps(original)
    def unread(padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, *args: Any, **kwargs: Any) -> bool:
        if scope.inside() and (_is_xla(padding_mask) or _is_xla(q_offset)):
            return False
        return original(padding_mask, q_length, kv_length, q_offset, *args, **kwargs)
    return unread
