"""torch's ``nn.MultiheadAttention`` and ``nn.Transformer{Encoder,Decoder}Layer``: Megatron layout.

Recognised by ``nn.MultiheadAttention`` modules (packed ``in_proj_weight [3E, E]``). Each packable
attention (self or cross) is re-laid head-aligned (``xla_tp.planners.mha``: ``in_proj_weight``
viewed ``[3, E, E]`` and sharded on its heads, einsum forward, ``out_proj`` split on its input
dimension) so it needs one all-reduce; the feed-forward ``linear1``/``linear2`` pair is
Megatron-split. ``state_dict()`` keeps the original ``[3E, E]`` shapes. Example::

    plan = plan(nn.TransformerEncoderLayer(64, 8), tp=4)
    sorted(plan)    # ['linear1', 'linear2', 'self_attn']
"""
from __future__ import annotations

from torch import nn

from torch.distributed.tensor.placement_types import Partial

from ..plan.styles import ShardParams
from .mha import pack_mha, packable
from .packed import PackedStyle, attach_relayout
from .plan import Plan
from .prepare import prepare_for_xla
from .table import Role, build_plan

FAMILY = "torch_transformer"
OUT_PROJ = {"out_proj.weight": (None, "tp"), "out_proj.bias": (None,)}
MHA_PACKED = Role(PackedStyle(
    ShardParams({"in_proj_weight": (None, "tp", None), "in_proj_bias": (None, "tp"), **OUT_PROJ},
                natural_output=Partial()),
    ShardParams({"in_proj_weight": ("tp", None), "in_proj_bias": ("tp",), **OUT_PROJ},
                natural_output=Partial())),
    (("out_proj.weight", 1),), heads="q")
EXTRAS = "nn.MultiheadAttention with add_bias_kv/add_zero_attn or kdim/vdim != embed_dim: no rule shards it"


def detect(model: nn.Module) -> bool:
    """Any ``nn.MultiheadAttention`` with a packed ``in_proj_weight``."""
    return any(isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None for m in model.modules())


def plan(model: nn.Module, tp: int) -> Plan:
    """Packed attention re-laid and split by heads, feed-forward Megatron-split."""
    mha = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    table = [(f, MHA_PACKED) for f, m in mha if packable(m)] + [("linear1", "col"), ("linear2", "row")]
    skipped = [(f, EXTRAS) for f, m in mha if not packable(m)]
    heads = mha[0][1].num_heads
    built = build_plan(model, table, tp, FAMILY, heads=(heads, heads), replicate=skipped,
                       prepare=prepare_for_xla)
    return attach_relayout(built, pack_mha)
