"""A recipe's model: its transformers config (checked key by key), its shape, and the model itself.

``model.config`` is a transformers config class name (``LlamaConfig``) or a dict with a
``model_type`` (``{model_type: llama, hidden_size: 64, ...}``); ``model.overrides`` sets fields
on top. Every key must be a field of that config: transformers silently keeps unknown keys, so a
typo would otherwise train the default model. No hub download: the model is built from the config,
on ``meta`` for planning and fit checks, on the CPU for a run. Example::

    config = hf_config(recipe.model, "recipes/tiny-llama-cpu.yaml")
    shape = model_shape(config)        # ModelShape(layers=4, hidden=128, heads=8, ...)
    model = build_model(config, "causal-lm", device="meta")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .recipe import ModelSpec
from .schema import LaunchError, did_you_mean


@dataclass(frozen=True)
class ModelShape:
    """The sizes the fit check and the FLOP count need, read from any decoder/encoder config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: Optional[int]
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0  # experts each token is routed to
    expert_intermediate: int = 0  # one expert's intermediate size


def hf_config(spec: ModelSpec, where: str) -> Any:
    """The ``transformers`` config ``spec`` describes; LaunchError naming a wrong class or key."""
    import transformers
    fields = dict(spec.overrides)
    if isinstance(spec.config, str):
        cls = getattr(transformers, spec.config, None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
            names = [n for n in dir(transformers) if n.endswith("Config") and n[0].isupper()]
            raise LaunchError(f"{where}: model.config {spec.config!r} is not a transformers config class"
                              f"{did_you_mean(spec.config, names)}; e.g. LlamaConfig, Qwen3Config, GPT2Config, "
                              f"BertConfig, or a mapping with model_type")
        base = cls()
    else:
        fields = {**{k: v for k, v in spec.config.items() if k != "model_type"}, **fields}
        model_type = spec.config.get("model_type")
        try:
            base = transformers.AutoConfig.for_model(model_type)
        except ValueError:
            raise LaunchError(f"{where}: model.config needs a known model_type (llama, qwen3, gpt2, bert, ...), "
                              f"got {model_type!r}") from None
    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    for key in fields:
        if key not in known:
            raise LaunchError(f"{where}: model: {type(base).__name__} has no field {key!r}"
                              f"{did_you_mean(key, known)}")
    try:
        return type(base)(**fields)
    except (ValueError, TypeError) as error:
        raise LaunchError(f"{where}: model: {type(base).__name__} refuses these values: {error}") from None


def model_shape(config: Any) -> ModelShape:
    """Sizes of a transformers config, whatever its family calls them (GPT-2's ``n_embd``, ...)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    return ModelShape(
        layers=config.num_hidden_layers, hidden=hidden, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        vocab=config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", None), **_experts(config))


def _experts(config: Any) -> dict[str, int]:
    """An MoE config's routed experts, top-k and expert width (Mixtral, Qwen3-MoE, OLMoE, DeepSeek names)."""
    experts = next((n for key in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(n := getattr(config, key, None), int) and n > 1), 0)
    if not experts:
        return {}
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return {"experts": experts, "top_k": int(getattr(config, "num_experts_per_tok", 1) or 1),
            "expert_intermediate": int(inter)}


def active_parameters(model: nn.Module, shape: ModelShape) -> int:
    """Parameters a token computes with: routed expert weights (``[E, ...]``) count ``top_k / E``."""
    total = sum(p.numel() for p in model.parameters())
    if not shape.experts:
        return total
    routed = sum(p.numel() for p in model.parameters() if p.dim() >= 3 and p.shape[0] == shape.experts)
    return total - routed + routed * shape.top_k // shape.experts


def build_model(config: Any, task: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` from ``config``, built on ``device``."""
    import transformers
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForMaskedLM
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            return auto.from_config(config, dtype=dtype)
    except ValueError as error:
        raise LaunchError(f"model.task {task!r}: {type(config).__name__} has no {task} model ({error})") from None
