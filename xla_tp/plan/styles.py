"""xla_tp's own styles: the ``Style`` protocol, and ``ShardParams`` (specs and chains given directly).

Every xla_tp style (``ShardParams``, rule-list entries, the planners' ``LogicalStyle``) is a
``Style``: it lowers itself to a ``ModuleLayout`` for the module a plan key matched, and may say how
to lower a key that names one parameter (``lower_param``; by default the module is lowered and that
parameter's spec kept).

For what torch's styles cannot say: GPT-2's ``Conv1D`` (weight ``[in, out]``), packed q/k/v
projections, ``nn.MultiheadAttention``'s ``in_proj_weight``, a norm sharded over its features.
The axis name ``"tp"`` stands for the tensor-parallel axis of the mesh it is applied on.
Example (GPT-2's Conv1D stores ``[in, out]``: column-parallel splits dim 1, and the bias):

>>> conv1d_col = ShardParams({"weight": (None, "tp"), "bias": ("tp",)})
>>> conv1d_col.lower("h.0.attn.c_attn", nn.Linear(4, 4), "h.*.attn.c_attn", "model").params
{'weight': (None, 'model'), 'bias': ('model',)}
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Placement

from ..axes import TP
from ..errors import PlanError
from .layout import Chain, ModuleLayout


class Style(ABC):
    """What a plan value must do to be an xla_tp style (torch ``ParallelStyle``s and HF strings are
    lowered by their own front-ends)."""

    @abstractmethod
    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        """The layout this style asks of ``module`` (at ``fqn``, matched by plan ``key``)."""

    def lower_param(self, fqn: str, module: nn.Module, param: str, key: str, tp_axis: str) -> ModuleLayout:
        """A key naming parameter ``param`` of ``module``: only that parameter is planned."""
        whole = self.lower(fqn, module, key, tp_axis)
        params = {param: whole.params[param]} if param in whole.params else {}
        return ModuleLayout(fqn=fqn, source=key, style=whole.style, params=params)


@dataclass(frozen=True)
class ShardParams(Style):
    """Shard named parameters of one module; optionally constrain its inputs and outputs."""

    params: Mapping[str, tuple[Optional[str], ...]] = field(default_factory=dict)
    inputs: tuple[Chain, ...] = ()
    outputs: tuple[Chain, ...] = ()
    kwarg_inputs: Mapping[str, Chain] = field(default_factory=dict)
    natural_output: Optional[Placement] = None  # Partial() for a row-parallel module (see ModuleLayout)
    input_grad: bool = False  # an MoE experts layer's (see ModuleLayout)

    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        own = dict(module.named_parameters(recurse=True))
        missing = [n for n in self.params if n not in own]
        if missing:
            raise PlanError(f"plan key {key!r}: module {fqn!r} ({type(module).__name__}) has no "
                            f"parameters {missing}; it has {sorted(own)}")
        params = {n: tuple(tp_axis if a == TP else a for a in spec) for n, spec in self.params.items()}
        return ModuleLayout(fqn=fqn, source=key, style=repr(self), params=params, inputs=self.inputs,
                            kwarg_inputs=dict(self.kwarg_inputs), outputs=self.outputs,
                            natural_output=self.natural_output, input_grad=self.input_grad)
