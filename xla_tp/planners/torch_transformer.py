"""torch's ``nn.MultiheadAttention`` and ``nn.Transformer{Encoder,Decoder}Layer``.

Recognised by ``nn.MultiheadAttention`` modules (packed ``in_proj_weight [3E, E]``). The packed
projection is split on dim 0 and ``out_proj`` on dim 1; the feed-forward ``linear1``/``linear2``
pair is Megatron-split. torch's MHA forward folds heads into the batch (``[B*H, S, D]``) before
its matmuls, which hides the head sharding from GSPMD, so this plan saves memory but the compiled
attention still communicates (the tests state the measured counts). Example::

    plan = plan(nn.TransformerEncoderLayer(64, 8), tp=4)
    sorted(plan)    # ['linear1', 'linear2', 'self_attn']
"""
from __future__ import annotations

from torch import nn

from .plan import Plan
from .prepare import prepare_for_xla
from .table import build_plan

FAMILY = "torch_transformer"


def detect(model: nn.Module) -> bool:
    """Any ``nn.MultiheadAttention`` with a packed ``in_proj_weight``."""
    return any(isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None for m in model.modules())


def plan(model: nn.Module, tp: int) -> Plan:
    """Packed attention split by heads, feed-forward Megatron-split."""
    mha = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    table = [(f, "mha") for f, _ in mha] + [("linear1", "col"), ("linear2", "row")]
    heads = mha[0][1].num_heads
    return build_plan(model, table, tp, FAMILY, heads=(heads, heads), prepare=prepare_for_xla)
