"""Tiny models by name, built from configs (no hub download), at two widths, with example inputs.

HF families (``HF_FAMILIES``): each is a transformers config class, a head (causal LM, masked LM or
the base model) and the config arguments for a hidden width ``h``, ``kv`` key/value heads and
``layers`` layers (8 attention heads, vocabulary 128). Plus torch's encoder and MultiheadAttention,
a Linear stack, the torchtitan-style Llama and the CUDA-style Llama. Widths: ``"tiny"`` (hidden 64)
and ``"small"`` (hidden 128). A path to a local ``config.json`` (or a directory holding one) builds
that architecture, randomly initialised. ``example_input`` is a batch the model takes (token ids,
or ``[B, S, H]`` floats for ``FLOAT_INPUTS``); ``run`` calls a model on it and returns its main
output. Example::

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
HEADS, VOCAB, LAYERS, POSITIONS = 8, 128, 2, 64


def _decoder(h: int, kv: int, layers: int) -> dict:
    return dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=HEADS,
                num_key_value_heads=kv, head_dim=h // HEADS, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                bos_token_id=0, eos_token_id=1, pad_token_id=None)


def _encoder(h: int, kv: int, layers: int) -> dict:
    return dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=HEADS,
                vocab_size=VOCAB, max_position_embeddings=POSITIONS + 8, pad_token_id=1)


def _gpt(h: int, kv: int, layers: int) -> dict:  # GPT-2 style names
    return dict(n_embd=h, n_layer=layers, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS, bos_token_id=0,
                eos_token_id=0)


# name -> (config class, head, config arguments(h, kv, layers)); heads: causal | masked | base | t5_encoder
HF_FAMILIES: dict[str, tuple[str, str, Callable[[int, int, int], dict]]] = {
    "llama": ("LlamaConfig", "causal", _decoder),
    "mistral": ("MistralConfig", "causal", _decoder),
    "qwen2": ("Qwen2Config", "causal", _decoder),
    "qwen3": ("Qwen3Config", "causal", _decoder),
    "gemma": ("GemmaConfig", "causal", _decoder),
    "gemma2": ("Gemma2Config", "causal", _decoder),
    "gemma3": ("Gemma3TextConfig", "causal", _decoder),
    "granite": ("GraniteConfig", "causal", _decoder),
    "cohere": ("CohereConfig", "causal", _decoder),
    "starcoder2": ("Starcoder2Config", "causal", _decoder),
    "stablelm": ("StableLmConfig", "causal", _decoder),
    "nemotron": ("NemotronConfig", "causal", _decoder),
    "glm": ("GlmConfig", "causal", lambda h, kv, n: {**_decoder(h, kv, n), "pad_token_id": 0}),
    "phi3": ("Phi3Config", "causal", lambda h, kv, n: {**_decoder(h, kv, n), "pad_token_id": 0}),
    "olmo": ("OlmoConfig", "causal", lambda h, kv, n: {**_decoder(h, HEADS, n), "pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "causal", lambda h, kv, n: {**_decoder(h, kv, n), "pad_token_id": 0}),
    "phi": ("PhiConfig", "causal", lambda h, kv, n: _decoder(h, HEADS, n)),
    "persimmon": ("PersimmonConfig", "causal", lambda h, kv, n: _decoder(h, HEADS, n)),
    "gpt_neox": ("GPTNeoXConfig", "causal", lambda h, kv, n: {**_decoder(h, HEADS, n), "use_parallel_residual": True}),
    "falcon": ("FalconConfig", "causal", lambda h, kv, n: dict(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=HEADS, num_kv_heads=kv, vocab_size=VOCAB,
        new_decoder_architecture=True, bos_token_id=0, eos_token_id=1)),
    "falcon_alibi": ("FalconConfig", "causal", lambda h, kv, n: dict(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=HEADS, vocab_size=VOCAB, alibi=True,
        multi_query=False, parallel_attn=False, new_decoder_architecture=False, bos_token_id=0, eos_token_id=1)),
    "mpt": ("MptConfig", "causal", lambda h, kv, n: dict(
        d_model=h, n_heads=HEADS, n_layers=n, vocab_size=VOCAB, expansion_ratio=2, max_seq_len=POSITIONS)),
    "gptj": ("GPTJConfig", "causal", lambda h, kv, n: {**_gpt(h, kv, n), "rotary_dim": 4}),
    "codegen": ("CodeGenConfig", "causal", lambda h, kv, n: {**_gpt(h, kv, n), "rotary_dim": 4}),
    "gpt2": ("GPT2Config", "causal", _gpt),
    "gpt_bigcode": ("GPTBigCodeConfig", "causal", lambda h, kv, n: {**_gpt(h, kv, n), "multi_query": False}),
    "opt": ("OPTConfig", "causal", lambda h, kv, n: dict(
        hidden_size=h, ffn_dim=2 * h, num_hidden_layers=n, num_attention_heads=HEADS, vocab_size=VOCAB,
        max_position_embeddings=POSITIONS, word_embed_proj_dim=h, bos_token_id=0, eos_token_id=1, pad_token_id=1)),
    "biogpt": ("BioGptConfig", "causal", lambda h, kv, n: {**_encoder(h, kv, n), "bos_token_id": 0, "eos_token_id": 2}),
    "bert": ("BertConfig", "masked", _encoder),
    "roberta": ("RobertaConfig", "masked", _encoder),
    "xlm_roberta": ("XLMRobertaConfig", "base", _encoder),
    "electra": ("ElectraConfig", "base", lambda h, kv, n: {**_encoder(h, kv, n), "embedding_size": h}),
    "mpnet": ("MPNetConfig", "base", _encoder),
    "distilbert": ("DistilBertConfig", "base", lambda h, kv, n: dict(
        dim=h, hidden_dim=2 * h, n_layers=n, n_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=POSITIONS)),
    "t5_encoder": ("T5Config", "t5_encoder", lambda h, kv, n: dict(
        d_model=h, d_kv=h // HEADS, d_ff=2 * h, num_layers=n, num_heads=HEADS, vocab_size=VOCAB)),
    # the kinds of 2025-26: experts computed densely by a bmm, a state-space mixer (alone, and beside attention
    # in every layer: Falcon-H1), gated delta nets
    # beside attention and routed experts, per-layer inputs with AltUp and LAuReL
    "llama4": ("Llama4TextConfig", "causal", lambda h, kv, n: {
        **_decoder(h, kv, n), "intermediate_size_mlp": 2 * h, "num_local_experts": 4, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1}),
    "mamba2": ("Mamba2Config", "causal", lambda h, kv, n: dict(
        hidden_size=h, num_hidden_layers=n, vocab_size=VOCAB, num_heads=HEADS, head_dim=2 * h // HEADS, expand=2,
        n_groups=1, state_size=16, chunk_size=16, bos_token_id=0, eos_token_id=1, pad_token_id=None)),
    "falcon_h1": ("FalconH1Config", "causal", lambda h, kv, n: {
        **_decoder(h, kv, n), "mamba_n_heads": HEADS, "mamba_d_head": 2 * h // HEADS, "mamba_expand": 2,
        "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_d_ssm": 2 * h}),
    "qwen3_next": ("Qwen3NextConfig", "causal", lambda h, kv, n: {
        **_decoder(h, kv, n), "linear_num_value_heads": HEADS, "linear_num_key_heads": HEADS // 2,
        "linear_key_head_dim": h // HEADS, "linear_value_head_dim": h // HEADS, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": h // 2, "shared_expert_intermediate_size": h // 2,
        "layer_types": ["linear_attention", "full_attention"] * (n // 2) + ["linear_attention"] * (n % 2)}),
    "gemma3n": ("Gemma3nTextConfig", "causal", lambda h, kv, n: {
        **_decoder(h, kv, n), "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": h // 4,
        "laurel_rank": 8, "altup_num_inputs": 2, "num_kv_shared_layers": 0,
        "layer_types": ["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2),
        "activation_sparsity_pattern": [0.0] * n}),
}
_HEAD_CLASSES = {"causal": "AutoModelForCausalLM", "masked": "AutoModelForMaskedLM", "base": "AutoModel",
                 "t5_encoder": "T5EncoderModel"}


def _hf(name: str, h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
    import transformers
    config_name, kind, kwargs = HF_FAMILIES[name]
    cfg = getattr(transformers, config_name)(**kwargs(h, kv_heads, layers))
    cls = getattr(transformers, _HEAD_CLASSES[kind] if head or kind == "t5_encoder" else "AutoModel")
    return cls.from_config(cfg) if cls.__name__.startswith("Auto") else cls(cfg)


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


def _cuda(h: int, kv_heads: int, layers: int, head: bool) -> nn.Module:
    from .cuda_llama import CudaLlama
    from .llama import LlamaArgs
    return CudaLlama(LlamaArgs(dim=h, n_layers=layers, n_heads=HEADS, n_kv_heads=kv_heads, vocab_size=VOCAB))


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    **{name: (lambda h, kv, n, head, name=name: _hf(name, h, kv, n, head)) for name in HF_FAMILIES},
    "torch_encoder": _torch_encoder, "torch_mha": _torch_mha, "mlp": _mlp, "titan_llama": _titan,
    "cuda_llama": _cuda,
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
    takes = "use_cache" in inspect.signature(forward).parameters
    kwargs = {"use_cache": False} if takes or hasattr(getattr(model, "config", None), "use_cache") else {}
    out = model(*positional_args(model, x), **kwargs)
    for field in ("logits", "last_hidden_state"):
        if getattr(out, field, None) is not None:
            return getattr(out, field)
    return out[0] if isinstance(out, tuple) else out
