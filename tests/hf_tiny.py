"""The suite's tiny grouped-query Llama (2 layers, 8 heads, hidden 64: ``tiny_llama``, also the ``tiny_llama``
fixture). Encoders, vision-language models and diffusion transformers, each with the inputs its users pass by
keyword, are the zoo's: ``xla_tp.zoo.keyword_models``."""
from __future__ import annotations

import torch
import transformers as T

from xla_tp.zoo.keyword_models import LLAMA


def tiny_llama(seed: int = 0, **overrides) -> T.LlamaForCausalLM:
    """``LlamaForCausalLM`` on ``LLAMA`` (``overrides`` replace its entries), initialised from ``seed``."""
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(**{**LLAMA, **overrides}))
