"""``export_hf``: a parallelized model as a Hugging Face checkpoint (consolidated safetensors + config).

Tensors come from the model's own ``state_dict()``, so packed projections a planner re-laid are
written in their original layout, and ``from_pretrained`` gives the same logits. Each tensor is
gathered to the host one at a time and files are cut at ``max_shard_bytes`` (with the usual
``model.safetensors.index.json``), so host memory stays near one file. Tied weights are written
once, as ``save_pretrained`` does. transformers' own ``model.save_pretrained(dir)`` works on a
parallelized model too (``host_save_pretrained``, a ``compat`` effect): it is handed host copies
of the state dict, which it cannot take from XLA tensors itself (safetensors
reads their storage pointer: ``Attempted to access the data pointer on an invalid python
storage``). Example::

    xla_tp.export_hf(model, "out")
    LlamaForCausalLM.from_pretrained("out")
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Callable, Iterator

import torch
import torch_xla
from torch import nn

from ..backends.host import read_to_host
from ..state import param_state

log = logging.getLogger(__name__)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def export_hf(model: nn.Module, out_dir: str, *, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``model``'s weights to ``out_dir`` as safetensors (one file, or shards plus an index)
    and, for a transformers model, its config and generation config. Returns the files written.
    Example: ``xla_tp.export_hf(model, "out")``."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    groups = list(_shards(_unique_state(model), max_shard_bytes))
    names = [WEIGHTS] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                for i in range(len(groups))]
    weight_map = {}
    for name, keys in zip(names, groups):
        tensors = {k: t for k, t in _host_tensors(model, keys)}
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        log.info("xla_tp: wrote %s (%d tensors)", name, len(tensors))
    written = [os.path.join(out_dir, n) for n in names]
    if len(names) > 1:
        total = sum(os.path.getsize(f) for f in written)
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        written.append(os.path.join(out_dir, INDEX))
    for attr in ("config", "generation_config"):
        cfg = getattr(model, attr, None)
        if callable(getattr(cfg, "save_pretrained", None)):
            cfg.save_pretrained(out_dir)
    return written


def _unique_state(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (shape, dtype) of ``state_dict()``, a tied tensor under its first key only."""
    seen: set[int] = set()
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        out[key] = (value.shape, value.dtype)
    return out


def _shards(entries: dict[str, tuple[torch.Size, torch.dtype]], limit: int) -> Iterator[list[str]]:
    group, size = [], 0
    for key, (shape, dtype) in entries.items():
        nbytes = shape.numel() * dtype.itemsize
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    yield group


def _host_tensors(model: nn.Module, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, contiguous CPU tensor)`` in the model's state-dict layout, one transfer each."""
    state = model.state_dict()
    torch_xla.sync()  # hooks' re-layouts become device data in one program, not one per tensor
    for key in keys:
        yield key, read_to_host(state[key])


def host_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tensor copied to the host (whole model in host memory)."""
    state = model.state_dict()
    torch_xla.sync()
    return {k: read_to_host(v) for k, v in state.items()}


def host_save_pretrained(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``save_pretrained``, given host copies of the state dict when the model holds
    parameters xla_tp sharded (other models are saved as they would be)."""
    @functools.wraps(original)
    def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, state_dict: Any = None, **kwargs: Any) -> Any:
        if state_dict is None and any(param_state(p) is not None for p in self.parameters()):
            state_dict = host_state_dict(self)
        return original(self, save_directory, *args, state_dict=state_dict, **kwargs)
    return save_pretrained
