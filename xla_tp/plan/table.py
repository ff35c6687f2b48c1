"""Per-parameter sharding tables, for people: shapes, specs, per-device shapes and bytes.

Example::

    print(format_table([ParamRow("layers.0.attention.wq", (64, 64), ("model", None), (16, 64), 4096)]))
    # parameter              shape     spec             per-device  bytes/device
    # layers.0.attention.wq  (64, 64)  ('model', None)  (16, 64)    4096
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..axes import sizes_of
from .layout import Spec, spec_axes
from .subaxis import axis_size


@dataclass(frozen=True)
class ParamRow:
    name: str
    shape: tuple[int, ...]
    spec: Spec
    local_shape: tuple[int, ...]
    local_bytes: int


def local_shape(shape: tuple[int, ...], spec: Spec, mesh: Any) -> tuple[int, ...]:
    """Per-device shape on ``mesh`` (a mesh or axis sizes):
    ``local_shape((64, 64), ("model", None), {"model": 4}) == (16, 64)``."""
    sizes = sizes_of(mesh)
    out = []
    for n, axes in zip(shape, spec):
        out.append(-(-n // math.prod(axis_size(sizes, a) for a in spec_axes(axes))))
    return tuple(out)


def format_table(rows: list[ParamRow]) -> str:
    """A fixed-width table with a total line."""
    head = ("parameter", "shape", "spec", "per-device", "bytes/device")
    body = [(r.name, str(r.shape), str(r.spec), str(r.local_shape), str(r.local_bytes)) for r in rows]
    body.append(("total", "", "", "", str(sum(r.local_bytes for r in rows))))
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*line) for line in [head, *body])
