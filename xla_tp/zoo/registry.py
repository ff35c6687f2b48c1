"""Tiny models by name, built from configs (no hub download), at two widths.

Names: llama, mistral, qwen2, qwen3, gemma, gpt2, bert, roberta, torch_encoder, torch_mha, mlp,
titan_llama; widths ``"tiny"`` (hidden 64, 8 heads) and ``"small"`` (hidden 128, 8 heads). A path
to a local ``config.json`` (or a directory holding one) builds that architecture, randomly
initialised. Example::

    model = build("qwen2", width="tiny", kv_heads=2)
    model = build("/path/to/config.json")
"""
from __future__ import annotations

import os
from typing import Callable

from torch import nn

WIDTHS = {"tiny": 64, "small": 128}
HEADS, VOCAB, LAYERS = 8, 128, 2


def _decoder(config_name: str) -> Callable[..., nn.Module]:
    def make(h: int, kv_heads: int, layers: int) -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_name)(
            hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=HEADS,
            num_key_value_heads=kv_heads, head_dim=h // HEADS, vocab_size=VOCAB, max_position_embeddings=64)
        return transformers.AutoModelForCausalLM.from_config(cfg)
    return make


def _gpt2(h: int, kv_heads: int, layers: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_embd=h, n_layer=layers, n_head=HEADS, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=0, eos_token_id=0))


def _encoder(config_name: str) -> Callable[..., nn.Module]:
    def make(h: int, kv_heads: int, layers: int) -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_name)(
            hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=HEADS,
            vocab_size=VOCAB, max_position_embeddings=72, pad_token_id=1)
        return transformers.AutoModelForMaskedLM.from_config(cfg)
    return make


def _torch_encoder(h: int, kv_heads: int, layers: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(h, HEADS, dim_feedforward=2 * h, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _torch_mha(h: int, kv_heads: int, layers: int) -> nn.Module:
    return nn.MultiheadAttention(h, HEADS, batch_first=True)


def _mlp(h: int, kv_heads: int, layers: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h), nn.Linear(h, 2 * h),
                         nn.ReLU(), nn.Linear(2 * h, h))


def _titan(h: int, kv_heads: int, layers: int) -> nn.Module:
    from .llama import Llama, LlamaArgs
    return Llama(LlamaArgs(dim=h, n_layers=layers, n_heads=HEADS, n_kv_heads=kv_heads, vocab_size=VOCAB))


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "llama": _decoder("LlamaConfig"), "mistral": _decoder("MistralConfig"),
    "qwen2": _decoder("Qwen2Config"), "qwen3": _decoder("Qwen3Config"), "gemma": _decoder("GemmaConfig"),
    "gpt2": _gpt2, "bert": _encoder("BertConfig"), "roberta": _encoder("RobertaConfig"),
    "torch_encoder": _torch_encoder, "torch_mha": _torch_mha, "mlp": _mlp, "titan_llama": _titan,
}


def from_config_path(path: str) -> nn.Module:
    """A randomly initialised model of the architecture a local ``config.json`` describes."""
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(os.path.dirname(path) if path.endswith(".json") else path)
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    if arch and hasattr(transformers, arch):
        return getattr(transformers, arch)._from_config(cfg)
    return transformers.AutoModel.from_config(cfg)


def build(name: str, width: str = "tiny", kv_heads: int = HEADS, layers: int = LAYERS) -> nn.Module:
    """A tiny model by registry name (see ``BUILDERS``) or from a local config path."""
    if os.path.exists(name):
        return from_config_path(name)
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(BUILDERS)} or a path to a config.json")
    return BUILDERS[name](WIDTHS[width], kv_heads, layers).eval()
