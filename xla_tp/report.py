"""Per-parameter sharding tables of a parallelized module, for people.

Example::

    print(format_table(sharding_rows(model, mesh)))
    # parameter              shape       spec              per-device   bytes/device
    # layers.0.attention.wq  (64, 64)    ('model', None)   (16, 64)     4096
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch_xla.distributed.spmd as xs
from torch import nn

from .guard import SHARDING_ATTR
from .plan.layout import Spec, spec_axes
from .plan.subaxis import axis_size


@dataclass(frozen=True)
class ParamRow:
    name: str
    shape: tuple[int, ...]
    spec: Spec
    local_shape: tuple[int, ...]
    local_bytes: int


def local_shape(shape: tuple[int, ...], spec: Spec, mesh: xs.Mesh) -> tuple[int, ...]:
    """Per-device shape: ``local_shape((64, 64), ("model", None), mesh_with_model_4) == (16, 64)``."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    out = []
    for n, axes in zip(shape, spec):
        out.append(-(-n // math.prod(axis_size(sizes, a) for a in spec_axes(axes))))
    return tuple(out)


def sharding_rows(module: nn.Module, mesh: xs.Mesh) -> list[ParamRow]:
    """One row per parameter, from the sharding ``parallelize_xla`` recorded (else replicated)."""
    rows = []
    for name, p in module.named_parameters():
        rec = getattr(p, SHARDING_ATTR, None)
        spec = rec.spec if rec is not None else (None,) * p.dim()
        shape = tuple(p.shape)
        loc = local_shape(shape, spec, mesh)
        rows.append(ParamRow(name, shape, spec, loc, math.prod(loc) * p.element_size()))
    return rows


def format_table(rows: list[ParamRow]) -> str:
    """A fixed-width table with a total line."""
    head = ("parameter", "shape", "spec", "per-device", "bytes/device")
    body = [(r.name, str(r.shape), str(r.spec), str(r.local_shape), str(r.local_bytes)) for r in rows]
    body.append(("total", "", "", "", str(sum(r.local_bytes for r in rows))))
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*line) for line in [head, *body])
