"""torchtitan-style Llama (``xla_tp.zoo.llama``): ``attention.w{q,k,v,o}``, ``feed_forward.w{1,2,3}``.

The same Megatron layout as the HF decoders, under torchtitan's names; its attention is already
two einsums. Example::

    plan = plan(Llama(LlamaArgs()), tp=4)
    plan["layers.*.attention.wq"]     # ColwiseParallel()
"""
from __future__ import annotations

from torch import nn

from .table import LinearFamily

TABLE = (
    ("tok_embeddings", "vocab"),
    ("attention.wq", "col_heads"), ("attention.wk", "col_kv"), ("attention.wv", "col_kv"),
    ("attention.wo", "row_heads"),
    ("feed_forward.w1", "col"), ("feed_forward.w3", "col"), ("feed_forward.w2", "row"),
    ("output", "head"),
)


def heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, key/value heads) from the attention modules' shapes."""
    for mod in model.modules():
        if hasattr(mod, "head_dim") and hasattr(mod, "wq"):
            return mod.wq.out_features // mod.head_dim, mod.wk.out_features // mod.head_dim
    return 0, 0


FAMILY = LinearFamily("titan_llama", TABLE, probes=("attention.wq", "attention.wo", "feed_forward.w2"),
                      heads=heads)
detect, plan = FAMILY.detect, FAMILY.plan
