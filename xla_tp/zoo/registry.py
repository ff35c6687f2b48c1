"""Tiny models by name, built from configs (no hub download), at two widths, with example inputs.

Names: llama, mistral, qwen2, qwen3, gemma, gemma2, granite, cohere, gpt2, bert, roberta, torch_encoder, torch_mha, mlp,
titan_llama; widths ``"tiny"`` (hidden 64, 8 heads) and ``"small"`` (hidden 128, 8 heads). A path
to a local ``config.json`` (or a directory holding one) builds that architecture, randomly
initialised. HF models come with their task head (causal / masked LM) unless ``head=False``.
``example_input`` is a batch the model takes (token ids, or ``[B, S, H]`` floats for
torch_encoder, torch_mha and mlp); ``run`` calls a model on it and returns its main output.
Example::

    model = build("qwen2", width="tiny", kv_heads=2)
    logits = run(model, example_input("qwen2"))      # [4, 16, VOCAB]
    model = build("/path/to/config.json")
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch
from torch import nn

WIDTHS = {"tiny": 64, "small": 128}
HEADS, VOCAB, LAYERS = 8, 128, 2


def _hf(config_name: str, auto_class: str, kw: Callable[[int, int, int], dict]) -> Callable[..., nn.Module]:
    """Builds ``config_name(**kw(h, kv_heads, layers))`` as ``auto_class`` (``head=False``: base model)."""
    def make(h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_name)(**kw(h, kv_heads, layers))
        return getattr(transformers, auto_class if head else "AutoModel").from_config(cfg)
    return make


def _decoder(config_name: str) -> Callable[..., nn.Module]:
    return _hf(config_name, "AutoModelForCausalLM", lambda h, kv_heads, layers: dict(
        hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=kv_heads, head_dim=h // HEADS, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=None))


def _encoder(config_name: str) -> Callable[..., nn.Module]:
    return _hf(config_name, "AutoModelForMaskedLM", lambda h, kv_heads, layers: dict(
        hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=HEADS,
        vocab_size=VOCAB, max_position_embeddings=72, pad_token_id=1))


_gpt2 = _hf("GPT2Config", "AutoModelForCausalLM", lambda h, kv_heads, layers: dict(
    n_embd=h, n_layer=layers, n_head=HEADS, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0))


def _torch_encoder(h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
    layer = nn.TransformerEncoderLayer(h, HEADS, dim_feedforward=2 * h, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _torch_mha(h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
    return nn.MultiheadAttention(h, HEADS, batch_first=True)


def _mlp(h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h), nn.Linear(h, 2 * h),
                         nn.ReLU(), nn.Linear(2 * h, h))


def _titan(h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
    from .llama import Llama, LlamaArgs
    return Llama(LlamaArgs(dim=h, n_layers=layers, n_heads=HEADS, n_kv_heads=kv_heads, vocab_size=VOCAB))


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "llama": _decoder("LlamaConfig"), "mistral": _decoder("MistralConfig"),
    "qwen2": _decoder("Qwen2Config"), "qwen3": _decoder("Qwen3Config"), "gemma": _decoder("GemmaConfig"),
    "gemma2": _decoder("Gemma2Config"), "granite": _decoder("GraniteConfig"), "cohere": _decoder("CohereConfig"),
    "gpt2": _gpt2, "bert": _encoder("BertConfig"), "roberta": _encoder("RobertaConfig"),
    "torch_encoder": _torch_encoder, "torch_mha": _torch_mha, "mlp": _mlp, "titan_llama": _titan,
}


FLOAT_INPUTS = ("torch_encoder", "torch_mha", "mlp")  # take [B, S, H] activations, not token ids


def load_config(path: str) -> Any:
    """The HF config of a local ``config.json`` or of a directory holding one."""
    import transformers
    return transformers.AutoConfig.from_pretrained(os.path.dirname(path) if path.endswith(".json") else path)


def from_config_path(path: str) -> nn.Module:
    """A randomly initialised model of the architecture a local ``config.json`` describes."""
    import transformers
    cfg = load_config(path)
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    if arch and hasattr(transformers, arch):
        return getattr(transformers, arch)._from_config(cfg)
    return transformers.AutoModel.from_config(cfg)


def build(name: str, width: str = "tiny", kv_heads: int = HEADS, layers: int = LAYERS,
          head: bool = True) -> nn.Module:
    """A tiny model (eval mode) by registry name (see ``BUILDERS``) or from a local config path.

    ``head=False`` builds an HF family's base model (``BertModel``, not ``BertForMaskedLM``).
    """
    if os.path.exists(name):
        return from_config_path(name)
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(BUILDERS))} or a path to a config.json")
    return BUILDERS[name](WIDTHS[width], kv_heads, layers, head).eval()


def example_input(name: str, width: str = "tiny", batch: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    """A batch for ``build(name, width)``: ``[batch, seq]`` token ids (from 2: no pad/bos token),
    or ``[batch, seq, hidden]`` floats for ``FLOAT_INPUTS``. For a config path, ids below its vocab.

    ``example_input("mlp").shape == (4, 16, 64)``.
    """
    g = torch.Generator().manual_seed(seed)
    if name in FLOAT_INPUTS:
        return torch.randn(batch, seq, WIDTHS[width], generator=g)
    vocab = load_config(name).vocab_size if os.path.exists(name) else VOCAB
    return torch.randint(2, vocab, (batch, seq), generator=g)


def positional_args(model: nn.Module, x: torch.Tensor) -> tuple:
    """How ``model`` takes one batch positionally (what ``audit(model, *args)`` needs).

    Self-attention: ``(x, x, x, None, False)`` (query, key, value, no padding mask,
    ``need_weights=False``); anything else ``(x,)``.
    """
    return (x, x, x, None, False) if isinstance(model, nn.MultiheadAttention) else (x,)


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model`` on ``x``, returning its main output: logits, else the last hidden state.

    Self-attention runs as ``(x, x, x, need_weights=False)``; models with a KV cache run with
    ``use_cache=False``. ``run(build("llama"), example_input("llama")).shape == (4, 16, VOCAB)``.
    """
    forward = type(model).forward  # the class's: parallelize_xla may wrap the instance's forward
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(forward).parameters else {}
    out = model(*positional_args(model, x), **kwargs)
    for field in ("logits", "last_hidden_state"):
        if getattr(out, field, None) is not None:
            return getattr(out, field)
    return out[0] if isinstance(out, tuple) else out
