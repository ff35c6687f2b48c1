"""GPT-2 (HF ``Conv1D`` weights ``[in, out]``; ``c_attn`` packs q, k and v).

Recognised by ``attn.c_attn`` and ``mlp.c_fc`` Conv1D modules. The MLP is Megatron-split
(``c_fc`` weight dim 1, ``mlp.c_proj`` dim 0); the token embedding and the tied ``lm_head`` are
vocab-parallel. The attention block stays replicated. Measured on a 2x4 mesh (2 layers, 8 heads):
a plain dim-1 split of ``c_attn`` gives device i columns of q only, and GSPMD repairs the
``split`` with 7 collective-permutes per layer; a reshape-aware ``[B, S, 3, H, D]`` output
constraint adds 2 all-gathers per layer on top; storing the columns reordered per device turns
the permutes into all-to-alls. Replicated attention needs no communication at all. Example::

    plan = plan(GPT2LMHeadModel(cfg), tp=4)
    plan["transformer.h.*.mlp.c_fc"]        # ShardParams(weight (None, tp), bias (tp,))
"""
from __future__ import annotations

from torch import nn

from .plan import Plan
from .prepare import prepare_for_xla
from .structure import config_heads, is_conv1d
from .table import build_plan

FAMILY = "gpt2"
TABLE = (("wte", "vocab"), ("mlp.c_fc", "conv_col"), ("mlp.c_proj", "conv_row"), ("lm_head", "head"))
PACKED = ("packed q/k/v (c_attn [in, 3E]): a head-aligned split needs collective-permutes under "
          "GSPMD (measured 7 per layer); attention replicated instead")
REPLICATE = (("attn.c_attn", PACKED), ("attn.c_proj", PACKED))


def detect(model: nn.Module) -> bool:
    """``attn.c_attn`` and ``mlp.c_fc`` are Conv1D-like (``[in, out]`` weights)."""
    found = {s: False for s in ("attn.c_attn", "mlp.c_fc")}
    for fqn, mod in model.named_modules():
        for s in found:
            found[s] |= fqn.endswith("." + s) and is_conv1d(mod)
    return all(found.values())


def plan(model: nn.Module, tp: int) -> Plan:
    """MLP and vocabulary sharded, attention replicated (see the module docstring)."""
    return build_plan(model, TABLE, tp, FAMILY, heads=config_heads(model), replicate=REPLICATE,
                      prepare=prepare_for_xla)
