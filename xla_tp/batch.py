"""Which inputs of a call carry the batch, and how each is split over the mesh's batch axes.

A model is called as its users call it: by position (``model(ids)``), by keyword as Hugging Face
users do (``model(**tokenizer(...))``, ``model(pixel_values=pix)``), with several inputs. The batch
size is dimension 0 of the *main* input: the one the model names (``main_input_name``) when it is
passed, else the first tensor passed by position, else the first tensor passed by keyword. The main
input is split, and so is every floating-point input whose dimension 0 has that size (a diffusion
model's encoder states and latents, a second embedding), except what only positions a sequence
(``cache_position``); the ``labels`` are split too (they meet the outputs, split as the main input). Other integer
and boolean side inputs (attention masks, position and token-type ids) are left to the compiler, which
splits them as the values they meet: split before the model builds a mask from them (a gather indexed by
positions), GSPMD moves the mask between devices. (Labels left to the compiler are miscompiled under a
sequence split: with one row of batch, GSPMD partitions transformers' ``F.pad(labels, (0, 1))[..., 1:]``
shift as if unshifted, reading each token's own id.)

A vision tower's patches flattened into rows beside the grid listing its images (``pixel_values`` with
``image_grid_thw``: Qwen2-VL) are split as the batch too when their rows are a multiple of it.

The batch is split over the batch axes (``data``, ``fsdp``, ``expert``) when it divides their
devices. When it does not, the next best split is taken: the largest group of those axes it
divides (``data=2 x fsdp=2`` with a batch of 6 splits over ``data`` alone), else none, and
``uneven_note`` says so. (Splitting unevenly is worse: GSPMD pads, then gathers the padded batch.) Example:

>>> import torch
>>> ids, states = torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 7, 32)
>>> inputs = {"input_ids": ids, "attention_mask": ids.clone(), "encoder_hidden_states": states,
...           "cache_position": states[0, 0], "labels": ids.clone()}
>>> [key for key, _ in batch_inputs((), inputs, "input_ids")]
['input_ids', 'encoder_hidden_states', 'labels']
>>> batch_split(4, ("data", "fsdp"), {"data": 2, "fsdp": 2}), batch_split(6, ("data", "fsdp"), {"data": 2, "fsdp": 2})
(('data', 'fsdp'), ('data',))
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator, Mapping, Optional, Union

import torch

POSITION_ONLY = ("cache_position",)  # Hugging Face inputs that position a sequence and never carry the batch
LIKE_MAIN = ("labels",)               # integer inputs split as the main input: they meet its outputs
PATCHES = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}  # flattened patches, their grid


def main_input(args: tuple, kwargs: Mapping[str, Any], name: Optional[str]) -> Optional[torch.Tensor]:
    """The input whose dimension 0 is the batch (see the module docstring), None without one."""
    named = kwargs.get(name) if name else None
    if _batched(named):
        return named
    return next((x for x in itertools.chain(args, kwargs.values()) if _batched(x)), None)


def batch_inputs(args: tuple, kwargs: Mapping[str, Any],
                 name: Optional[str]) -> Iterator[tuple[Union[int, str], torch.Tensor]]:
    """``(position or keyword, tensor)`` for every input of the call that carries the batch."""
    main = main_input(args, kwargs, name)
    if main is None:
        return
    size = main.shape[0]
    for key, x in itertools.chain(enumerate(args), kwargs.items()):
        side = _batched(x) and x.shape[0] == size and key not in POSITION_ONLY
        if x is main or side and (x.is_floating_point() or key in LIKE_MAIN) or _patches(key, x, size, kwargs):
            yield key, x


def _patches(key: Union[int, str], x: Any, size: int, kwargs: Mapping[str, Any]) -> bool:
    """Whether ``x`` is the images' patches flattened into rows beside the grid that lists them (Qwen2-VL's
    ``pixel_values`` and ``image_grid_thw``), as many rows for every sample: the images of a batch row stay
    with it (their tower's rows split as the batch) when the rows are a multiple of the batch."""
    return key in PATCHES and PATCHES[key] in kwargs and _batched(x) and x.shape[0] % size == 0


def batch_split(size: int, axes: tuple[str, ...], sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The batch axes a batch of ``size`` rows is split over: all of ``axes`` when it divides their
    devices, else the largest (most devices) group of them it divides, in mesh order."""
    best: tuple[str, ...] = ()
    for n in range(len(axes), 0, -1):
        for group in itertools.combinations(axes, n):
            n_group = ways(group, sizes)
            if size % n_group == 0 and n_group > ways(best, sizes):
                best = group
    return best


def ways(axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    """How many devices ``axes`` span: ``ways(("data", "fsdp"), {"data": 2, "fsdp": 2}) == 4``."""
    n = 1  # a loop, not math.prod over a generator: dynamo traces it (a captured decode step splits its batch)
    for a in axes:
        n *= sizes.get(a, 1)
    return n


def uneven_note(size: int, axes: tuple[str, ...], sizes: Mapping[str, int]) -> Optional[str]:
    """What splitting a batch of ``size`` over ``axes`` costs when it does not divide (None when it does)."""
    n_axes = ways(axes, sizes)
    if size % n_axes == 0:
        return None
    split = batch_split(size, axes, sizes)
    over = " x ".join(f"{a}={sizes.get(a, 1)}" for a in axes)
    how = (f"its inputs are split over {' x '.join(split)} only ({ways(split, sizes)} ways)" if split
           else "its inputs are whole on every device")
    return (f"batch {size} does not divide over {over} ({n_axes} devices): {how}, so devices may repeat each other's "
            f"work (the audit's compute balance measures it); use a multiple of {n_axes}")


def _batched(x: Any) -> bool:
    """A tensor or array (torch, numpy, jax) with a dimension 0."""
    return isinstance(x, torch.Tensor) and x.dim() > 0
