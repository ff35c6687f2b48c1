"""Each device's block of a dimension split over ``tp`` devices, and pieces laid side by side device-major.

A dimension of ``tp * n`` features split over ``tp`` devices holds device ``d``'s block at ``[d * n, (d + 1) * n)``;
viewed as ``[tp, n]`` each block has its own index. Pieces concatenated per block (``laid``) keep every device's
part of each piece where it already is: what a column group's input gradient contracts, what a concatenation of
split features a row projection reads (``concat``) is. Example:

>>> w = torch.arange(8.).view(4, 2)      # rows 0-1 on device 0, rows 2-3 on device 1
>>> laid(w, w + 10, tp=2, dim=0)[:, 0].tolist()     # device 0: w0 w1 v0 v1 | device 1: w2 w3 v2 v3
[0.0, 2.0, 10.0, 12.0, 4.0, 6.0, 14.0, 16.0]
"""
from __future__ import annotations

import torch


def per_device(t: torch.Tensor, tp: int, dim: int = -1) -> torch.Tensor:
    """``t`` with its dimension ``dim`` viewed as ``[tp, size / tp]``, device ``d``'s block at index ``d``. A view
    with the shape spelled out: ``Tensor.unflatten`` is a Python wrapper, a host cost on every traced step.

    >>> per_device(torch.zeros(2, 12), 4).shape, per_device(torch.zeros(8, 3), 4, 0).shape
    (torch.Size([2, 4, 3]), torch.Size([4, 2, 3]))
    """
    dim %= t.dim()
    shape = t.shape
    return t.view(*shape[:dim], tp, shape[dim] // tp, *shape[dim + 1:])


def laid(*pieces: torch.Tensor, tp: int, dim: int = -1) -> torch.Tensor:
    """``pieces`` concatenated on ``dim`` (the last by default), device-major over ``tp`` devices."""
    dim %= pieces[0].dim()
    return torch.cat([per_device(p, tp, dim) for p in pieces], dim + 1).flatten(dim, dim + 1)


__all__ = ["laid", "per_device"]
