"""Sub-axes: a split over groups of consecutive devices of one mesh axis, replicated across the groups.

``"model@4"`` names the inner 4 devices of the ``model`` axis: on ``model=8`` a tensor dimension
spec'd ``"model@4"`` is split 4 ways within devices {0..3} and, the same way, within {4..7}. That is
how attention whose heads divide 4 but not 8 (28 query / 4 key-value heads, Qwen2-7B's shape) is
split over part of the axis while the MLP uses all of it. The backend lowers a sub-axis onto the
same devices with the axis split in two (``backends.submesh``). Example:

>>> sub_axis("model", 4), split_sub_axis("model@4"), split_sub_axis("data")
('model@4', ('model', 4), ('data', None))
>>> axis_size({"data": 2, "model": 8}, "model@4"), axis_size({"model": 8}, "model")
(4, 8)
"""
from __future__ import annotations

from typing import Mapping, Optional

SEP = "@"


def sub_axis(axis: str, size: int) -> str:
    """The name of the ``size``-device inner groups of ``axis``."""
    return f"{axis}{SEP}{size}"


def split_sub_axis(name: str) -> tuple[str, Optional[int]]:
    """``(axis, size)`` of a sub-axis name, ``(name, None)`` for a plain axis."""
    base, sep, size = name.partition(SEP)
    return (base, int(size)) if sep and size.isdigit() else (name, None)


def axis_size(sizes: Mapping[str, int], name: str, default: Optional[int] = None) -> Optional[int]:
    """Devices one mesh axis or sub-axis splits over; ``default`` for a name the mesh lacks (or a
    sub-axis whose size does not divide its axis)."""
    base, size = split_sub_axis(name)
    if base not in sizes:
        return default
    if size is None:
        return int(sizes[base])
    return size if size >= 1 and sizes[base] % size == 0 else default
