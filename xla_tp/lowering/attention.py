"""Attention written so the compiler sees the head dimension: SDPA, 4-D matmuls and torch's MHA.

XLA lowers a batched 4-D ``matmul`` (and so SDPA's math and HF's eager attention) through a
reshape that merges batch and heads, which hides a head sharding from GSPMD: it then all-gathers
q, k and v and runs attention replicated. ``torch.einsum`` keeps every batch dimension of the
contraction (``dot_general`` batch dims), so the heads stay split. Numerics are those of the
original ops: SDPA's scale, causal flag (top-left aligned), boolean (True = attend) or additive
mask, ``enable_gqa``, dropout; softmax in float32; a query that the mask lets attend to no key (a
left-padded position) gets zeros, as torch's SDPA gives it, not NaN. On TPU,
``use_flash_attention(True)`` routes SDPA calls the Pallas kernel can take to torch_xla's
``flash_attention`` with the partition spec of the mesh, or under a context split to the splash kernel
per query block (``context_flash``). Example:

>>> q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
>>> want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
>>> (sdpa(q, k, v, is_causal=True, enable_gqa=True) - want).abs().max() < 1e-6
tensor(True)
>>> torch.allclose(matmul_4d(q, q.transpose(-1, -2)), torch.matmul(q, q.transpose(-1, -2)), atol=1e-6)
True
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..axes import mesh_axes, spec_entry
from . import context_flash, scope
from .context import context_split, splits_queries
from .copies import as_kv_heads
from .packed import output_blocks, packed_blocks, packing_of

_FLASH = {"enabled": False, "interpret": False, "balance": True}
_masks = threading.local()
_chunks = threading.local()  # the block-diagonal mask of a batch of unequal chunks (lowering.chunks)


def use_flash_attention(enabled: bool = True, interpret: bool = False, balance: bool = True) -> None:
    """Route eligible SDPA calls to Pallas flash attention (TPU only; einsum elsewhere): torch_xla's
    ``flash_attention``, or under a context split the splash kernel per query block (``context_flash``).
    ``interpret`` (for tests) runs the latter in Pallas' interpreter, on any device. ``balance`` (the
    default) runs a causal call there on two mirrored chunks per device, so each computes as many blocks
    (four collective-permutes of queries and outputs per layer forward, four more backward); ``False`` keeps
    each device's contiguous queries."""
    _FLASH["enabled"], _FLASH["interpret"], _FLASH["balance"] = bool(enabled), bool(interpret), bool(balance)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., KV, S, D] -> [..., heads, S, D]`` with each key/value head repeated for its query group."""
    kv = x.shape[-3]
    return x if kv == heads else x.repeat_interleave(heads // kv, dim=-3)


def flash_eligible(q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float) -> bool:
    """The kernel takes 4-D q/k/v on a TPU, no dropout, and an additive mask at most."""
    if not _FLASH["enabled"] or dropout_p or q.dim() != 4 or k.dim() != 4:
        return False
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        return False
    import torch_xla.runtime as xr
    return xr.device_type() == "TPU"


def flash_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
               is_causal: bool, scale: float) -> dict[str, Any]:
    """The keyword arguments xla_tp passes to ``torch_xla...custom_kernel.flash_attention``: q/k/v with
    the key/value heads repeated, the mask as ``ab`` ([B, H, L, S]), and the mesh and partition spec of
    the parallelized model running (``LOGICAL_AXES``: batch over the batch axes, heads over its
    tensor-parallel axis)."""
    heads = q.shape[1]
    state = scope.current()
    mesh = state.mesh if state is not None else None
    spec = None
    if mesh is not None:
        sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.mesh_shape)))
        spec = (spec_entry(mesh_axes("batch", sizes)), spec_entry(mesh_axes("heads", sizes, state.layout.tp_axis)),
                None, None)
    ab = None if attn_mask is None else attn_mask.to(q.dtype).expand(q.shape[0], heads, q.shape[2], k.shape[2])
    return dict(q=q, k=_repeat_heads(k, heads), v=_repeat_heads(v, heads), causal=is_causal, sm_scale=scale,
                ab=ab, partition_spec=spec, mesh=mesh)


def chunks_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``mask`` (``[blocks, 1, rows, rows]``) taken by the attention of the batch of unequal chunks
    ``lowering.chunks`` just made, which the model calls with no mask; the one pending before, if no attention
    took it (None: none pending)."""
    before, _chunks.mask = getattr(_chunks, "mask", None), mask
    return before


def _chunked(query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``attn_mask``, or the pending block-diagonal mask of chunks (``chunks_mask``) when there is none and the
    attention's queries and keys are its batch of chunks (the mask is then taken)."""
    mask = getattr(_chunks, "mask", None)
    if (attn_mask is not None or mask is None or query.dim() != 4 or query.shape[0] != mask.shape[0]
            or query.shape[-2] != mask.shape[-2] or key.shape[-2] != mask.shape[-1]):
        return attn_mask
    _chunks.mask = None
    return mask.to(query.device)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as two einsums (or the flash kernel on TPU, see the module)."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    attn_mask = _chunked(query, key, attn_mask)
    split = splits_queries(query)
    if split and _FLASH["enabled"] and (enable_gqa or key.shape[-3] == query.shape[-3]):
        blocks = context_flash.plan(query, key, attn_mask, dropout_p, is_causal, scale, _FLASH["interpret"],
                                    _FLASH["balance"])
        if blocks is not None and as_kv_heads(key) is key:
            return context_flash.attention(query, key, value, blocks)
    elif not split and flash_eligible(query, key, attn_mask, dropout_p):  # its one spec would gather a split
        from torch_xla.experimental.custom_kernel import flash_attention
        return flash_attention(**flash_call(query, key, value, attn_mask, is_causal, scale))
    return einsum_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def einsum_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's math with both contractions as einsums (batch and head dims kept). A key/value block every
    device holds a copy of (``copies``) is one head per device, each device's query heads reading its own."""
    heads = as_kv_heads(key)  # one key/value block copied per device: a key/value head each
    if heads is not key:
        key, value, enable_gqa = heads, as_kv_heads(value), True
    query, key, value, attn_mask = context_split(query, key, value, attn_mask)
    if enable_gqa:
        key, value = _repeat_heads(key, query.shape[-3]), _repeat_heads(value, query.shape[-3])
    scores = torch.einsum("...qd,...kd->...qk", query, key)
    scores = (scores if scores.dtype == torch.float32 else scores.float()) * scale
    if is_causal:
        scores = scores.masked_fill(_future(query.shape[-2], key.shape[-2], query.device), float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    probs = torch.softmax(scores, dim=-1)
    if attn_mask is not None:  # torch's SDPA gives a row with no key to attend to zeros (a left-padded row), not NaN
        probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    probs = probs if probs.dtype == value.dtype else probs.to(value.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.einsum("...qk,...kd->...qd", probs, value)


def _future(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """The causal mask's excluded positions (``j > i``), made once per parallelized forward and shape."""
    if scope.depth() == 0:  # no forward end to forget it at (a context_parallel block): made for this call
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(1)
    masks = getattr(_masks, "cache", None)
    if masks is None:
        masks = _masks.cache = {}
    key = (q_len, k_len, str(device))
    if key not in masks:
        if not masks:
            scope.on_exit(masks.clear)
        masks[key] = torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(1)
    return masks[key]


def matmul_4d(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul`` of two tensors of rank >= 4, batch dims kept visible."""
    return torch.einsum("...nk,...km->...nm", a, b)


def _float_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """torch's MHA convention: boolean True = not allowed (-inf); a float mask is added as it is."""
    if mask is None or mask.is_floating_point():
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def mha_supported(kwargs: dict) -> bool:
    """What ``mha`` implements: packed or separate same-size q/k/v, no bias_k/bias_v, zero-attention or static k/v."""
    return (kwargs.get("bias_k") is None and not kwargs.get("add_zero_attn") and kwargs.get("static_k") is None
            and kwargs.get("static_v") is None and not kwargs.get("use_separate_proj_weight"))


MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
            "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
            "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
            "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")


def mha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int, in_proj_weight: torch.Tensor,
        in_proj_bias: Optional[torch.Tensor], dropout_p: float, out_proj_weight: torch.Tensor,
        out_proj_bias: Optional[torch.Tensor], training: bool = True, key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True, attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
        is_causal: bool = False, **unused: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``F.multi_head_attention_forward`` (sequence-first ``[L, B, E]`` or unbatched ``[L, E]``) as einsums
    over ``[B, H, L, D]``; a packed ``in_proj_weight`` re-laid by xla_tp is read block by block."""
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                           "module method `generate_square_subsequent_mask` to create this mask.")
    batched = query.dim() == 3
    if not batched:
        query, key, value = query[:, None], key[:, None], value[:, None]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
    length, batch, embed = query.shape
    h = num_heads
    d = embed // h
    if query is key and key is value:  # self-attention: one projection, so one partial input gradient to reduce
        y = torch.einsum("lbe,ce->lbc", query, in_proj_weight)  # not F.linear: it merges [L, B] (B split: gathered)
        y = y if in_proj_bias is None else y + in_proj_bias
        qkv = output_blocks(y, packing_of(in_proj_weight), 3)
        q, k, v = (t.unflatten(-1, (h, d)).permute(1, 2, 0, 3) for t in qkv)
    else:
        wq, wk, wv = (w.view(h, d, embed) for w in packed_blocks(in_proj_weight, 3))
        bq, bk, bv = (0.0, 0.0, 0.0) if in_proj_bias is None else (b.view(h, 1, d) for b in packed_blocks(in_proj_bias, 3))
        q = torch.einsum("lbe,hde->bhld", query, wq) + bq
        k = torch.einsum("sbe,hde->bhsd", key, wk) + bk
        v = torch.einsum("sbe,hde->bhsd", value, wv) + bv
    scores = torch.einsum("bhld,bhsd->bhls", q, k) * d ** -0.5
    mask = _float_mask(attn_mask, scores.dtype)
    if mask is not None:
        scores = scores + (mask.view(batch, h, length, -1) if mask.dim() == 3 else mask)
    pad = _float_mask(key_padding_mask, scores.dtype)
    if pad is not None:
        scores = scores + pad.view(batch, 1, 1, -1)
    probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p, training=training)
    out = torch.einsum("bhls,bhsd->lbhd", probs, v)
    out = torch.einsum("lbhd,fhd->lbf", out, out_proj_weight.view(embed, h, d))
    if out_proj_bias is not None:
        out = out + out_proj_bias
    weights = (probs.mean(dim=1) if average_attn_weights else probs) if need_weights else None
    if not batched:
        return out[:, 0], None if weights is None else weights[0]
    return out, weights
