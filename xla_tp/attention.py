"""Attention written as two ``torch.einsum`` calls, registered with transformers.

HF's eager and sdpa attention run ``matmul`` on ``[B, H, S, D]`` tensors; XLA lowers that batched
matmul through a reshape merging batch and heads, which hides the head sharding from GSPMD: every
layer then all-gathers q, k and v and runs attention replicated (README). Two einsums keep the
head dimension visible, so a column-parallel q/k/v and a row-parallel output projection compile to
the Megatron minimum of 2 all-reduces per layer. Numerics are eager attention's: same scaling,
additive or boolean mask, float32 softmax, GQA by repeating k/v heads, dropout only in training.

Example::

    from xla_tp.attention import use_einsum_attention
    use_einsum_attention(model)          # model.config._attn_implementation == "xla_einsum"
"""
from __future__ import annotations

import warnings

from typing import Any, Optional

import torch
from torch import nn

NAME = "xla_einsum"


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, KV, S, D] -> [B, KV * n_rep, S, D]``, each k/v head repeated for its query group.

    Example: ``repeat_kv(torch.zeros(1, 2, 5, 4), 3).shape == (1, 6, 5, 4)``.
    """
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def _apply_mask(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return scores
    mask = mask[..., : scores.shape[-1]]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask.to(scores.dtype)


def einsum_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                     dropout: float = 0.0, softcap: Optional[float] = None,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers attention function: q ``[B, H, Q, D]``, k/v ``[B, KV, K, D]`` -> ``[B, Q, H, D]``.

    Example::

        out, probs = einsum_attention(attn_module, q, k, v, None, scaling=0.125)
    """
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.einsum("bhqd,bhkd->bhqk", query, key) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = _apply_mask(scores, attention_mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.einsum("bhqk,bhkd->bqhd", probs, value)
    return out, probs


def register() -> str:
    """Register ``einsum_attention`` (and eager's float mask) under ``"xla_einsum"``; idempotent.

    transformers builds no mask at all for an attention name its mask interface does not know, so
    the mask function is registered too. Example: ``register() == "xla_einsum"``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, einsum_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME


def uses_attention_interface(model: nn.Module) -> bool:
    """True for a transformers model whose attention dispatches through ``AttentionInterface``."""
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "_attn_implementation") and hasattr(model, "set_attn_implementation")


def use_einsum_attention(model: nn.Module) -> bool:
    """Switch a transformers model (and its sub-configs) to einsum attention; False if it cannot.

    Example: ``use_einsum_attention(LlamaForCausalLM(cfg))`` -> True.
    """
    if not uses_attention_interface(model):
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, KeyError, NotImplementedError) as e:
        warnings.warn(f"xla_tp: {type(model).__name__} keeps its own attention ({e}); its q/k/v may be "
                      f"all-gathered and attention replicated", stacklevel=2)
        return False
    return model.config._attn_implementation == NAME
