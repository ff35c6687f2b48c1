"""HF decoder LMs (Llama, Mistral, Qwen2/3, Gemma, Granite, Cohere, ...): Megatron layout.

Recognised by ``self_attn.{q,k,v,o}_proj`` and ``mlp.down_proj`` Linears. q/k/v and gate/up are
column-parallel (heads split), o/down row-parallel: one all-reduce after attention, one after the
MLP. The token embedding is vocab-parallel (one all-reduce), ``lm_head`` column-parallel with
vocab-sharded logits (loss-parallel friendly, no gather); tied weights get the same spec. Norms are
replicated. Key/value heads fewer than the axis: k/v replicated. Example::

    plan = plan(LlamaForCausalLM(cfg), tp=4)
    plan["model.layers.*.self_attn.q_proj"]   # ColwiseParallel()
"""
from __future__ import annotations

from .prepare import prepare_for_xla
from .table import LinearFamily

TABLE = (
    ("embed_tokens", "vocab"),
    ("self_attn.q_proj", "col_heads"), ("self_attn.k_proj", "col_kv"),
    ("self_attn.v_proj", "col_kv"), ("self_attn.o_proj", "row_heads"),
    ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"), ("mlp.down_proj", "row"),
    ("lm_head", "head"),
)

FAMILY = LinearFamily("hf_decoder", TABLE, probes=("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"),
                      prepare=prepare_for_xla)
detect, plan = FAMILY.detect, FAMILY.plan
