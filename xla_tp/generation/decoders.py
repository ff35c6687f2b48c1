"""What ``generate`` needs of a model, and which models have it.

A ``Decoder`` allocates a cache for a batch and length, and returns the last token's logits of a call
on new tokens (their ids, rotary positions and cache slots, and the cache's valid slots). Two kinds
of model have one: transformers causal LMs (``hf``) and the zoo's Llama (``zoo``). Example::

    decoder = decoder_for(model)      # GenerationError for anything else, or a model not parallelized
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Protocol

import torch
from torch import nn

from ..errors import GenerationError


class Decoder(Protocol):
    limit: Optional[int]  # positions the model has (None: no limit)
    eos: list[int]  # the model's own end-of-sequence ids
    pad: Optional[int]

    def new_cache(self, batch: int, length: int) -> Any: ...

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
               cache: Any) -> torch.Tensor: ...

    def cache_tensors(self, cache: Any) -> list[torch.Tensor]: ...


def decoder_for(model: nn.Module) -> Decoder:
    """The decoder of ``model`` (see the module docstring)."""
    transformers = sys.modules.get("transformers")
    from ..zoo.llama import Llama
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from .hf import HFDecoder
        return HFDecoder(model)
    if isinstance(model, Llama):
        from .zoo import ZooDecoder
        return ZooDecoder(model)
    raise GenerationError(f"{type(model).__name__} is not a model xla_tp.generate can decode: pass a transformers "
                          f"causal LM (AutoModelForCausalLM) or xla_tp.zoo.llama.Llama, parallelized")
