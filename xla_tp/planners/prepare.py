"""XLA-friendly forwards that keep shardings visible to GSPMD, with unchanged numerics.

- HF attention -> two einsums (``xla_tp.attention``): eager/sdpa all-gather q, k, v.
- ``nn.LayerNorm`` -> mean/variance written out: torch_xla lowers ``native_layer_norm`` through a
  ``[1, B*S, E]`` reshape that all-gathers a batch sharded over the data axis (measured on GPT-2,
  2x4 mesh: one all-gather per norm; none with this forward).

Example::

    prepare_for_xla(model)   # model.config._attn_implementation == "xla_einsum" for HF models
"""
from __future__ import annotations

import types

import torch
from torch import nn

from ..attention import use_einsum_attention


def layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``nn.LayerNorm`` over the last dims, spelled out. Example: ``layer_norm_forward(ln, x)``."""
    dims = tuple(range(-len(self.normalized_shape), 0))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + self.eps)
    if self.weight is not None:
        y = y * self.weight
    return y + self.bias if self.bias is not None else y


def prepare_for_xla(model: nn.Module) -> None:
    """Einsum attention for transformers models; spelled-out LayerNorm everywhere. Idempotent."""
    use_einsum_attention(model)
    for mod in model.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.forward = types.MethodType(layer_norm_forward, mod)
