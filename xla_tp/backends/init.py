"""How a module built on ``meta`` initialises its tensors once they exist, sharded, on the device.

A module inside a Hugging Face model uses that model's own ``_init_weights`` (the nearest
``PreTrainedModel`` that holds it: Linear/Embedding normal(0, initializer_range), norms to one,
rotary frequencies computed); any other module its ``reset_parameters()``. Example::

    init = initializer(model, "model.layers.0.input_layernorm")   # LlamaRMSNorm: HF's _init_weights
    with torch.no_grad():
        init()
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn


def initializer(root: nn.Module, fqn: str) -> Optional[Callable[[], None]]:
    """A call that initialises the module at ``fqn`` in place, or None if it has no way to."""
    mod = root.get_submodule(fqn)
    owner = _hf_owner(root, fqn)
    if owner is not None:
        return lambda: owner._init_weights(mod)
    reset = getattr(mod, "reset_parameters", None)
    return reset if callable(reset) else None


def _hf_owner(root: nn.Module, fqn: str) -> Optional[nn.Module]:
    """The innermost transformers model (``_init_weights`` and a ``config``) containing ``fqn``."""
    parts = fqn.split(".") if fqn else []
    for n in range(len(parts), -1, -1):
        candidate = root.get_submodule(".".join(parts[:n]))
        if callable(getattr(candidate, "_init_weights", None)) and hasattr(candidate, "config"):
            return candidate
    return None
