"""Tiny models of every family the bench compares, each at two widths, with the plan users hold.

``build(family, width)`` -> ``(cpu model, token batch, HF-style plan)``. HF models use their own
``tp_plan`` where they have one (Llama, Qwen3); GPT-2, BERT and torch's encoder have none, so the
plan is the Megatron one a user would write. Example::

    model, tokens, plan = build("llama", 64)
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .plans import hf_plan

FAMILIES = ("titan_llama", "llama", "qwen3", "gpt2", "bert", "torch_encoder")
WIDTHS = (64, 128)
BATCH, SEQ, VOCAB, LAYERS, HEADS = 8, 16, 256, 2, 8


def _hf(config_name: str, model_name: str, kw: Callable[[int], dict]) -> Callable[[int], nn.Module]:
    def make(width: int) -> nn.Module:
        import transformers
        config = getattr(transformers, config_name)(**kw(width))
        return getattr(transformers, model_name)(config).eval()
    return make


def _decoder_kw(width: int) -> dict:
    return dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB, head_dim=width // HEADS)


class Encoder(nn.Module):
    """torch's ``nn.TransformerEncoder`` over an embedding: ``forward(tokens) -> [B, S, width]``."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, HEADS, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(tokens))


def _titan(width: int) -> nn.Module:
    from xla_tp.zoo.llama import Llama, LlamaArgs
    return Llama(LlamaArgs(dim=width, n_heads=HEADS, vocab_size=VOCAB, n_layers=LAYERS))


BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "titan_llama": _titan,
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", kw=_decoder_kw),
    "qwen3": _hf("Qwen3Config", "Qwen3ForCausalLM", kw=_decoder_kw),
    "gpt2": _hf("GPT2Config", "GPT2LMHeadModel", kw=lambda w: dict(
        n_embd=w, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": _hf("BertConfig", "BertModel", kw=lambda w: dict(
        hidden_size=w, intermediate_size=4 * w, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "torch_encoder": Encoder,
}

MEGATRON_PLANS = {
    "titan_llama": {**{f"layers.*.attention.{n}": "colwise" for n in ("wq", "wk", "wv")},
                    **{f"layers.*.feed_forward.{n}": "colwise" for n in ("w1", "w3")},
                    "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w2": "rowwise"},
    "gpt2": {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"},
    "bert": {**{f"encoder.layer.*.attention.self.{n}": "colwise" for n in ("query", "key", "value")},
             "encoder.layer.*.attention.output.dense": "rowwise",
             "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"},
    "torch_encoder": {"encoder.layers.*.linear1": "colwise", "encoder.layers.*.linear2": "rowwise",
                      "encoder.layers.*.self_attn.out_proj": "rowwise"},
}


def build(family: str, width: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, dict[str, str]]:
    """A fresh CPU model, a token batch and its plan (HF's own when it has one)."""
    torch.manual_seed(seed)
    model = BUILDERS[family](width)
    plan = MEGATRON_PLANS.get(family) or hf_plan(model)
    return model, torch.randint(0, VOCAB, (BATCH, SEQ)), plan
