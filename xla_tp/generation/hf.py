"""transformers causal LMs: called with a static cache whose layers are laid out like the model's
key/value heads, and a padding mask as long as the cache.

Every attention layer gets a ``StaticLayer`` as long as the cache, sliding-window layers too
(transformers' sliding layer keeps a Python count and rolls once full, which changes the program at
every step; the full-length layer costs the memory of the whole length, and the model's own mask
keeps the window). The cache advances its write position itself, a device tensor, so one program
serves every decode step. Example::

    decoder = HFDecoder(model)
    cache = decoder.new_cache(batch=2, length=32)
    logits = decoder.logits(ids, positions, slots, valid, cache)    # [2, vocab], the last token's
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from ..errors import GenerationError
from .cache import placement_of

ATTENTION_LAYERS = ("full_attention", "sliding_attention")


class PlacedLayer(StaticLayer):
    """A ``StaticLayer`` whose tensors are laid out by ``place`` when they are created ([B, kv, L, D])."""

    def __init__(self, max_cache_len: int, place: Callable[[torch.Tensor], None]) -> None:
        super().__init__(max_cache_len)
        self.place = place

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.place(self.keys)
        self.place(self.values)
        for t in (self.keys, self.values, self.cumulative_length):  # inputs of the captured step, not constants
            t.__dict__.pop("_dynamo_static_input_type", None)


def _generation_ids(model: PreTrainedModel) -> tuple[list[int], Optional[int]]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return eos, getattr(config, "pad_token_id", None)


class HFDecoder:
    """How ``generate`` calls a transformers causal LM (see the module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        name = type(model).__name__
        if getattr(model.config, "is_encoder_decoder", False):
            raise GenerationError(f"{name} is an encoder-decoder model; xla_tp.generate decodes causal LMs "
                                  f"(AutoModelForCausalLM)")
        if not model.can_generate():
            raise GenerationError(f"{name} is not a causal LM (it cannot generate); load the model with "
                                  f"AutoModelForCausalLM")
        self.config = model.config.get_text_config(decoder=True)
        kinds = set(getattr(self.config, "layer_types", None) or ATTENTION_LAYERS[:1]) - set(ATTENTION_LAYERS)
        if kinds:
            raise GenerationError(f"{name} has {sorted(kinds)} layers; xla_tp.generate caches full and sliding-window "
                                  f"attention layers only: decode it with the model's own "
                                  f"model.generate(input_ids=...), which runs parallelized with transformers' cache")
        self.model, self.placement = model, placement_of(model, dims=(0, 1))
        self.limit: Optional[int] = getattr(self.config, "max_position_embeddings", None)
        self.eos, self.pad = _generation_ids(model)
        self.last_only = "logits_to_keep" in inspect.signature(model.forward).parameters

    def new_cache(self, batch: int, length: int) -> Cache:
        return Cache(layers=[PlacedLayer(length, self.placement.place) for _ in range(self.config.num_hidden_layers)])

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
               cache: Cache) -> torch.Tensor:
        """The last token's logits ``[B, vocab]``; the cache writes at its own position (``slots``' first)."""
        extra: dict[str, Any] = {"logits_to_keep": 1} if self.last_only else {}
        # 0/1 as a tokenizer gives it: some models do arithmetic on the mask (BLOOM's ALiBi positions)
        out = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=positions, past_key_values=cache,
                         use_cache=True, **extra)
        return out.logits[:, -1]

    def cache_tensors(self, cache: Cache) -> list[torch.Tensor]:
        return [t for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values)]
