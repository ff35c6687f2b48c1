"""The zoo's torchtitan-style Llama: called with its own ``KVCache`` ([B, L, kv heads, head_dim] per
layer), set before each call with the tokens' slots, positions and the valid slots. Example::

    decoder = ZooDecoder(model)
    cache = decoder.new_cache(batch=2, length=32)
    logits = decoder.logits(ids, positions, slots, valid, cache)    # [2, vocab], the last token's
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..errors import GenerationError
from ..zoo.llama import KVCache, Llama
from .cache import placement_of


class ZooDecoder:
    """How ``generate`` calls ``xla_tp.zoo.llama.Llama`` (see the module docstring)."""

    def __init__(self, model: Llama) -> None:
        attention = type(model).attention
        if "cache" not in inspect.signature(attention.forward).parameters:
            raise GenerationError(f"{type(model).__name__}'s attention ({attention.__module__}.{attention.__qualname__}) "
                                  f"takes no KV cache; xla_tp.generate decodes xla_tp.zoo.llama.Llama, whose "
                                  f"attention does")
        self.model, self.placement = model, placement_of(model, dims=(0, 2))
        self.limit: Optional[int] = model.args.max_seq_len
        self.eos: list[int] = []
        self.pad: Optional[int] = None

    def new_cache(self, batch: int, length: int) -> KVCache:
        weight = self.model.tok_embeddings.weight
        cache = KVCache.empty(self.model.args, batch, length, dtype=weight.dtype, device=weight.device)
        for t in (*cache.keys, *cache.values):
            self.placement.place(t)
        return cache

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
               cache: KVCache) -> torch.Tensor:
        return self.model(ids, cache=cache.at(slots, positions, valid))[:, -1]

    def cache_tensors(self, cache: KVCache) -> list[torch.Tensor]:
        return [*cache.keys, *cache.values]
