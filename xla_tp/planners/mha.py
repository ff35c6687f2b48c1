"""``nn.MultiheadAttention`` with its packed projection head-aligned and heads kept explicit.

torch's forward folds heads into the batch (``[B*H, S, D]``) before its matmuls, hiding the head
sharding from GSPMD, and ``in_proj_weight [3E, E]`` split on dim 0 is not head-aligned. Here
``in_proj_weight`` becomes ``[3, E, E]`` (bias ``[3, E]``), sharded on its E (heads) dimension, and
the forward is einsums over ``[B, H, S, D]``: with ``out_proj`` split on its input dimension the
block needs one all-reduce. Same semantics as torch's: ``batch_first`` either way, unbatched
inputs, boolean or float ``attn_mask`` (``[L, S]`` or ``[B*H, L, S]``) and ``key_padding_mask``,
``is_causal`` as a hint for ``attn_mask``, dropout in training, ``need_weights`` (averaged or per
head). Example::

    pack_mha(mha)                                   # mha.in_proj_weight.shape == (3, E, E)
    out, _ = mha(x, x, x, need_weights=False)       # same values as before
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .packed import relayout_param


def packable(mha: nn.MultiheadAttention) -> bool:
    """Packed q/k/v of one embedding size, no ``add_bias_kv``/``add_zero_attn`` extras."""
    return (mha.in_proj_weight is not None and mha.bias_k is None and not mha.add_zero_attn
            and mha.embed_dim % mha.num_heads == 0)


def pack_mha(mha: nn.MultiheadAttention) -> bool:
    """Re-lay ``in_proj_weight``/``in_proj_bias`` as ``[3, E, E]``/``[3, E]`` and swap in the einsum
    forward; idempotent. torch's fused fast paths read the ``[3E, E]`` layout, so they are turned
    off (``_qkv_same_embed_dim = False``). Example: ``pack_mha(layer.self_attn)``."""
    if not packable(mha):
        return False
    e = mha.embed_dim
    changed = relayout_param(mha, "in_proj_weight", (3, e, e))
    if mha.in_proj_bias is not None:
        changed |= relayout_param(mha, "in_proj_bias", (3, e))
    mha._qkv_same_embed_dim = False
    if not isinstance(mha, PackedMultiheadAttention):
        mha.__class__ = _packed_class(type(mha))
    return changed


def _packed_class(cls: type) -> type:
    """``cls`` with the einsum forward: a class (not an instance attribute), so wrappers that call
    ``type(m).forward`` (``xla_tp.inference``) see it; ``isinstance`` checks still hold."""
    if cls is nn.MultiheadAttention:
        return PackedMultiheadAttention
    return type(f"Packed{cls.__name__}", (PackedMultiheadAttention, cls), {})


def _float_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """torch's convention: boolean True = not allowed (-inf); a float mask is added as it is."""
    if mask is None or mask.is_floating_point():
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _bias(b: Optional[torch.Tensor], i: int, heads: int) -> torch.Tensor | float:
    return 0.0 if b is None else b[i].view(heads, 1, -1)


def mha_forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``nn.MultiheadAttention.forward`` for a ``pack_mha`` module. Example: ``mha(q, k, v)``."""
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                           "module method `generate_square_subsequent_mask` to create this mask.")
    batched = query.dim() == 3
    if not batched:
        query, key, value = query[None], key[None], value[None]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
    elif not self.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    b, l, e = query.shape
    h, d = self.num_heads, self.head_dim
    w = self.in_proj_weight.view(3, h, d, e)
    q = torch.einsum("ble,hde->bhld", query, w[0]) + _bias(self.in_proj_bias, 0, h)
    k = torch.einsum("bse,hde->bhsd", key, w[1]) + _bias(self.in_proj_bias, 1, h)
    v = torch.einsum("bse,hde->bhsd", value, w[2]) + _bias(self.in_proj_bias, 2, h)
    scores = torch.einsum("bhld,bhsd->bhls", q, k) * d ** -0.5
    mask = _float_mask(attn_mask, scores.dtype)
    if mask is not None:
        scores = scores + (mask.view(b, h, l, -1) if mask.dim() == 3 else mask)
    pad = _float_mask(key_padding_mask, scores.dtype)
    if pad is not None:
        scores = scores + pad.view(b, 1, 1, -1)
    probs = F.dropout(torch.softmax(scores, dim=-1), p=self.dropout, training=self.training)
    out = torch.einsum("bhls,bhsd->blhd", probs, v)
    out = torch.einsum("blhd,fhd->blf", out, self.out_proj.weight.view(e, h, d))
    if self.out_proj.bias is not None:
        out = out + self.out_proj.bias
    out = out if not batched or self.batch_first else out.transpose(0, 1)
    weights = (probs.mean(dim=1) if average_attn_weights else probs) if need_weights else None
    if not batched:
        return out[0], None if weights is None else weights[0]
    return out, weights


class PackedMultiheadAttention(nn.MultiheadAttention):
    """What ``pack_mha`` turns an ``nn.MultiheadAttention`` into (it is never constructed directly)."""

    forward = mha_forward
