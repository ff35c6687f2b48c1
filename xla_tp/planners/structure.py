"""Structural probes shared by the family planners: which modules exist, of what kind.

Families are recognised by the names and kinds of their modules, never by class name alone, so a
fine-tune or a renamed subclass still matches. Example::

    has(model, "self_attn.q_proj", nn.Linear)      # True for HF Llama/Mistral/Qwen/Gemma
"""
from __future__ import annotations

from typing import Optional

from torch import nn


def has(model: nn.Module, suffix: str, kind: Optional[type] = None) -> bool:
    """True if a module's FQN ends with ``suffix`` (at a segment boundary) and is a ``kind``."""
    return any((f == suffix or f.endswith("." + suffix)) and (kind is None or isinstance(m, kind))
               for f, m in model.named_modules())


def is_conv1d(mod: nn.Module) -> bool:
    """HF ``Conv1D``: a 2-D ``weight`` stored ``[in, out]`` with an ``nf`` (out features) attribute."""
    w = getattr(mod, "weight", None)
    return w is not None and w.dim() == 2 and getattr(mod, "nf", None) == w.shape[1]


def config_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, key/value heads) from a transformers config; (0, 0) if there is none."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return 0, 0
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    q = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 0) or 0
    kv = getattr(cfg, "num_key_value_heads", None) or q
    return int(q), int(kv)
