"""Patch embeddings in a traced forward: a convolution whose stride is its kernel (ViT, CLIP, SigLIP).

Such a convolution projects each non-overlapping patch's pixels; the planner splits it over its
kernel rows like an embedding (``planners.roles``), the lowering writes it as an einsum over the
patches (``lowering.patchify``). Example:

>>> non_overlapping((16, 16), stride=16, padding=0, dilation=1, groups=1), non_overlapping((3,), 1, 1, 1, 1)
(True, False)
"""
from __future__ import annotations

from typing import Any, Sequence

from .regions import Projection


def non_overlapping(kernel: Sequence[int], stride: Any, padding: Any, dilation: Any, groups: Any) -> bool:
    """A convolution over patches: stride = kernel, no padding or dilation, one group."""
    n = len(kernel)

    def each(v: Any) -> tuple:
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n

    return (groups == 1 and each(stride) == tuple(kernel) and padding in (0, "valid", (0,) * n, [0] * n)
            and each(dilation) == (1,) * n and all(k > 1 for k in kernel))


def patches(p: Projection) -> bool:
    """Whether a traced projection is a patch embedding (see the module docstring)."""
    node = p.node
    if node.op not in ("conv1d", "conv2d", "conv3d"):
        return False
    return non_overlapping(p.weight.shape[2:], node.arg(3, "stride", 1), node.arg(4, "padding", 0),
                           node.arg(5, "dilation", 1), node.arg(6, "groups", 1))
