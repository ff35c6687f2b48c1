"""The input of a diffusion transformer (diffusers' SD3, PixArt, Flux, DiT), made up from its config.

A denoiser takes noisy latents and a timestep by keyword, beside what conditions it: text encoder states,
pooled projections, class labels, position ids. None of it is declared as a main input, so each is made
from the config entry that sizes it (``BATCH`` rows):

- ``hidden_states``: latents ``[B, in_channels, sample_size, sample_size]``; packed ``[B, SEQ, in_channels]``
  for a model that takes position ids (``img_ids``: Flux);
- ``encoder_hidden_states``: ``[B, SEQ, d]``, ``d`` the first of ``joint_attention_dim``, ``caption_channels``,
  ``cross_attention_dim``; ``pooled_projections``: ``[B, pooled_projection_dim]``;
- ``timestep`` ``[B]``; ``class_labels`` ``[B]``; ``img_ids``/``txt_ids`` ``[SEQ, 3]``; ``guidance`` ``[B]`` when
  the config embeds it; PixArt's size conditions when it uses them.

Example:

>>> from diffusers import DiTTransformer2DModel
>>> dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
...                             sample_size=8, patch_size=2)
>>> names = ["hidden_states", "timestep", "class_labels"]
>>> {k: tuple(v.shape) for k, v in denoiser_inputs(dit, names).items()}
{'hidden_states': (2, 4, 8, 8), 'timestep': (2,), 'class_labels': (2,)}
"""
from __future__ import annotations

from typing import Any, Collection

import torch
from torch import nn

BATCH, SEQ = 2, 8
_CONTEXT_WIDTHS = ("joint_attention_dim", "caption_channels", "cross_attention_dim")


def is_denoiser(model: nn.Module, names: Collection[str]) -> bool:
    """A model whose forward takes (``names``) ``hidden_states`` and a ``timestep`` and whose config sizes
    its latents."""
    config = getattr(model, "config", None)
    return {"hidden_states", "timestep"} <= set(names) and _get(config, "in_channels") is not None


def denoiser_inputs(model: nn.Module, names: Collection[str]) -> dict[str, Any]:
    """Keyword inputs for one forward of ``model``, whose forward takes ``names`` (see the module docstring)."""
    config = model.config
    channels = int(_get(config, "in_channels"))
    size = int(_get(config, "sample_size") or SEQ)
    made: dict[str, Any] = {"hidden_states": torch.zeros(BATCH, SEQ, channels) if "img_ids" in names
                            else torch.zeros(BATCH, channels, size, size)}
    width = next((w for w in (_get(config, n) for n in _CONTEXT_WIDTHS) if isinstance(w, int)), None)
    if "encoder_hidden_states" in names and width:
        made["encoder_hidden_states"] = torch.zeros(BATCH, SEQ, width)
    if "pooled_projections" in names and _get(config, "pooled_projection_dim"):
        made["pooled_projections"] = torch.zeros(BATCH, int(_get(config, "pooled_projection_dim")))
    made["timestep"] = torch.ones(BATCH)
    if "class_labels" in names and _get(config, "num_embeds_ada_norm"):
        made["class_labels"] = torch.zeros(BATCH, dtype=torch.long)
    for ids in ("img_ids", "txt_ids"):
        if ids in names:
            made[ids] = torch.zeros(SEQ, 3)
    if "guidance" in names and _get(config, "guidance_embeds"):
        made["guidance"] = torch.ones(BATCH)
    if "added_cond_kwargs" in names and _get(config, "use_additional_conditions"):
        made["added_cond_kwargs"] = {"resolution": torch.ones(BATCH, 2), "aspect_ratio": torch.ones(BATCH, 1)}
    return made


def _get(config: Any, name: str) -> Any:
    """A diffusers config entry (a ``FrozenDict``: read by key), None when absent."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)
