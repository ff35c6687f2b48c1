"""Logical axes -> mesh axes: the one table every "auto" plan goes through, and its style.

A planner says what each parameter dimension *is* (``vocab``, ``heads``, ``mlp``, ``embed``);
``LOGICAL_AXES`` says which mesh axis each of those is split over, in the spirit of MaxText's logical
axis rules. ``embed`` stays whole here: on an ``fsdp`` mesh axis the layout shards each parameter's
first free dimension over ``fsdp`` afterwards (``plan.normalize``). Example:

>>> style = LogicalStyle({"weight": ("heads", "embed")}, role="column-parallel")
>>> style.lower("layers.0.wq", nn.Linear(64, 64), "layers.*.wq", "model").params
{'weight': ('model', None)}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Placement

from ..plan.layout import Chain, ModuleLayout
from ..plan.styles import ShardParams, Style
from ..plan.subaxis import split_sub_axis, sub_axis

TP = "tp"  # stands for the tensor-parallel axis of the mesh the plan is applied on
LOGICAL_AXES: tuple[tuple[str, Optional[str]], ...] = (
    ("vocab", TP),
    ("heads", TP),
    ("kv_heads", TP),
    ("mlp", TP),
    ("kernel", TP),  # a patch embedding's kernel rows
    ("embed", None),
)
_TABLE = dict(LOGICAL_AXES)


def mesh_axis(logical: Optional[str]) -> Optional[str]:
    """``mesh_axis("heads") == "tp"``; ``mesh_axis("heads@4") == "tp@4"`` (a sub-axis: ``plan.subaxis``);
    ``mesh_axis("embed") is None``; unknown names are an error."""
    if logical is None:
        return None
    base, size = split_sub_axis(logical)
    if base not in _TABLE:
        raise KeyError(f"logical axis {logical!r} is not in LOGICAL_AXES ({', '.join(_TABLE)})")
    axis = _TABLE[base]
    return axis if size is None or axis is None else sub_axis(axis, size)


def _on(axis: Optional[str], tp_axis: str) -> Optional[str]:
    """``TP`` (and its sub-axes) named after the mesh's tensor-parallel axis."""
    base, size = split_sub_axis(axis) if axis is not None else (None, None)
    if base != TP:
        return axis
    return tp_axis if size is None else sub_axis(tp_axis, size)


@dataclass(frozen=True)
class LogicalStyle(Style):
    """Per-parameter logical axes, lowered through ``LOGICAL_AXES``; ``role`` labels explanations."""

    params: Mapping[str, tuple[Optional[str], ...]] = field(default_factory=dict)
    role: str = ""
    natural_output: Optional[Placement] = None  # Partial() for a row-parallel module (see ModuleLayout)
    outputs: tuple[Chain, ...] = ()  # output constraints (an output head keeps its logits split)

    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        specs = {n: tuple(_on(mesh_axis(a), tp_axis) for a in axes) for n, axes in self.params.items()}
        ml = ShardParams(specs, outputs=self.outputs, natural_output=self.natural_output).lower(fqn, module, key, tp_axis)
        ml.style = self.role or repr(self)
        return ml

    def __repr__(self) -> str:
        return f"LogicalStyle({self.role}: {dict(self.params)})"
