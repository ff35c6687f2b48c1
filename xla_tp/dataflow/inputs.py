"""The input "auto" traces a model with when none is given, from what the model declares.

A Hugging Face model names its main input (``main_input_name``) and its config the shapes:

- ``input_ids``: token ids ``[2, 8]`` (position-limited models get fewer);
- ``pixel_values``: images ``[2, channels, size, size]`` from ``image_size`` and ``num_channels``
  (the config's, or its ``vision_config``'s);
- ``input_features``: log-mel frames ``[2, num_mel_bins, frames]``; with ``max_source_positions``
  (Whisper), as many frames as the encoder's convolutions bring down to that many positions;
- ``input_values``: raw audio ``[2, 1600]``;
- a diffusion transformer's latents, timestep and conditioning from its config (``denoisers``);
- token ids and images for a model of tokens with a vision tower (``takes_images``): the images from its
  ``vision_config``, so the tower is traced too; for a tower of flattened patches and their grid (Qwen2-VL),
  those, the grid kept real in the trace (``host_values``: the tower reads it on the host; ``trace`` falls
  back to tokens alone if the tower still does not run).

Encoder-decoder models (``is_encoder_decoder``) also get ``decoder_input_ids`` of their decoder
start token. Any other module gets token ids if its first layer is an embedding, images if it is a
``Conv2d``, else floats of its first layer's input width. Example:

>>> from torch import nn
>>> args, kwargs = synthesize(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
>>> args[0].shape, kwargs
(torch.Size([2, 3, 32, 32]), {})
"""
from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import PlanError
from .denoisers import denoiser_inputs, is_denoiser

BATCH, SEQ, IMAGE, SAMPLES = 2, 8, 32, 1600


class MadeUpInputError(PlanError):
    """No input could be made up for the model, or the model does not run on the one made up."""


def synthesize(model: nn.Module, images: bool = False) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` to trace ``model`` with (see the module docstring); with ``images``, a model that
    takes images beside its tokens (``takes_images``) gets them too."""
    config = getattr(model, "config", None)
    name = getattr(model, "main_input_name", None)
    takes = _parameters(model)
    if is_denoiser(model, takes):
        return (), denoiser_inputs(model, takes)
    if config is not None and isinstance(name, str):
        kwargs = {name: _main_input(model, config, name)}
        if images and takes_images(model):
            kwargs.update(_images(model, config, kwargs[name].shape))
        if getattr(config, "is_encoder_decoder", False) and _takes(model, "decoder_input_ids"):
            start = _first_int(config, "decoder_start_token_id", "pad_token_id", "bos_token_id")
            kwargs["decoder_input_ids"] = torch.full((BATCH, _seq(config)), start, dtype=torch.long)
        return (), {**kwargs, **default_kwargs(model)}
    return _plain_inputs(model), {}


def _main_input(model: nn.Module, config: Any, name: str) -> torch.Tensor:
    if name == "input_ids":
        return torch.zeros(BATCH, _seq(config), dtype=torch.long)
    if name == "pixel_values":
        size = _declared(config, "image_size") or IMAGE
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        return torch.zeros(BATCH, _declared(config, "num_channels") or 3, *size)
    if name == "input_features":
        mels = _declared(config, "num_mel_bins") or _declared(config, "input_feat_per_channel")
        return torch.zeros(BATCH, mels or 80, _frames(model, config))
    if name == "input_values":
        return torch.zeros(BATCH, SAMPLES)
    raise MadeUpInputError(f"{type(model).__name__}'s main input {name!r} is not one xla_tp can make up; pass "
                    f"example_inputs=(...) or call the parallelized model once (it is planned from that call)")


def _images(model: nn.Module, config: Any, tokens: torch.Size) -> dict[str, torch.Tensor]:
    """Images for the vision tower of a model of ``tokens``: ``[batch, channels, size, size]``, or, for a
    tower that takes flattened patches and each image's grid of them (``image_grid_thw``: Qwen2-VL), one
    image of ``[1, 2 * merge, 2 * merge]`` patches per sample, its M-RoPE positions (``[3, batch, seq]``;
    without them the model reads each image's place from the tokens' values)."""
    vision = config.vision_config
    if not _takes(model, "image_grid_thw"):
        return {"pixel_values": _main_input(model, vision, "pixel_values")}
    side = 2 * (_declared(vision, "spatial_merge_size") or 1)
    patch = _declared(vision, "patch_size")
    if not isinstance(patch, int):
        raise MadeUpInputError(f"{type(model).__name__}'s vision config declares no patch_size to make patches of")
    width = (_declared(vision, "in_channels") or _declared(vision, "num_channels") or 3) * patch * patch * (
        _declared(vision, "temporal_patch_size") or 1)
    return {"pixel_values": torch.zeros(tokens[0] * side * side, width),
            "image_grid_thw": torch.tensor([[1, side, side]] * tokens[0]),
            "position_ids": torch.zeros(3, *tokens, dtype=torch.long)}


def host_values(model: nn.Module, kwargs: Mapping[str, Any]) -> frozenset[str]:
    """The inputs of a made-up call whose values the model reads on the host (a vision tower's grid of
    patches: ``.tolist()``): its integer tensors beside the main input, which a trace keeps real."""
    main = getattr(model, "main_input_name", None)
    return frozenset(k for k, a in kwargs.items() if isinstance(a, torch.Tensor) and k != main
                     and not a.is_floating_point())


def takes_images(model: nn.Module) -> bool:
    """A model of tokens that also takes ``pixel_values`` for its vision tower (Llava, PaliGemma, Gemma 3):
    a text call never reaches the tower, so "auto" traces one with images (their number of placeholder tokens
    is a value, which a trace on fake tensors does not read)."""
    config = getattr(model, "config", None)
    return (getattr(model, "main_input_name", None) == "input_ids" and _takes(model, "pixel_values")
            and getattr(config, "vision_config", None) is not None)


def _frames(model: nn.Module, config: Any) -> int:
    """Frames the encoder's strided convolutions bring down to ``max_source_positions`` (Whisper checks it)."""
    positions = _declared(config, "max_source_positions")
    if not positions:
        return 4 * SEQ
    strides = [m.stride[0] for m in model.modules() if isinstance(m, nn.Conv1d)]
    return positions * math.prod(strides)


def _seq(config: Any) -> int:
    limit = _declared(config, "max_position_embeddings") or _declared(config, "max_target_positions")
    return min(SEQ, limit) if limit else SEQ


def _declared(config: Any, name: str) -> Any:
    """``config.name``, else its vision/text/encoder sub-config's."""
    for holder in (config, *(getattr(config, sub, None) for sub in ("vision_config", "text_config", "encoder"))):
        value = getattr(holder, name, None) if holder is not None else None
        if value is not None:
            return value
    return None


def _first_int(config: Any, *names: str) -> int:
    return next((v for v in (getattr(config, n, None) for n in names) if isinstance(v, int)), 0)


def _parameters(model: nn.Module) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return {}


def _takes(model: nn.Module, name: str) -> bool:
    return name in _parameters(model)


def _passes_keywords(model: nn.Module) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _parameters(model).values())


def default_kwargs(model: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` for models whose forward takes it (no KV cache in a planning trace): by name, by
    their config's, or by their text config's when the forward passes its keywords on (a vision-language
    model's language model)."""
    config = getattr(model, "config", None)
    takes = _takes(model, "use_cache") or hasattr(config, "use_cache") or (
        hasattr(getattr(config, "text_config", None), "use_cache") and _passes_keywords(model))
    return {"use_cache": False} if takes else {}


def plannable(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A real call's arguments as a planning trace may see them: tensors (the trace reads their shapes only),
    numbers and strings as they are; any other object (an options object, a KV cache) deep-copied, so the
    traced forward may change the copy only (left out if it cannot be copied)."""
    def keep(a: Any) -> Any:
        if a is None or isinstance(a, (torch.Tensor, int, float, bool, str)):
            return a
        try:
            return copy.deepcopy(a)
        except Exception:
            return None
    return tree_map(keep, args), tree_map(keep, kwargs)


def _plain_inputs(model: nn.Module) -> tuple:
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            return (torch.zeros(BATCH, SEQ, dtype=torch.long),)
        if isinstance(mod, nn.Conv2d):
            return (torch.zeros(BATCH, mod.in_channels, IMAGE, IMAGE),)
        width = _input_width(mod)
        if width:
            x = torch.zeros(BATCH, SEQ, width)
            return (x, x, x) if isinstance(model, nn.MultiheadAttention) else (x,)
    raise MadeUpInputError(f"{type(model).__name__} has no Embedding, Linear, Conv2d or attention layer to guess an input "
                    f"from; pass example_inputs=(tensor, ...) or call the parallelized model once (it is planned "
                    f"from that call)")


def _input_width(mod: nn.Module) -> int:
    if isinstance(mod, nn.Linear):
        return mod.in_features
    if isinstance(mod, nn.MultiheadAttention):
        return mod.embed_dim
    w: Optional[torch.Tensor] = getattr(mod, "weight", None)  # HF Conv1D: weight [in, out]
    if isinstance(w, torch.Tensor) and w.dim() == 2 and getattr(mod, "nf", None) == w.shape[1]:
        return int(w.shape[0])
    return 0
