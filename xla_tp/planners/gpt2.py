"""GPT-2 (HF ``Conv1D`` weights ``[in, out]``; ``c_attn`` packs q, k and v): Megatron layout.

Recognised by ``attn.c_attn`` and ``mlp.c_fc`` Conv1D modules. A plain dim-1 split of ``c_attn``
gives device i columns of q only (measured on a 2x4 mesh: 7 collective-permutes per layer), so each
self-attention is re-laid head-aligned (``pack_gpt2_attention``): ``c_attn.weight`` viewed
``[in, 3, E]`` (bias ``[3, E]``) and sharded on E, an einsum forward keeping heads explicit
(``[3, B, H, S, D]``), ``c_proj`` split on its input dimension: one all-reduce per block. The MLP is
Megatron-split (``c_fc`` weight dim 1, ``mlp.c_proj`` dim 0); the token embedding and the tied
``lm_head`` are vocab-parallel. ``state_dict()`` keeps the original ``[in, 3E]`` shapes. Example::

    plan = plan(GPT2LMHeadModel(cfg), tp=4)
    plan["transformer.h.*.mlp.c_fc"]        # ShardParams(weight (None, tp), bias (tp,))
    plan["transformer.h.*.attn"]            # PackedStyle(c_attn.weight (None, None, tp), ...)
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch
from torch import nn

from ..attention import einsum_attention
from torch.distributed.tensor.placement_types import Partial

from ..plan.styles import ShardParams
from .packed import PackedStyle, attach_relayout, relayout_param
from .plan import Plan
from .prepare import prepare_for_xla
from .structure import config_heads, is_conv1d
from .table import Role, build_plan

FAMILY = "gpt2"
C_PROJ = {"c_proj.weight": ("tp", None), "c_proj.bias": (None,)}
ATTN = Role(PackedStyle(
    ShardParams({"c_attn.weight": (None, None, "tp"), "c_attn.bias": (None, "tp"), **C_PROJ},
                natural_output=Partial()),
    ShardParams({"c_attn.weight": (None, "tp"), "c_attn.bias": ("tp",), **C_PROJ}, natural_output=Partial())),
    (("c_proj.weight", 0),), heads="q")
TABLE = (("wte", "vocab"), ("attn", ATTN), ("mlp.c_fc", "conv_col"), ("mlp.c_proj", "conv_row"),
         ("lm_head", "head"))


def detect(model: nn.Module) -> bool:
    """``attn.c_attn`` and ``mlp.c_fc`` are Conv1D-like (``[in, out]`` weights)."""
    found = {s: False for s in ("attn.c_attn", "mlp.c_fc")}
    for fqn, mod in model.named_modules():
        for s in found:
            found[s] |= fqn.endswith("." + s) and is_conv1d(mod)
    return all(found.values())


def plan(model: nn.Module, tp: int) -> Plan:
    """Attention re-laid head-aligned, MLP and vocabulary sharded (see the module docstring)."""
    built = build_plan(model, TABLE, tp, FAMILY, heads=config_heads(model), prepare=prepare_for_xla)
    return attach_relayout(built, pack_gpt2_attention)


def pack_gpt2_attention(attn: nn.Module) -> bool:
    """Re-lay ``attn.c_attn`` as ``[in, 3, E]``/``[3, E]`` and swap in the einsum forward; idempotent.
    Cross-attention blocks (``c_attn`` packs only k, v) are left as they are. Example:
    ``pack_gpt2_attention(model.transformer.h[0].attn)``."""
    c_attn, e = attn.c_attn, attn.embed_dim
    if getattr(attn, "is_cross_attention", False) or getattr(c_attn, "nf", None) != 3 * e:
        return False
    changed = relayout_param(c_attn, "weight", (-1, 3, e)) | relayout_param(c_attn, "bias", (3, e))
    attn.forward = types.MethodType(gpt2_attention_forward, attn)
    return changed


def gpt2_attention_forward(self: nn.Module, hidden_states: torch.Tensor, past_key_values: Any = None,
                           attention_mask: Optional[torch.Tensor] = None,
                           encoder_hidden_states: Optional[torch.Tensor] = None,
                           encoder_attention_mask: Optional[torch.Tensor] = None,
                           output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """``GPT2Attention.forward`` (self-attention) for a packed module; q, k, v ``[B, H, S, D]``.

    Example: ``out, probs = attn(hidden_states, attention_mask=mask)``.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    h, d = self.num_heads, self.head_dim
    w = self.c_attn.weight.view(-1, 3, h, d)
    q, k, v = (torch.einsum("bsi,ithd->tbhsd", hidden_states, w)
               + self.c_attn.bias.view(3, 1, h, 1, d)).unbind(0)
    if past_key_values is not None:
        cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        k, v = cache.update(k, v, self.layer_idx)
    attend = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, einsum_attention)
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attn_dropout.p if self.training else 0.0,
                          scaling=self.scaling, **kwargs)
    out = self.c_proj(out.reshape(*out.shape[:-2], -1))
    return self.resid_dropout(out), weights
