"""Patch embeddings (a convolution whose stride is its kernel: ViT, CLIP, SigLIP) as einsums.

A convolution over non-overlapping patches is a projection of each patch's pixels. "auto" splits it
over its kernel rows (``roles``): each device sums its rows of every patch and one all-reduce adds
them up, like a vocabulary-parallel embedding. A kernel dimension the compiler sees only as a
window of the image cannot be split without moving the image; written as an einsum over
``[B, C, H/p, p, W/q, q]`` the kernel rows are an ordinary dimension, each device reads its rows of
the (replicated) image locally. The lowering's mode (``mode``) runs ``conv_as_einsum`` in the modules
that hold such a convolution. Example:

>>> x, w, b = torch.randn(2, 3, 8, 8), torch.randn(5, 3, 4, 4), torch.randn(5)
>>> torch.allclose(conv_as_einsum(x, w, b, stride=4), F.conv2d(x, w, b, stride=4), atol=1e-5)
True
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..dataflow.patches import non_overlapping


def conv_as_einsum(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
                   dilation: Any = 1, groups: Any = 1) -> Any:
    """``F.conv{1,2,3}d`` over non-overlapping patches as one einsum (NotImplemented for any other)."""
    kernel = tuple(weight.shape[2:])
    n = len(kernel)
    if input.dim() != n + 2 or not non_overlapping(kernel, stride, padding, dilation, groups):
        return NotImplemented
    counts = [size // k for size, k in zip(input.shape[2:], kernel)]
    cut = input[(...,) + tuple(slice(0, c * k) for c, k in zip(counts, kernel))]  # conv drops a remainder
    split = cut.reshape(*input.shape[:2], *(d for c, k in zip(counts, kernel) for d in (c, k)))
    cells, taps = "XYZ"[:n], "ijk"[:n]
    image = "bc" + "".join(c + t for c, t in zip(cells, taps))
    out = torch.einsum(f"{image},oc{taps}->bo{cells}", split, weight)
    return out if bias is None else out + bias.view(-1, *(1,) * n)


HANDLERS = {F.conv1d: conv_as_einsum, F.conv2d: conv_as_einsum, F.conv3d: conv_as_einsum}
