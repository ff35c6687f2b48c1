"""How a module built on ``meta`` initialises its tensors once they exist, sharded, on the device.

A module inside a Hugging Face model uses that model's own ``_init_weights`` (the nearest
``PreTrainedModel`` that holds it: Linear/Embedding normal(0, initializer_range), norms to one,
rotary frequencies computed); any other module its ``reset_parameters()``.

The init runs on the host, on zero-filled twins of the module's new tensors, and each twin is then
written into its sharded XLA tensor block by block (``backends.host``). Random init on the device
would not be partitioned: torch_xla's compiled ``normal_`` draws the random bits of the whole tensor
on every device before keeping its shard, a full tensor per device (four bytes per element). On
the host one module's tensors exist at a time. Example::

    init = initializer(model, "model.layers.0.input_layernorm")   # LlamaRMSNorm: HF's _init_weights
    initialise_on_host(model, "model.layers.0.input_layernorm", fresh={id(norm.weight)})
"""
from __future__ import annotations

from typing import Callable, Collection, Optional

import torch
from torch import nn

from ..errors import PlanError
from ..guard import SHARDING_ATTR
from .host import release_host_memory, write_from_host


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


def initialise_on_host(root: nn.Module, fqn: str, fresh: Collection[int]) -> None:
    """Initialise the module at ``fqn``: its tensors whose ``id`` is in ``fresh`` (XLA tensors with no
    values yet) get host twins for the init to fill, then are written from them. Its other tensors
    stay in place, so the init updates them on the device as before."""
    mod = root.get_submodule(fqn)
    twins = []
    for store in (mod._parameters, mod._buffers):
        for name, t in store.items():
            if t is not None and id(t) in fresh:
                twins.append((store, name, t, _host_twin(t)))
    values = []
    try:
        for store, name, _, twin in twins:
            store[name] = twin
        with torch.no_grad():
            initializer(root, fqn)()
        values = [store[name] for store, name, _, _ in twins]  # an init may assign a new tensor
    finally:
        for store, name, t, _ in twins:
            store[name] = t
    for (store, name, t, _), value in zip(twins, values):
        value = value.detach()
        if value.shape != t.shape:
            raise PlanError(f"the init of {fqn!r} replaced {name!r} of shape {tuple(t.shape)} by one of shape "
                             f"{tuple(value.shape)}; an init must keep its tensors' shapes")
        write_from_host(t, lambda blocks: [value[b] for b in blocks])
    release_host_memory()


def _host_twin(t: torch.Tensor) -> torch.Tensor:
    twin = torch.zeros(t.shape, dtype=t.dtype)
    if not isinstance(t, nn.Parameter):
        return twin
    out = nn.Parameter(twin, requires_grad=t.requires_grad)
    out.__dict__.update({k: v for k, v in t.__dict__.items() if k != SHARDING_ATTR})
    return out
